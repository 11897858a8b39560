"""The draft vocabulary: a head that drafts over the N most frequent response tokens, not all V.

Shared by EAGLE-1 (optional: head.draft_vocab_size) and EAGLE-3 (always). As the EAGLE-3
reference: draft id j <-> target id j + d2t[j] (d2t (N,) long, OFFSETS, draft ids in ascending
target id order) and t2d (V,) bool marks the target ids inside the draft vocabulary. Both are
buffers, saved with the head; the trainer picks them once through head.set_draft_vocab.
Training restricts the target's distribution (or its stored top-k) to the draft vocabulary and renormalises it;
drafting scatters the N draft logits into a (B, V) tensor filled with -inf before sampling.
"""
from __future__ import annotations

from itertools import chain
from typing import Iterable, Sequence

import torch
from torch import Tensor

from draftkit.heads.base import HeadError
from draftkit.heads.losses import sparse_logits
from draftkit.target import rows_linear


def token_counts(tokens: Tensor | Iterable, vocab_size: int, masks: Tensor | Iterable | None = None) -> Tensor:
    """Counts (V,) of token ids, in one torch.bincount (no Python loop over tokens).

    tokens: a tensor, a flat list of ids, or an iterable of samples (lists / tensors of ids);
    masks: the same shape of 0/1 values, only tokens with a 1 counted (say, the loss mask).
    """
    ids = _flat_long(tokens)
    if masks is not None:
        keep = _flat_long(masks)
        if keep.numel() != ids.numel():
            raise HeadError(f"draft vocabulary: {ids.numel()} token ids but {keep.numel()} mask values")
        ids = ids[keep.bool()]
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise HeadError(f"draft vocabulary: token ids must lie in 0..{vocab_size - 1}, "
                        f"got {ids.min().item()}..{ids.max().item()}")
    return torch.bincount(ids, minlength=vocab_size)


def _flat_long(x: Tensor | Iterable) -> Tensor:
    """A tensor, a flat list of ints, or samples (lists / tensors) -> one flat (N,) long tensor."""
    if isinstance(x, Tensor):
        return x.flatten().long().cpu()
    items = x if isinstance(x, (list, tuple)) else list(x)
    if not items:
        return torch.zeros(0, dtype=torch.long)
    if any(isinstance(s, Tensor) for s in items):  # a loop over samples, not tokens
        return torch.cat([torch.as_tensor(s).flatten().long().cpu() for s in items])
    if isinstance(items[0], (list, tuple)):  # samples as lists: one flat list, one tensor
        return torch.tensor(list(chain.from_iterable(items)), dtype=torch.long)
    return torch.tensor(items, dtype=torch.long)  # a flat list of ints


def sample_counts(samples: list[dict], vocab_size: int) -> Tensor:
    """Counts (V,) of the loss-masked tokens of prepared samples ({input_ids, loss_mask}): what the
    trainer chooses the draft vocabulary from (the tokens the head learns to predict, per data.loss_on)."""
    return token_counts([s["input_ids"] for s in samples], vocab_size, masks=[s["loss_mask"] for s in samples])


def coverage(t2d: Tensor, counts: Tensor) -> dict:
    """How much of a token count (V,) the draft vocabulary t2d (V,) bool holds: {tokens, inside,
    inside_fraction} (tokens = counts.sum(); inside_fraction None when there are none). The share of
    the target's tokens a head drafting over t2d can say at all: an upper bound on its agreement."""
    if counts.numel() != t2d.numel():
        raise HeadError(f"draft vocabulary: counts has {counts.numel()} entries, t2d {t2d.numel()}")
    total, inside = int(counts.sum()), int(counts[t2d.cpu()].sum())
    return {"tokens": total, "inside": inside, "inside_fraction": inside / total if total else None}


