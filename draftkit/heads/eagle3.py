"""EAGLE-3 (Li et al., 2025): fuse three target layers, draft over a reduced vocabulary, train with
the draft's own outputs fed back (training-time test, TTT).

At position t the head sees g_t = fc([l_t; m_t; h_t]) (three target layers, 3H -> H) and x_{t+1}:
    o_t   = midlayer([input_layernorm(embed(x_{t+1})); hidden_norm(g_t)])   (q/k/v read 2H; residual g_t)
    p̂     = softmax(lm_head(norm(o_t)))       over the N draft tokens; predicts x_{t+2}
Draft step i > 0 feeds its own o (pre-norm) back in place of g, with the next token. Training
unrolls `ttt_steps` such steps (step i at position t: token x_{t+1+i}, rotary position t+i) and
each query attends to step-0 keys at positions <= t plus the keys of ITS OWN earlier steps at t
(the "diagonal"): exactly the cache sequential drafting builds after the prefix 0..t.
Loss = sum_i ttt_decay^i * KL(p_target restricted to the draft vocab, renormalised || p̂_i), each
step's mean over its positions; with loss_weighting "on_policy" only over the (position, step) states
the greedy loop visits walking the sample (its roots, and the depths up to each root's first miss),
over the number of roots, from training step on_policy_from on (decay before it: a warm start).
p_target is the target's full distribution (rebuilt from its final hidden state), or with
train.target_topk = k its stored top-k restricted to the draft vocabulary and renormalised: the final
hidden state is only the label here, so k * 6 bytes per token can stand in for its H * 2.

Parameter names follow the EAGLE-3 reference / vLLM llama_eagle3 checkpoints (fc, midlayer.*,
norm, lm_head, d2t, t2d); vLLM loads `midlayer.` as `layers.0.` and `d2t` as draft_id_to_target_id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from draftkit.heads.base import DraftHead, HeadConfig, HeadError, SampleFn
from draftkit.heads.layers import (ChainState, DecoderLayer, LayerDims, LayerKV, RMSNorm, UnrolledMask,
                                   last_valid)
from draftkit.heads.losses import kl_rows, on_policy_weights
from draftkit.heads.vocab import (DraftVocab, build_draft_vocab, check_draft_vocab_size, in_vocab_mean,  # noqa: F401
                                  token_counts)


@dataclass
class Eagle3Config(HeadConfig):
    type: str = "eagle3"
    # Target layers fused by fc, low / middle / high, in draftkit's convention (draftkit.target):
    # index i = residual stream ENTERING decoder layer i = transformers hidden_states[i]. None =
    # the EAGLE-3 reference default (2, N//2, N-3) for an N-layer target. vLLM's
    # eagle_aux_hidden_state_layer_ids use this same convention. SGLang's and SpecForge's ids name
    # the layer whose OUTPUT is taken (SpecForge's default is [1, N//2-1, N-4]): ours minus 1.
    # draftkit export writes each engine's own ids (see draftkit/export/sglang.py).
    feature_layers: list[int] | None = None
    # Size N of the draft vocabulary: the N most frequent tokens of the training responses
    # (set by the trainer through head.set_draft_vocab). None = min(32000, target vocab), as the
    # reference uses 32k for Llama-3's 128k vocabulary. Must not exceed the target's vocabulary.
    draft_vocab_size: int | None = None
    # Training-time test: drafting steps unrolled per training sample, and the weight of step i.
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    # Start lm_head from the target's lm_head rows of the draft tokens ("target") or at random
    # as the reference does ("random").
    lm_head_init: Literal["target", "random"] = "target"
    # Which unrolled (position, step) pairs the loss counts. "decay": every position as a root, step
    # i weighing ttt_decay^i (the reference). "on_policy": only the states the greedy draft-verify
    # loop visits when it walks the sample with ttt_steps drafts per step (heads/losses.py
    # on_policy_weights: its roots, and at each the depths up to the first miss), step i still
    # weighing ttt_decay^i, each step's sum over the number of roots: the loss is the loop's expected
    # loss per step, so a depth weighs as often as the loop reaches it. The head's current drafts
    # decide, so this follows it as it learns.
    loss_weighting: Literal["decay", "on_policy"] = "decay"
    # With "on_policy": the training step from which it counts; the steps before it train with "decay"
    # (Draft-OPD's warm start: the head first learns the data, then its own drafts decide which states
    # count). 0 = on-policy from the first step.
    on_policy_from: int = 0

    def fill_from_target(self, target) -> None:
        super().fill_from_target(target)
        n = target.num_layers
        if self.feature_layers is None:
            self.feature_layers = [2, n // 2, n - 3]
        if self.draft_vocab_size is None:
            self.draft_vocab_size = min(32000, target.vocab_size)


class Eagle3Layer(DecoderLayer):
    """The one decoder layer: embedding and hidden normalised apart, concatenated for q/k/v (2H)."""

    def __init__(self, d: LayerDims):
        super().__init__(d, input_norm=False)
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)  # on the fused / own hidden

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                kv: LayerKV | None = None) -> Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        h = hidden + self.self_attn(x, cos, sin, mask, kv)  # residual: the un-normalised hidden
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DraftVocab, DraftHead):
    family = "eagle3"
    config_class = Eagle3Config
    topk_teacher = True  # the final hidden state is only the label: its top-k can replace it

    def __init__(self, config: Eagle3Config, shared=None):
        super().__init__(config, shared)
        H, V = config.hidden_size, config.vocab_size
        N = config.draft_vocab_size or V
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3Layer(config.layer_dims(input_size=2 * H))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)
        self.init_draft_vocab(N, V)  # d2t, t2d (draftkit.heads.vocab)
        if shared is not None:
            self._init_lm_head()

    @classmethod
    def feature_layers_of(cls, config: Eagle3Config) -> tuple[int, ...]:
        return tuple(config.feature_layers or ())

    @classmethod
    def validate(cls, config: Eagle3Config, target) -> None:
        if config.feature_layers is None or len(config.feature_layers) != 3:
            raise HeadError("head.feature_layers: EAGLE-3 fuses exactly three target layers, "
                            f"got {config.feature_layers}")
        super().validate(config, target)
        check_draft_vocab_size(config.draft_vocab_size, target)
        if config.ttt_steps < 1:
            raise HeadError(f"head.ttt_steps: must be >= 1, got {config.ttt_steps}")
        if config.loss_weighting not in ("decay", "on_policy"):
            raise HeadError(f"head.loss_weighting: 'decay' or 'on_policy', got {config.loss_weighting!r}")
        if config.on_policy_from < 0:  # an int: the schema (draftkit/schema.py) checked the type
            raise HeadError(f"head.on_policy_from: a training step >= 0, got {config.on_policy_from!r}")
        if config.on_policy_from and config.loss_weighting != "on_policy":
            raise HeadError(f"head.on_policy_from={config.on_policy_from} schedules on-policy weighting, "
                            f"but head.loss_weighting is {config.loss_weighting!r} (set it to 'on_policy')")

    # ---- the draft vocabulary (d2t / t2d, set_draft_vocab, to_target_logits: draftkit.heads.vocab) ----
    def draft_vocab_changed(self) -> None:
        """With lm_head_init="target", restart lm_head from the target's rows of the new draft tokens."""
        if self._shared is not None:
            self._init_lm_head()

    @torch.no_grad()
    def _init_lm_head(self) -> None:
        if self.config.lm_head_init == "target":
            w = self.shared.lm_head.weight
            self.lm_head.weight.copy_(w[self.draft_ids.to(w.device)].to(self.lm_head.weight))

    # ---- the network ----
    def forward(self, hidden: Tensor, ids: Tensor, positions: Tensor, mask: Tensor,
                kv: LayerKV | None = None) -> Tensor:
        # hidden: (B, T, H) fused g_t or own o; ids: (B, T) next tokens; mask: (B, 1, T, S)
        dtype = self.fc.weight.dtype
        cos, sin = self.cos_sin(positions, dtype)
        return self.midlayer(self.embed(ids, dtype), hidden.to(dtype), cos, sin, mask, kv)  # (B, T, H) o

    def logits(self, o: Tensor) -> Tensor:
        return self.lm_head(self.norm(o)).float()  # (..., N)

    # ---- training ----
    def unroll(self, features, steps: int | None = None) -> list[Tensor]:
        """TTT forward: the pre-norm outputs o of steps 0..steps-1, each (B, T-1, H).

        Step i at position t consumes token x_{t+1+i} and predicts x_{t+2+i}; its query sees
        step-0 keys at positions <= t (causal, padding hidden) and its own steps 1..i at t.
        """
        steps = steps or self.config.ttt_steps
        ids, attn = features.input_ids, features.attention_mask.bool()
        B, T = ids.shape
        L = T - 1
        pair = attn[:, :-1] & attn[:, 1:]  # (B, L) (g_t, x_{t+1}) both real
        padded = torch.cat([ids, ids.new_zeros(B, steps)], dim=1)  # tokens past the end: never supervised
        h = self.fc(features.hidden[:, :-1].to(self.fc.weight.dtype))  # (B, L, H) g_t
        kv, outs = LayerKV(), []
        for i in range(steps):
            pos = torch.arange(i, L + i, device=ids.device).expand(B, -1)
            # step-0 keys causally + its own steps' keys at t, with no dense (L, (i+1) L) mask
            h = self(h, padded[:, 1 + i: 1 + i + L], pos, UnrolledMask(pair, i), kv)
            outs.append(h)
        return outs

    def loss(self, features) -> dict[str, Tensor]:
        c = self.config
        ids, attn = features.input_ids, features.attention_mask.bool()
        lm = (features.loss_mask if features.loss_mask is not None else attn).bool() & attn
        T = ids.shape[1]
        outs = self.unroll(features)
        on_policy = c.loss_weighting == "on_policy" and self.steps_done >= c.on_policy_from
        means, kls, sups, hits, metrics = [], [], [], [], {}
        for i, o in enumerate(outs):
            # Step i at t predicts x_{t+2+i}: supervised when that is a loss token (t < n); the
            # target's distribution for it sits at t+1+i.
            n = max(T - 2 - i, 0)
            sup = torch.zeros_like(attn[:, :-1])  # (B, T-1)
            sup[:, :n] = lm[:, 2 + i:] & attn[:, :n] & attn[:, 1:1 + n]
            rows = lambda x: None if x is None else x[:, 1 + i: 1 + i + n][sup[:, :n]]  # noqa: E731  (M, ...)
            if features.topk_ids is not None:  # the target's stored top-k (train.target_topk)
                teacher = (self.topk_on_draft_vocab, rows(features.topk_ids), rows(features.topk_logp))
            else:  # the target's logits, rebuilt from its final hidden state
                teacher = (self.target_on_draft_vocab, rows(features.final_hidden), rows(features.top1))
            kl, hit, top = self.step_rows(o[sup], *teacher)
            means.append(in_vocab_mean(kl, top, self.t2d))
            if on_policy:  # the walk's inputs: per-row KL and this step's hits laid out (B, T-1)
                kls.append(kl * self.t2d[top].float())  # rows whose top-1 the draft vocabulary lacks: left out
                grid = torch.zeros_like(sup)
                grid[sup] = hit
                sups.append(sup)
                hits.append(grid)
            metrics[f"kl_{i}"] = means[-1].detach()
            metrics[f"acc_{i}"] = hit.float().sum() / max(hit.shape[0], 1)
            metrics.setdefault("tokens", torch.tensor(float(hit.shape[0])))
        if on_policy:
            w = on_policy_weights(torch.stack(hits, 1), torch.stack(sups, 1))  # (B, S, T-1)
            roots = w[:, 0].sum()
            total = sum(c.ttt_decay ** i * (kl * w[:, i][sups[i]]).sum() for i, kl in enumerate(kls)) / roots.clamp(min=1)
            metrics["roots"] = roots / sups[0].sum().clamp(min=1)  # share of positions the walk roots at
            for i in range(1, len(kls)):
                metrics[f"reach_{i}"] = w[:, i].sum() / roots.clamp(min=1)  # share of roots verified at step i
        else:
            total = sum(c.ttt_decay ** i * m for i, m in enumerate(means))
        return {"loss": total, "acc": metrics["acc_0"], **metrics}

    def step_rows(self, o: Tensor, teacher, *teacher_in: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Per-row KL over M supervised positions: o (M, H) -> (kl (M,), hit (M,) bool: the head's argmax
        is the target's top-1, the target's top-1 (M,)). teacher(*teacher_in) gives the target's (M, N)
        draft-vocabulary logits and (M,) top-1: target_on_draft_vocab over the final hidden (M, H) and
        top1 (M,) | None, or topk_on_draft_vocab over the top-k (M, k) ids and log-probs."""
        # rows in chunks over the draft vocabulary (heads/losses.py): no (M, N) tensors kept
        kl, pred, top = kl_rows(self.logits, teacher, o, *teacher_in, vocab=self.lm_head.weight.shape[0])
        return kl, (self.draft_ids[pred] == top).detach(), top

    # ---- drafting ----
    def new_draft_state(self, batch_size: int) -> ChainState:
        dev = self.fc.weight.device
        return ChainState([LayerKV()], torch.zeros(batch_size, 0, dtype=torch.bool, device=dev),
                          torch.zeros(batch_size, dtype=torch.long, device=dev), window=self.attention_window)

    def _step(self, state: ChainState, hidden: Tensor, ids: Tensor, valid: Tensor, positions: Tensor) -> Tensor:
        return self(hidden, ids, positions, state.feed(valid, positions), state.kv[0])

    def _consume(self, state: ChainState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        """Drop last call's speculation, feed the newly confirmed (fused feature, next token) pairs
        (B, n); returns (B, H) o after each row's newest token."""
        state.drop_speculation()
        positions = state.next_pos[:, None] + valid.long().cumsum(1) - 1
        g = self.fc(feats.to(self.fc.weight.dtype))  # (B, n, H)
        o = last_valid(self._step(state, g, next_tokens, valid, positions.clamp(min=0)), valid)  # (B, H)
        state.confirmed += valid.shape[1]
        state.next_pos = state.next_pos + valid.long().sum(1)
        return o

    @torch.no_grad()
    def draft(self, state: ChainState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample: SampleFn) -> tuple[Tensor, Tensor | None]:
        o = self._consume(state, feats, next_tokens, valid)
        # Chain k drafts over the draft vocabulary, sampled there and mapped back to target ids.
        tokens, probs = [], []
        ones = torch.ones(o.shape[0], 1, dtype=torch.bool, device=o.device)
        for i in range(k):
            tok, prob = self.sample_draft(self.logits(o), sample)  # (B,), (B, V) | None
            tokens.append(tok)
            probs.append(prob)
            if i + 1 < k:
                o = self._step(state, o[:, None], tok[:, None], ones, (state.next_pos + i)[:, None])[:, 0]
        return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)

    # ---- tree drafting (DraftHead.draft_tree grows the tree from these) ----
    def tree_root(self, state: ChainState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        return self._consume(state, feats, next_tokens, valid)

    def tree_logp(self, o: Tensor, depth: int) -> Tensor:
        return torch.log_softmax(self.logits(o), dim=-1)  # over the draft vocabulary (draft_vocab)

    def tree_step(self, state: ChainState, parent_o: Tensor, tokens: Tensor, depth: int, visible: Tensor) -> Tensor:
        positions = (state.next_pos + depth - 1)[:, None].expand_as(tokens)
        return self(parent_o, tokens, positions, state.feed_tree(visible, positions), state.kv[0])
