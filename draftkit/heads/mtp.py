"""Multi-token prediction, DeepSeek-V3 style: D sequential depth modules on the frozen target.

Depth d (0-based) at position t combines the hidden h^{d-1}_t (h^{-1} = the target's final-norm
output f_t, what vLLM hands its MTP drafter) with the token x_{t+1+d}:
    h^d_t = mtp_block(eh_proj([enorm(embed(x_{t+1+d})); hnorm(h^{d-1}_t)]))   (2H -> H, one decoder layer)
    p̂_d   = softmax(lm_head(shared_head.norm(h^d_t)))   predicts x_{t+2+d}; lm_head = the target's, frozen
Each depth attends causally over its own sequence (rotary position t + d). Training is teacher
forced (DeepSeek-V3): loss = sum_d w_d KL(p_target(x_{t+2+d}) || p̂_d).
Drafting keeps one KV cache per depth holding exactly what training shows it, so draft d equals
the training prediction of depth d; drafts past D reuse the LAST module autoregressively, feeding
its own hidden and the previous draft (EAGLE-style chain). vLLM instead picks module
step % D (v0) or always the first (v1); all three agree for D = 1, the only depth DeepSeek ships.
Names follow vLLM's deepseek_mtp (layers.{d}.enorm / hnorm / eh_proj / mtp_block / shared_head.norm;
shared_head.head is the target's lm_head, not stored): export adds the target's layer count to d.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from draftkit.heads.base import DraftHead, HeadConfig, HeadError, SampleFn
from draftkit.heads.layers import ChainState, DecoderLayer, LayerKV, RMSNorm, causal_mask
from draftkit.heads.losses import kl_rows
from draftkit.target import FINAL


@dataclass
class MTPConfig(HeadConfig):
    type: str = "mtp"
    # D: depth modules; depth d predicts the token d+2 past the position whose hidden it reads.
    num_depths: int = 1
    # Loss weight of depth d; None = 1.0 for every depth.
    depth_weights: list[float] | None = None
    # The target hidden depth 0 reads: the final norm output [-1] (vLLM feeds the target's
    # returned, post-norm hidden states to its MTP drafter). Fixed.
    feature_layers: list[int] = field(default_factory=lambda: [FINAL])


class SharedHead(nn.Module):
    """vLLM's shared_head without `head`: the final norm before the target's frozen lm_head."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(nn.Module):
    def __init__(self, config: MTPConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.mtp_block = DecoderLayer(config.layer_dims())
        self.shared_head = SharedHead(H, eps)

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                kv: LayerKV | None = None) -> Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # (B, T, H), vLLM's order
        return self.mtp_block(x, x, cos, sin, mask, kv)  # (B, T, H) h^d, before shared_head.norm


@dataclass
class MTPState:
    """One chain cache per depth, and per depth d >= 1 the newest confirmed h^{d-1} still waiting
    for its token (depth d's input at index s needs x_{s+1+d}, known one step later than d-1's)."""

    chains: list[ChainState]
    pending: list[Tensor]  # [d]: (B, H), zeros until the row has one
    pending_ok: list[Tensor]  # [d]: (B,) bool, False until the row has one
    next_pos: Tensor  # (B,) rotary position of the next confirmed entry

    def drop_speculation(self) -> None:
        for chain in self.chains:
            chain.drop_speculation()


