"""The target side of the loop: a KV cache with holes, and the attention masks that hide them.

The target's KV cache is a transformers DynamicCache with one slot per fed token per row. Rolling
back does not move memory: the 2D attention mask over all slots hides the holes, and position_ids
are passed per row, so a row's tokens keep consecutive rotary positions whatever its holes. Slots
that are holes in *every* row at the end of the cache are cropped (at batch 1 there are never
holes). The head keeps its own cache the same way (see heads/layers.py). Both are exact: masked
slots get attention weight exp(-inf) = 0, so fp32 greedy output equals plain decoding token for
token (tests/test_spec_decoder.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftkit.inference.errors import SpecError
from draftkit.target import FINAL


class TargetCache:
    """The target's KV cache for a ragged batch: slots, their validity, their rotary positions.

    Prefill and plain steps pass transformers a 2D mask over the slots. Verify steps (`verify`)
    build the 4D mask themselves from per-slot positions: a query sees the valid cached slots and
    the new slots it is told to (a chain: the ones before it; a tree: its ancestors), and on
    sliding-window layers only keys less than `sliding_window` positions back. Positions, not slot
    indices, bound the window: rolled-back holes would make a slot-indexed window too short. So the
    cache is a plain DynamicCache (full layers): transformers' sliding layers would drop slots by
    count. After a verify, `commit_path` moves the kept slots (in path order) to the front of the
    new block and crops the rest, so at batch 1 the cache never holds a hole.
    """

    def __init__(self, target, batch_size: int, layers: tuple[int, ...] = ()):
        from transformers import DynamicCache

        self.target = target
        self.layers = tuple(layers)
        self.cache = DynamicCache()
        dev = target.device
        self.slot_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=dev)  # (B, S)
        self.slot_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=dev)  # (B, S) rotary position
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=dev)  # (B,)
        self.mask_spec = attention_mask_spec(target)

    def forward(self, ids: Tensor, valid: Tensor, logits_from: int = 0) -> tuple[Tensor, Tensor | None]:
        """Feed ids (B, T) as new slots; valid (B, T) marks real tokens (left padding, finished rows).

        Every fed token is provisionally valid; `commit` later turns rejected ones into holes.
        Returns logits (B, T - logits_from, V) float32 and the features (B, T, F) the head reads
        (None when it reads none).
        """
        positions = (self.next_pos[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
        self._append(valid, positions)
        return self._run(ids, self.slot_valid.long(), positions, logits_from)

    def verify(self, ids: Tensor, valid: Tensor, positions: Tensor, visible: Tensor) -> tuple[Tensor, Tensor | None]:
        """Feed a draft block: ids, valid, positions (B, T); visible (B, T, T) bool = query i may see
        new slot j (its ancestors and itself). Returns logits (B, T, V) and features as `forward`."""
        S0 = self.slot_valid.shape[1]
        self._append(valid, positions)
        B, T = ids.shape
        new = visible & valid[:, None, :]
        new |= torch.eye(T, dtype=torch.bool, device=ids.device)  # a query always sees itself (no empty rows)
        allowed = torch.cat([self.slot_valid[:, None, :S0].expand(B, T, S0), new], dim=2)  # (B, T, S)
        return self._run(ids, self.mask_spec.build(allowed, positions, self.slot_pos), positions, 0)

    def _append(self, valid: Tensor, positions: Tensor) -> None:
        self.slot_valid = torch.cat([self.slot_valid, valid], dim=1)  # (B, S + T)
        self.slot_pos = torch.cat([self.slot_pos, positions], dim=1)

    def _run(self, ids, mask, positions, logits_from):
        want_hidden = any(i != FINAL for i in self.layers)
        out = self.target.decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                                  past_key_values=self.cache, use_cache=True, output_hidden_states=want_hidden)
        final = out.last_hidden_state  # (B, T, H) after the final norm
        logits = self.target.logits(final[:, logits_from:]).float()  # (B, T', V)
        feats = None
        if self.layers:
            picked = [final if i == FINAL else out.hidden_states[i] for i in self.layers]
            feats = picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
        return logits, feats

    def commit(self, keep: Tensor) -> None:
        """keep (B, T): which of the last T fed slots stay; the others become holes."""
        T = keep.shape[1]
        self.slot_valid[:, -T:] = keep
        self.next_pos += keep.long().sum(1)
        # Slots that are holes in every row at the end of the cache can go: crop them.
        used = self.slot_valid[:, -T:].any(0)  # (T,)
        trailing = T - (int(used.nonzero().max()) + 1 if bool(used.any()) else 0)
        if trailing:
            self._crop(trailing)

    def commit_path(self, slots: Tensor, num_keep: Tensor, block: int) -> None:
        """Keep, of the last `block` fed slots, slots (B, L) (block-relative, in order; entries past
        num_keep (B,) ignored): they move to the front of the block, everything after is dropped."""
        L = int(num_keep.max()) if num_keep.numel() else 0
        S0 = self.slot_valid.shape[1] - block
        idx = slots[:, :L].clamp(min=0)  # (B, L)
        keep = torch.arange(L, device=slots.device)[None] < num_keep[:, None]  # (B, L)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (B, kv, S, d)
                g = idx[:, None, :, None].expand(t.shape[0], t.shape[1], L, t.shape[3])
                t[:, :, S0: S0 + L] = t[:, :, S0:].gather(2, g)  # the kept slots, in path order, in place
                setattr(layer, name, t[:, :, : S0 + L])  # a view: no copy of the cache
        self.slot_valid = torch.cat([self.slot_valid[:, :S0], keep], dim=1)
        self.slot_pos = torch.cat([self.slot_pos[:, :S0], self.slot_pos[:, S0:].gather(1, idx)], dim=1)
        self.next_pos += num_keep

    def _crop(self, n: int) -> None:
        self.cache.crop(-n)
        self.slot_valid = self.slot_valid[:, :-n]
        self.slot_pos = self.slot_pos[:, :-n]


@dataclass
class MaskSpec:
    """How this target takes a ready-made 4D mask: one tensor, or a dict per layer type (models
    whose config has `layer_types`); which types are sliding and their window; bool or additive."""

    layer_types: tuple[str, ...] | None  # None: the model takes one tensor
    window: int | None  # sliding window (positions) of "sliding_attention" layers / of every layer
    additive_dtype: torch.dtype | None  # eager attention adds the mask: 0 / finfo.min in this dtype

    def build(self, allowed: Tensor, q_pos: Tensor, k_pos: Tensor):
        """allowed (B, T, S) bool; q_pos (B, T), k_pos (B, S) rotary positions -> the model's mask."""
        def fmt(m: Tensor) -> Tensor:
            m = m[:, None]  # (B, 1, T, S)
            if self.additive_dtype is None:
                return m
            return torch.zeros(m.shape, dtype=self.additive_dtype, device=m.device).masked_fill(
                ~m, torch.finfo(self.additive_dtype).min)

        def windowed() -> Tensor:
            return allowed & (q_pos[:, :, None] - k_pos[:, None, :] < self.window)

        if self.layer_types is None:
            return fmt(windowed() if self.window else allowed)
        return {t: fmt(windowed() if t == "sliding_attention" else allowed) for t in self.layer_types}


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_mask_spec(target) -> MaskSpec:
    cfg = getattr(target.model, "config", None) or target.config
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if impl.startswith("flash") or impl == "flex_attention":
        raise SpecError(f"target attention '{impl}' cannot take the verify loop's tree/hole mask; "
                        "load the target with attn_implementation='sdpa' or 'eager'")
    if types is not None:
        unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
        if unknown:
            raise SpecError(f"target config layer_types {unknown}: the verify loop supports {SUPPORTED_LAYER_TYPES}")
        types = tuple(dict.fromkeys(types))
        window = window if "sliding_attention" in types else None
    if window is not None and (not isinstance(window, int) or window < 1):
        window = None
    return MaskSpec(types, window, target.dtype if impl == "eager" else None)


def left_pad(prompts: list[list[int]], device) -> tuple[Tensor, Tensor]:
    """Token lists -> ids (B, L) left-padded with 0, valid (B, L) bool."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    valid = torch.zeros(len(prompts), L, dtype=torch.bool)
    for b, p in enumerate(prompts):
        if p:
            ids[b, L - len(p):] = torch.tensor(p)
            valid[b, L - len(p):] = True
    return ids.to(device), valid.to(device)