def build_draft_vocab(size: int, vocab_size: int, *, tokens: Tensor | Iterable | None = None,
                      counts: Tensor | Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """The `size` most frequent tokens (ties: lower id first) -> (d2t (N,) long, t2d (V,) bool).

    As the EAGLE-3 reference: draft id j <-> target id j + d2t[j], draft ids in ascending target
    id order, t2d[v] = v is in the draft vocabulary. Tokens never seen fill up by id order.
    """
    if not 0 < size <= vocab_size:
        raise HeadError(f"head.draft_vocab_size: {size} must be in 1..{vocab_size} (the target's vocabulary)")
    if (tokens is None) == (counts is None):
        raise HeadError("draft vocabulary: give exactly one of tokens= or counts=")
    c = token_counts(tokens, vocab_size) if counts is None else torch.as_tensor(counts).flatten().cpu()
    if c.numel() != vocab_size:
        raise HeadError(f"draft vocabulary: counts has {c.numel()} entries, the target vocabulary {vocab_size}")
    order = torch.sort(c.double(), descending=True, stable=True).indices  # most frequent, low id first
    used = order[:size].sort().values  # (N,) target ids, ascending
    d2t = used - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def check_draft_vocab_size(size: int, target) -> None:
    if not 0 < size <= target.vocab_size:
        raise HeadError(f"head.draft_vocab_size: {size} must be in 1..{target.vocab_size} "
                        f"(the vocabulary of target {target.name})")


def in_vocab_mean(kl: Tensor, top: Tensor, t2d: Tensor) -> Tensor:
    """Mean of the per-row KL (M,) over rows whose target top-1 `top` (M,) the draft vocabulary can say.

    The KL itself is KL(p_target restricted to the draft vocab, renormalised || p̂), computed by
    draftkit.heads.losses.kl_rows with `target_on_draft_vocab` as the teacher. Positions whose top-1
    lies outside are left out of the mean (the EAGLE-3 reference).
    """
    in_vocab = t2d[top].float()  # (M,)
    return (kl * in_vocab).sum() / in_vocab.sum().clamp(min=1)


class DraftVocab:
    """Mixin for a DraftHead with d2t / t2d buffers (call init_draft_vocab in __init__)."""

    d2t: Tensor
    t2d: Tensor

    def init_draft_vocab(self, size: int, vocab_size: int) -> None:
        # Until set_draft_vocab: the first N token ids (the identity when N = V).
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:size] = True
        self.register_buffer("t2d", t2d)

    @property
    def draft_ids(self) -> Tensor:
        """(N,) the target id of every draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, tokens: Tensor | Iterable | None = None, *, counts: Tensor | None = None) -> None:
        """Pick the draft vocabulary from the training responses; call once BEFORE training.

        tokens: the (loss-masked) response token ids, as one tensor or an iterable of samples;
        counts: (V,) token frequencies instead. Writes the d2t / t2d buffers (saved with the head).
        """
        d2t, t2d = build_draft_vocab(self.d2t.shape[0], self.t2d.shape[0], tokens=tokens, counts=counts)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.draft_vocab_changed()

    def draft_vocab_changed(self) -> None:
        """Hook: the family's own follow-up (EAGLE-3 re-inits lm_head, EAGLE-1 drops its cache)."""

    def target_rows_logits(self, hidden: Tensor) -> Tensor:
        """(..., H) -> (..., N) float32 logits of the frozen target lm_head's draft-vocabulary rows."""
        w = self.shared.lm_head.weight  # (V, H)
        # The gathered rows: a cache (never saved), rebuilt when d2t, the target, device or dtype change.
        key = (w.data_ptr(), w.device, w.dtype, self.d2t.data_ptr(), self.d2t._version)
        cached = getattr(self, "_vocab_w", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, w[self.draft_ids.to(w.device)].detach())
            object.__setattr__(self, "_vocab_w", cached)
        return rows_linear(hidden.to(w.dtype), cached[1]).float()

    def target_on_draft_vocab(self, target_final: Tensor, top1: Tensor | None) -> tuple[Tensor, Tensor]:
        """The target's logits over the draft vocab (M, N) and its full-vocabulary argmax (M,).

        top1 comes with cached features (computed once per sample); without it the full (M, V)
        logits are computed here, forward only.
        """
        with torch.no_grad():
            if top1 is not None:
                return self.target_rows_logits(target_final), top1
            full = self.target_logits(target_final)  # (M, V)
            return full[:, self.draft_ids], full.argmax(-1)

    def topk_on_draft_vocab(self, topk_ids: Tensor, topk_logp: Tensor) -> tuple[Tensor, Tensor]:
        """The target's stored top-k as logits over the draft vocab (M, N), -inf off top-k ∩ draft
        vocab (the KL renormalises over that), and its top-1, the first id (M,).

        topk_ids (M, k) target ids, most likely first; topk_logp (M, k) their log-probabilities.
        """
        ids = topk_ids.long()
        draft_of = torch.cumsum(self.t2d.long(), 0) - 1  # (V,) draft id of each target id ...
        draft_of = draft_of.where(self.t2d, -1)  # ... -1 outside the draft vocabulary
        return sparse_logits(draft_of[ids], topk_logp, self.d2t.shape[0]), ids[:, 0]

    has_draft_vocab = True  # EAGLE-1 and DFlash override: False when N = V (no draft vocabulary)

    @property
    def draft_vocab(self) -> Tensor | None:
        """(N,) target ids of the head's draft logits (DraftHead.draft_vocab), None without a draft vocabulary."""
        return self.draft_ids if self.has_draft_vocab else None

    def sample_draft(self, logits: Tensor, sample) -> tuple[Tensor, Tensor | None]:
        """One drafted position: logits (B, n) over `draft_vocab` (or the target's when None) ->
        tokens (B,) target ids, probs (B, V) | None.

        The law of sample(to_target_logits(logits)) without building the (B, V) row: off the draft
        vocabulary those logits are -inf, so temperature, top-k, top-p and the softmax give exactly
        those tokens probability 0 and the same renormalised mass to the rest. The draw is taken over
        the N draft ids and q scattered into a zero row: N random numbers instead of V (8,192 vs
        49,152 on the embedded target). Greedy picks the same token (draft ids ascend with target
        ids, so ties break alike).
        """
        tokens, probs = sample(logits)
        ids = self.draft_vocab
        if ids is None:
            return tokens, probs
        if probs is not None:
            probs = probs.new_zeros(*probs.shape[:-1], self.t2d.shape[0]).index_copy_(-1, ids, probs)
        return ids[tokens], probs

    def to_target_logits(self, logits: Tensor) -> Tensor:
        """(..., N) draft logits -> (..., V) target logits, -inf off the draft vocabulary."""
        out = logits.new_full((*logits.shape[:-1], self.t2d.shape[0]), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, logits)
