"""EAGLE-1 (Li et al., 2024): extrapolate the target's next feature, read it with the target's lm_head.

At position t the head sees the target feature f_t (the final-norm output the lm_head reads, as the
EAGLE reference takes `hidden_states[-1]`) and the embedding of the next token x_{t+1}:
    x   = fc([embed(x_{t+1}); f_t])                      (2H -> H)
    f̂   = decoder layer(s)(x)                            (no input norm on the first layer)
    p̂   = softmax(lm_head(f̂))                            predicts x_{t+2}
Loss = w_feat * SmoothL1(f̂, f_{t+1}) + w_tok * KL(p_target(x_{t+2}) || p̂).
Drafting feeds f̂ back in place of f for the next step.

Optional draft vocabulary (draft_vocab_size = N): p̂ and the target's p are taken over the N most
frequent response tokens only (lm_head rows gathered once, p renormalised over them; positions whose
target top-1 lies outside are left out of the KL), and drafts scatter N logits into -inf over V.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftkit.heads.base import DraftHead, HeadConfig, HeadError, SampleFn
from draftkit.heads.layers import ChainState, DecoderLayer, LayerKV, causal_mask, last_valid
from draftkit.heads.losses import kl_rows
from draftkit.heads.vocab import DraftVocab, check_draft_vocab_size, in_vocab_mean
from draftkit.target import FINAL


@dataclass
class EagleConfig(HeadConfig):
    type: str = "eagle"
    # Decoder layers in the head (the EAGLE paper uses 1).
    num_layers: int = 1
    # Loss weights: feature regression (SmoothL1) and token distribution (KL), as in the paper.
    w_feat: float = 1.0
    w_tok: float = 0.1
    # Bias on fc. The EAGLE-1 reference has one, but vLLM's llama_eagle builds fc without bias,
    # so the default is off to keep every trained head servable there (SGLang gets a zero bias).
    fc_bias: bool = False
    # Target layers the head reads: the final norm output (see draftkit.target for the convention).
    feature_layers: list[int] = field(default_factory=lambda: [FINAL])
    # Draft over the N most frequent response tokens (picked by the trainer, as EAGLE-3's d2t/t2d)
    # instead of the whole target vocabulary. On a small target the frozen lm_head dominates the
    # cost: on SmolLM2-135M (V 49152, H 576) the head's and the target's logits and the backward
    # through lm_head are ~90% of a training step, and a full-vocabulary draft step ~1/5 of a
    # target step. Only the KL term and the drafted tokens change; the feature regression does not.
    # None = the full target vocabulary. vLLM / SGLang EAGLE-1 cannot serve a draft vocabulary
    # (draftkit export refuses, or drops it with --full-vocab).
    draft_vocab_size: int | None = None
    # Training-time noise on the input features: f_t + U(-a, a), the EAGLE reference's data
    # augmentation (its "uniform, std 0.2" scaled by 512 / length: +-0.1 on its 512-token samples),
    # so the head learns to continue from its own imperfect features when drafting. The
    # regression target stays clean; off in eval mode. 0 = off.
    feature_noise: float = 0.0


class EagleHead(DraftVocab, DraftHead):
    family = "eagle"
    config_class = EagleConfig

    def __init__(self, config: EagleConfig, shared=None):
        super().__init__(config, shared)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(config.layer_dims(), input_norm=i > 0) for i in range(config.num_layers))
        if config.draft_vocab_size is not None:
            self.init_draft_vocab(config.draft_vocab_size, config.vocab_size)  # d2t, t2d buffers
        object.__setattr__(self, "_vocab_w", None)  # (key, (N, H) lm_head rows): a cache, never saved

    @classmethod
    def feature_layers_of(cls, config: EagleConfig) -> tuple[int, ...]:
        return tuple(config.feature_layers)

    @classmethod
    def validate(cls, config: EagleConfig, target) -> None:
        super().validate(config, target)
        if len(config.feature_layers) != 1:
            raise HeadError(f"head.feature_layers: EAGLE reads exactly one layer, got {config.feature_layers}")
        if config.num_layers < 1:
            raise HeadError(f"head.num_layers: must be >= 1, got {config.num_layers}")
        if config.feature_noise < 0:
            raise HeadError(f"head.feature_noise: the half-width of uniform noise must be >= 0, got {config.feature_noise}")
        if config.draft_vocab_size is not None:
            check_draft_vocab_size(config.draft_vocab_size, target)

    # ---- the draft vocabulary (d2t / t2d, to_target_logits: draftkit.heads.vocab) ----
    @property
    def has_draft_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    def set_draft_vocab(self, tokens=None, *, counts=None) -> None:
        """See DraftVocab.set_draft_vocab; a no-op without a draft vocabulary (draft_vocab_size None)."""
        if self.has_draft_vocab:
            super().set_draft_vocab(tokens, counts=counts)

    def draft_vocab_changed(self) -> None:
        object.__setattr__(self, "_vocab_w", None)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """(..., H) -> (..., N) float32 logits of the frozen lm_head's draft-vocabulary rows."""
        return self.target_rows_logits(hidden)

    # ---- the network ----
    def forward(self, feats: Tensor, next_ids: Tensor, positions: Tensor, mask: Tensor,
                kv: list[LayerKV] | None = None) -> Tensor:
        # feats: (B, T, H) f_t; next_ids: (B, T) x_{t+1}; positions: (B, T); mask: (B, 1, T, S)
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([self.embed(next_ids, dtype), feats.to(dtype)], dim=-1))  # (B, T, H)
        cos, sin = self.cos_sin(positions, dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, x, cos, sin, mask, kv[i] if kv is not None else None)
        return x  # (B, T, H) predicted f_{t+1}

    # ---- training ----
    def loss(self, features) -> dict[str, Tensor]:
        f = features.hidden.float()  # (B, T, H)
        ids, attn = features.input_ids, features.attention_mask.bool()
        B, T, _ = f.shape
        valid = attn[:, 1:] & attn[:, :-1]  # (B, T-1) both ends of each pair real
        positions = torch.arange(T - 1, device=f.device).expand(B, -1)
        inputs = f[:, :-1]
        if self.training and self.config.feature_noise > 0:  # the reference's augmentation; targets stay clean
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * self.config.feature_noise
        pred = self(inputs, ids[:, 1:], positions, causal_mask(valid))  # (B, T-1, H) f̂_{t+1}
        # Position t is supervised when x_{t+2} is a loss token (an assistant token).
        lm = features.loss_mask if features.loss_mask is not None else attn.long()
        sup = torch.zeros_like(valid)
        sup[:, :-1] = lm[:, 2:].bool() & valid[:, :-1]
        top1 = features.top1[:, 1:][sup] if features.top1 is not None else None
        return self.distill_loss(pred[sup], f[:, 1:][sup], features.final_hidden[:, 1:][sup], top1)

    def distill_loss(self, pred: Tensor, target_feat: Tensor, target_final: Tensor,
                     top1: Tensor | None = None) -> dict[str, Tensor]:
        """Losses over the M supervised positions only: pred/target (M, H), top1 (M,) | None.

        The KL runs over the draft vocabulary (restricted, renormalised; rows whose target top-1
        lies outside are left out) or the full one, rows in chunks (heads/losses.py); acc compares
        target ids either way, so it is comparable between the two.
        """
        c = self.config
        feat = F.smooth_l1_loss(pred.float(), target_feat.float(), reduction="none").mean(-1)  # (M,)
        n = max(pred.shape[0], 1)
        if self.has_draft_vocab:
            kl, guess, top = kl_rows(self.draft_logits, self.target_on_draft_vocab, pred, target_final, top1,
                                     vocab=self.d2t.shape[0])
            kl_l, guess = in_vocab_mean(kl, top, self.t2d), self.draft_ids[guess]
        else:
            kl, guess, top = kl_rows(self.target_logits, self.target_logits_top1, pred, target_final,
                                     vocab=self.config.vocab_size)
            kl_l = kl.sum() / n
        feat_l = feat.sum() / n
        return {"loss": c.w_feat * feat_l + c.w_tok * kl_l, "feat_loss": feat_l.detach(),
                "kl": kl_l.detach(), "acc": (guess == top).float().sum().detach() / n,
                "tokens": torch.tensor(float(pred.shape[0]))}

    # ---- drafting ----
    def new_draft_state(self, batch_size: int) -> ChainState:
        dev = self.fc.weight.device
        return ChainState([LayerKV() for _ in self.layers],
                          torch.zeros(batch_size, 0, dtype=torch.bool, device=dev),
                          torch.zeros(batch_size, dtype=torch.long, device=dev), window=self.attention_window)

    def _step(self, state: ChainState, feats: Tensor, ids: Tensor, valid: Tensor, positions: Tensor) -> Tensor:
        return self(feats, ids, positions, state.feed(valid, positions), state.kv)

    def _consume(self, state: ChainState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        """Drop last call's speculation, feed the newly confirmed (feature, next token) pairs (B, n);
        returns (B, H) f̂ after each row's newest token."""
        state.drop_speculation()
        positions = state.next_pos[:, None] + valid.long().cumsum(1) - 1
        out = self._step(state, feats, next_tokens, valid, positions.clamp(min=0))
        state.confirmed += valid.shape[1]
        state.next_pos = state.next_pos + valid.long().sum(1)
        return last_valid(out, valid)

    def vocab_logits(self, h: Tensor) -> Tensor:
        """(..., H) -> (..., n) float32 over draft_vocab (the target's vocabulary when None)."""
        return self.draft_logits(h) if self.has_draft_vocab else self.target_logits(h)

    def _logits(self, h: Tensor) -> Tensor:
        """(..., H) -> (..., V) float32 over the target vocabulary (-inf off the draft vocabulary)."""
        logits = self.vocab_logits(h)
        return self.to_target_logits(logits) if self.has_draft_vocab else logits

    @torch.no_grad()
    def draft(self, state: ChainState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample: SampleFn) -> tuple[Tensor, Tensor | None]:
        h = self._consume(state, feats, next_tokens, valid)  # (B, H)
        # Chain k drafts, feeding each predicted feature and drafted token back in.
        tokens, probs = [], []
        ones = torch.ones(h.shape[0], 1, dtype=torch.bool, device=h.device)
        for i in range(k):
            tok, prob = self.sample_draft(self.vocab_logits(h), sample)  # (B,), (B, V) | None; 0 off the draft vocabulary
            tokens.append(tok)
            probs.append(prob)
            if i + 1 < k:
                pos = (state.next_pos + i)[:, None]
                h = self._step(state, h[:, None], tok[:, None], ones, pos)[:, 0]
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        return torch.stack(tokens, 1), draft_probs

    # ---- tree drafting (DraftHead.draft_tree grows the tree from these) ----
    def tree_root(self, state: ChainState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        return self._consume(state, feats, next_tokens, valid)

    def tree_logp(self, h: Tensor, depth: int) -> Tensor:
        """Over the draft vocabulary when there is one (draft_vocab maps it): no 49k scatter per depth."""
        return torch.log_softmax(self.vocab_logits(h), dim=-1)

    def tree_step(self, state: ChainState, parent_h: Tensor, tokens: Tensor, depth: int, visible: Tensor) -> Tensor:
        positions = (state.next_pos + depth - 1)[:, None].expand_as(tokens)
        return self(parent_h, tokens, positions, state.feed_tree(visible, positions), state.kv)
