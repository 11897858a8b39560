"""A llama-style decoder layer for draft heads, with a KV cache that supports ragged rows.

Parameter names follow transformers' Llama (self_attn.q_proj, mlp.gate_proj, input_layernorm, ...)
so exports map onto vLLM / SGLang layouts without renaming inside the layer.

The cache keeps one slot per fed token for every row. Rows that accept different numbers of draft
tokens leave *holes* (slots marked invalid) instead of being cropped to a common length; the
attention mask hides invalid slots, and rotary positions are tracked per row by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Attention scores per query chunk of the unrolled (TTT) attention: B x heads x rows x keys.
UNROLL_CHUNK_ELEMENTS = 1 << 24


@dataclass
class LayerDims:
    """Shapes of one decoder layer, taken from the target's config."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    # Width of the attention / MLP input; EAGLE-3 feeds [embedding; hidden] (2H) into q/k/v.
    input_size: int | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, heads, T, d); cos/sin: (B, T, d)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class LayerKV:
    """Keys and values of one layer for every slot fed so far: (B, kv_heads, S, d)."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def truncate(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class Attention(nn.Module):
    def __init__(self, d: LayerDims):
        super().__init__()
        d_in = d.input_size or d.hidden_size
        self.n_heads, self.n_kv, self.head_dim = d.num_attention_heads, d.num_key_value_heads, d.head_dim
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: "Tensor | UnrolledMask",
                kv: LayerKV | None = None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, d)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, kv, T, d)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv.extend(k, v)  # (B, kv, S, d): earlier slots + these T
        if isinstance(mask, UnrolledMask):  # EAGLE-3's training unroll: no dense mask
            y = mask.attend(q, k, v)
        else:  # mask: (B, 1, T, S) bool, True = may attend. enable_gqa shares kv heads across q heads.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: LayerDims, d_in: int | None = None):
        super().__init__()
        d_in = d_in or d.hidden_size
        self.gate_proj = nn.Linear(d_in, d.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d_in, d.intermediate_size, bias=False)
        self.down_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm llama block. `input_norm=False` drops the input norm (EAGLE-1's first layer)."""

    def __init__(self, d: LayerDims, input_norm: bool = True):
        super().__init__()
        d_in = d.input_size or d.hidden_size
        self.input_layernorm = RMSNorm(d_in, d.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = MLP(d)

    def forward(self, x: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                kv: LayerKV | None = None) -> Tensor:
        # x: (B, T, d_in) attention input; residual: (B, T, H) the stream the output adds to.
        h = residual + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


def causal_mask(valid: Tensor) -> Tensor:
    """(B, T) validity -> (B, 1, T, T) bool: causal, padding keys hidden, every row sees itself."""
    T = valid.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    mask = causal[None] & valid[:, None, :].bool()
    return (mask | torch.eye(T, dtype=torch.bool, device=valid.device)[None]).unsqueeze(1)


@dataclass
class UnrolledMask:
    """Who sees whom in step `step` of a training unroll over L positions (EAGLE-3's TTT).

    The keys are the L step-0 keys, then L keys of each earlier step 1..step (the layer's cache,
    (B, kv, (step+1) L, d)). Query t sees the step-0 keys at positions <= t that are `valid`, the
    step-0 key at t itself, and the key at t of each of its own earlier steps (the "diagonal"): the
    cache sequential drafting builds after the prefix 0..t. Equal to sdpa with the dense
    (B, 1, L, (step+1) L) mask, built only while it is small (<= UNROLL_CHUNK_ELEMENTS): step 0 of
    right-padded rows is plain causal attention (padded queries are never read by real ones); past
    the budget queries go in chunks, each under activation checkpointing, so only O(L) is kept per
    step whatever L is (length 2048: benchmarks/loss_memory.py).
    """

    valid: Tensor  # (B, L) bool: step-0 keys of real (feature, token) pairs
    step: int

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q (B, h, L, d); k, v (B, kv, (step+1) L, d) -> (B, h, L, d)
        B, h, L, d = q.shape
        kv, gqa = k.shape[1], k.shape[1] != h
        if self.step == 0 and bool((self.valid.long().cummin(1).values == self.valid.long()).all()):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if B * L * (self.step + 1) * L <= UNROLL_CHUNK_ELEMENTS:  # small: one fused sdpa call
            own = torch.eye(L, dtype=torch.bool, device=q.device).expand(B, L, L)
            mask = torch.cat([self._step0_visible(0, L, L)] + [own] * self.step, dim=-1)  # (B, L, (step+1) L)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
        qg = q.view(B, kv, h // kv, L, d)  # query head j reads kv head j // (h / kv), as enable_gqa
        kd = k[:, :, L:].unflatten(2, (self.step, L))  # (B, kv, step, L, d) own earlier steps
        vd = v[:, :, L:].unflatten(2, (self.step, L))
        C = max(1, UNROLL_CHUNK_ELEMENTS // (B * h * (L + self.step)))  # scores per chunk within budget
        outs = []
        for a in range(0, L, C):
            b = min(L, a + C)
            args = (qg[:, :, :, a:b], k[:, :, :b], v[:, :, :b], kd[:, :, :, a:b], vd[:, :, :, a:b], a)
            if torch.is_grad_enabled():
                outs.append(checkpoint(self._chunk, *args, use_reentrant=False))
            else:
                outs.append(self._chunk(*args))
        return torch.cat(outs, dim=3).view(B, h, L, d)

    def _step0_visible(self, start: int, rows: int, keys: int) -> Tensor:
        """(B, rows, keys) bool: may query start+r see step-0 key s? (s <= t and valid) or s == t."""
        qpos = torch.arange(start, start + rows, device=self.valid.device)[:, None]
        kpos = torch.arange(keys, device=self.valid.device)[None, :]
        return ((kpos <= qpos) & self.valid[:, None, :keys]) | (kpos == qpos)

    def _chunk(self, q: Tensor, k0: Tensor, v0: Tensor, kd: Tensor, vd: Tensor, start: int) -> Tensor:
        # q (B, kv, g, C, d) queries start..start+C-1; k0/v0 (B, kv, b, d) step-0 keys 0..b-1 (b = start + C);
        # kd/vd (B, kv, step, C, d) the same positions' own earlier steps -> (B, kv, g, C, d)
        C, b, scale = q.shape[3], k0.shape[2], q.shape[-1] ** -0.5
        s0 = torch.einsum("bkgcd,bksd->bkgcs", q, k0) * scale  # (B, kv, g, C, b)
        s0 = s0.masked_fill(~self._step0_visible(start, C, b)[:, None, None], float("-inf"))
        sd = torch.einsum("bkgcd,bkicd->bkgci", q, kd) * scale  # (B, kv, g, C, step)
        p = torch.cat([s0, sd], dim=-1).float().softmax(-1).to(v0.dtype)
        return (torch.einsum("bkgcs,bksd->bkgcd", p[..., :b], v0)
                + torch.einsum("bkgci,bkicd->bkgcd", p[..., b:], vd))


def cached_mask(slot_valid: Tensor, num_new: int) -> Tensor:
    """Mask for `num_new` queries appended after the cache: (B, 1, num_new, S) bool.

    slot_valid: (B, S) validity of every slot *including* the new ones (the last num_new).
    Query j sits at slot S - num_new + j and sees valid slots at or before it, and always itself.
    """
    B, S = slot_valid.shape
    q_slot = torch.arange(S - num_new, S, device=slot_valid.device)  # (num_new,)
    k_slot = torch.arange(S, device=slot_valid.device)
    causal = k_slot[None, :] <= q_slot[:, None]  # (num_new, S)
    own = k_slot[None, :] == q_slot[:, None]
    return ((causal[None] & slot_valid[:, None, :].bool()) | own[None]).unsqueeze(1)


def within_window(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor | None:
    """(B, m) query and (B, S) key rotary positions -> (B, m, S) bool: the key is fewer than `window`
    positions behind the query (a sliding window of `window` keys, the query's own included, as
    transformers' and vLLM's sliding attention count it); None when there is no window."""
    return None if window is None else (q_pos[:, :, None] - k_pos[:, None, :]) < window


def append_positions(slot_pos: Tensor | None, positions: Tensor, window: int | None) -> Tensor | None:
    """The (B, S) rotary positions of a draft cache's slots after appending (B, m) more: the record
    within_window reads, kept only when there is a window (None, untouched, otherwise)."""
    if window is None:
        return slot_pos
    return positions if slot_pos is None else torch.cat([slot_pos, positions], dim=1)


@dataclass
class ChainState:
    """Draft-time KV cache of a chain head, with per-row positions and hole-aware validity.

    window: None = every query sees the whole context; else a query sees only keys fewer than
    `window` positions behind it, by rotary position (not slot: rows have holes). The engine loop
    sets it where vLLM puts the target's sliding window on the drafter (export/vllm.py: draft_window)."""

    kv: list[LayerKV]
    slot_valid: Tensor  # (B, S) bool: slot holds a real (confirmed or current-speculative) entry
    next_pos: Tensor  # (B,) rotary position of the next confirmed entry of each row
    confirmed: int = 0  # slots [0, confirmed) are confirmed; later ones are last call's speculation
    window: int | None = None
    slot_pos: Tensor | None = None  # (B, S) rotary position of every slot (kept when window is set)

    def drop_speculation(self) -> None:
        for layer in self.kv:
            layer.truncate(self.confirmed)
        self.slot_valid = self.slot_valid[:, : self.confirmed]
        if self.slot_pos is not None:
            self.slot_pos = self.slot_pos[:, : self.confirmed]

    def _append(self, valid: Tensor, positions: Tensor) -> Tensor:
        """Record (B, m) new slots (valid marks real ones) at rotary positions (B, m); returns the
        positions on the cache's device."""
        positions = positions.to(self.slot_valid.device).long()
        self.slot_valid = torch.cat([self.slot_valid, valid.bool()], dim=1)
        self.slot_pos = append_positions(self.slot_pos, positions, self.window)
        return positions

    def _windowed(self, mask: Tensor, positions: Tensor) -> Tensor:
        """mask (B, 1, m, S) of the m slots just appended at positions (B, m), cut to the window."""
        near = within_window(positions, self.slot_pos, self.window)
        return mask if near is None else mask & near[:, None]

    def feed(self, valid: Tensor, positions: Tensor) -> Tensor:
        """Append slots for (B, n) entries at rotary positions (B, n) (valid marks real ones): their
        (B, 1, n, S) causal mask."""
        positions = self._append(valid, positions)
        return self._windowed(cached_mask(self.slot_valid, valid.shape[1]), positions)

    def feed_tree(self, visible: Tensor, positions: Tensor) -> Tensor:
        """Append m speculative tree slots at rotary positions (B, m); visible (B, m, n_spec + m) =
        which speculative slots of this tree each sees (its ancestors and itself). Returns their
        (B, 1, m, S) mask: the confirmed valid slots plus those."""
        B, m, _ = visible.shape
        conf = self.slot_valid[:, : self.confirmed]  # (B, C)
        positions = self._append(visible.new_ones(B, m), positions)
        return self._windowed(torch.cat([conf[:, None, :].expand(B, m, -1), visible], dim=2)[:, None], positions)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def last_valid(x: Tensor, valid: Tensor) -> Tensor:
    """x (B, n, ...) -> (B, ...) at the last valid index of each row (index 0 if none)."""
    idx = (valid.long().cumsum(1).argmax(1))  # (B,) last position where the running count peaks
    return x[torch.arange(x.shape[0], device=x.device), idx]