class MTPHead(DraftHead):
    family = "mtp"
    config_class = MTPConfig

    def __init__(self, config: MTPConfig, shared=None):
        super().__init__(config, shared)
        self.layers = nn.ModuleList(MTPLayer(config) for _ in range(config.num_depths))

    @classmethod
    def feature_layers_of(cls, config: MTPConfig) -> tuple[int, ...]:
        return tuple(config.feature_layers)

    @classmethod
    def validate(cls, config: MTPConfig, target) -> None:
        super().validate(config, target)
        if list(config.feature_layers) != [FINAL]:
            raise HeadError(f"head.feature_layers: MTP reads the final norm output [{FINAL}], "
                            f"got {config.feature_layers}")
        if config.num_depths < 1:
            raise HeadError(f"head.num_depths: must be >= 1, got {config.num_depths}")
        if config.depth_weights is not None and len(config.depth_weights) != config.num_depths:
            raise HeadError(f"head.depth_weights: {len(config.depth_weights)} weights for {config.num_depths} depths")

    # ---- the network ----
    def forward(self, d: int, hidden: Tensor, ids: Tensor, positions: Tensor, mask: Tensor,
                kv: LayerKV | None = None) -> Tensor:
        # hidden: (B, T, H) h^{d-1}; ids: (B, T) x_{t+1+d}; positions: (B, T); mask: (B, 1, T, S)
        dtype = self.layers[d].eh_proj.weight.dtype
        cos, sin = self.cos_sin(positions, dtype)
        return self.layers[d](self.embed(ids, dtype), hidden.to(dtype), cos, sin, mask, kv)

    def logits(self, d: int, h: Tensor) -> Tensor:
        return self.target_logits(self.layers[d].shared_head.norm(h))  # (..., V) float32

    # ---- training ----
    def unroll(self, features) -> list[Tensor]:
        """Teacher-forced outputs h^d of every depth, each (B, T-1, H) over positions t = 0..T-2."""
        ids, attn = features.input_ids, features.attention_mask.bool()
        B, T = ids.shape
        L, D = T - 1, self.config.num_depths
        pad_ids = torch.cat([ids, ids.new_zeros(B, D)], 1)
        pad_attn = torch.cat([attn, attn.new_zeros(B, D)], 1)
        h, outs = features.hidden[:, :-1], []
        for d in range(D):
            ok = attn[:, :L] & pad_attn[:, 1 + d: 1 + d + L]  # (B, L) x_{t+1+d} exists
            pos = torch.arange(d, L + d, device=ids.device).expand(B, -1)
            h = self(d, h, pad_ids[:, 1 + d: 1 + d + L], pos, causal_mask(ok))
            outs.append(h)
        return outs

    def loss(self, features) -> dict[str, Tensor]:
        attn = features.attention_mask.bool()
        lm = (features.loss_mask if features.loss_mask is not None else attn).bool() & attn
        T = attn.shape[1]
        weights = self.config.depth_weights or [1.0] * self.config.num_depths
        total, metrics = 0.0, {}
        for d, (w, h) in enumerate(zip(weights, self.unroll(features))):
            n = max(T - 2 - d, 0)  # positions t whose x_{t+2+d} exists
            sup = lm[:, 2 + d:] & attn[:, :n]  # (B, n)
            kl, pred, top = kl_rows(lambda x, d=d: self.logits(d, x), self.target_logits_top1, h[:, :n][sup],
                                    features.final_hidden[:, 1 + d: 1 + d + n][sup], vocab=self.config.vocab_size)
            M = max(kl.shape[0], 1)  # rows in chunks over the vocabulary: heads/losses.py
            kl = kl.sum() / M
            total = total + w * kl
            metrics[f"kl_{d}"] = kl.detach()
            metrics[f"acc_{d}"] = (pred == top).float().sum().detach() / M
            metrics.setdefault("tokens", torch.tensor(float(pred.shape[0])))
        return {"loss": total, "acc": metrics["acc_0"], **metrics}

    # ---- drafting ----
    def new_draft_state(self, batch_size: int) -> MTPState:
        w = self.layers[0].eh_proj.weight
        zeros = torch.zeros(batch_size, dtype=torch.long, device=w.device)
        chains = [ChainState([LayerKV()], torch.zeros(batch_size, 0, dtype=torch.bool, device=w.device), zeros,
                             window=self.attention_window) for _ in self.layers]
        pending = [w.new_zeros(batch_size, self.config.hidden_size) for _ in self.layers]
        return MTPState(chains, pending, [zeros.bool() for _ in self.layers], zeros)

    def _step(self, chain: ChainState, d: int, hidden: Tensor, ids: Tensor, ok: Tensor, positions: Tensor) -> Tensor:
        return self(d, hidden, ids, positions, chain.feed(ok, positions), chain.kv[0])

    def _consume(self, state: MTPState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        """Drop last call's speculation, feed the confirmed entries to every depth; returns (B, H)
        depth 0's output at each row's newest index."""
        state.drop_speculation()
        D, (B, n) = len(self.layers), valid.shape
        rows = torch.arange(B, device=valid.device)
        # each row's valid entries packed to the front: (B, n)
        order = torch.sort((~valid.bool()).long(), dim=1, stable=True).indices
        idx = (rows[:, None], order)
        feats, tokens, valid = feats[idx], next_tokens[idx], valid.bool()[idx]
        positions = state.next_pos[:, None] + torch.arange(n, device=valid.device)
        last, has = (valid.sum(1) - 1).clamp(min=0), valid.any(1)
        ok, out = valid, self._step(state.chains[0], 0, feats, tokens, valid, positions)
        o = out[rows, last]  # (B, H) depth 0 at the newest index t
        for d in range(1, D):
            # Depth d pairs token j with depth d-1's output one entry earlier (the pending one at j = 0).
            prev = torch.cat([state.pending[d][:, None], out], 1)[:, :n]  # (B, n, H)
            prev_ok = torch.cat([state.pending_ok[d][:, None], ok], 1)[:, :n]
            state.pending[d] = torch.where(has[:, None], out[rows, last], state.pending[d])
            state.pending_ok[d] = torch.where(has, ok[rows, last], state.pending_ok[d])
            ok = prev_ok & valid
            out = self._step(state.chains[d], d, prev, tokens, ok, positions)
        for chain in state.chains:
            chain.confirmed = chain.slot_valid.shape[1]
        state.next_pos = state.next_pos + valid.long().sum(1)
        return o

    @torch.no_grad()
    def draft(self, state: MTPState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample: SampleFn) -> tuple[Tensor, Tensor | None]:
        D, B = len(self.layers), valid.shape[0]
        o = self._consume(state, feats, next_tokens, valid)
        # 2. Draft j comes from depth j, which first takes its j speculative entries (indices t-j+1..t,
        #    tokens = drafts 0..j-1); past the last depth, module D-1 chains on its own output.
        spec, drafts, probs = o[:, None][:, :0], [], []  # spec: (B, j, H) depth j-1's speculative outputs
        ones = torch.ones(B, D, dtype=torch.bool, device=valid.device)
        for j in range(k):
            if 0 < j < D:
                hidden = torch.cat([state.pending[j][:, None], spec], 1)  # (B, j, H)
                okj = torch.cat([state.pending_ok[j][:, None], ones[:, : j - 1]], 1)
                pos = state.next_pos[:, None] + torch.arange(j, device=valid.device)
                spec = self._step(state.chains[j], j, hidden, torch.stack(drafts, 1), okj, pos)
                o = spec[:, -1]
            elif j >= D:
                pos = (state.next_pos + j - 1)[:, None]
                o = self._step(state.chains[D - 1], D - 1, o[:, None], drafts[-1][:, None], ones[:, :1], pos)[:, 0]
            tok, prob = sample(self.logits(min(j, D - 1), o))  # (B,), (B, V) | None
            drafts.append(tok)
            probs.append(prob)
        return torch.stack(drafts, 1), None if probs[0] is None else torch.stack(probs, 1)

    # ---- tree drafting (DraftHead.draft_tree grows the tree from these) ----
    @property
    def max_tree_depth(self) -> int | None:
        """Trees deeper than 1 need depth d's module over each node's own path: D = 1 only
        (the chain past the last depth is EAGLE-like, so any depth works there)."""
        return None if len(self.layers) == 1 else 1

    def tree_root(self, state: MTPState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        return self._consume(state, feats, next_tokens, valid)

    def tree_logp(self, h: Tensor, depth: int) -> Tensor:
        return torch.log_softmax(self.logits(len(self.layers) - 1 if depth > 1 else 0, h), dim=-1)

    def tree_step(self, state: MTPState, parent_h: Tensor, tokens: Tensor, depth: int, visible: Tensor) -> Tensor:
        D = len(self.layers)  # == 1 (max_tree_depth): the last module chains on its own output
        chain = state.chains[D - 1]
        positions = (state.next_pos + depth - 1)[:, None].expand_as(tokens)
        return self(D - 1, parent_h, tokens, positions, chain.feed_tree(visible, positions), chain.kv[0])
