"""Distillation KL over a vocabulary, bounded in memory: rows go through the vocabulary in chunks.

A head's loss compares its distribution with the target's at M supervised positions over a
vocabulary of N tokens. Done at once, that is several (M, N) fp32 tensors per head / depth /
unrolled step, all kept for the backward: at length 2048, micro batch 4 and Llama-3's 128k
vocabulary, 4 GB each. Here the rows are cut into chunks of at most LOSS_CHUNK_ELEMENTS logits;
when there is more than one chunk each runs under activation checkpointing, so the backward
recomputes one chunk's logits at a time and only (M,) vectors are kept. One chunk (the CPU recipes:
2048 rows x 8192 draft tokens) runs exactly as before, without recomputation.

`on_policy_weights` reweighs an unrolled chain loss to the states the draft-verify loop visits
(head.loss_weighting: on_policy).

A teacher may be sparse (the target's stored top-k, train.target_topk): its logits are -inf off
its support, and the KL counts only the support, with exact zeros elsewhere (never 0 * -inf).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Logits per chunk (rows x vocabulary): 16M fp32 = 64 MB per (chunk, N) tensor.
LOSS_CHUNK_ELEMENTS = 1 << 24

Student = Callable[[Tensor], Tensor]  # (C, H) -> (C, N) logits, differentiable
Teacher = Callable[..., tuple[Tensor, Tensor]]  # (C, ...) -> ((C, N) logits, (C,) top-1 target id)


def chunk_rows(vocab: int, budget: int | None = None) -> int:
    """Rows per chunk for a vocabulary of `vocab` tokens (budget: logits per chunk)."""
    return max(1, (budget or LOSS_CHUNK_ELEMENTS) // max(vocab, 1))


def sparse_logits(ids: Tensor, logp: Tensor, size: int) -> Tensor:
    """Top-k entries -> dense (M, size) float32 logits, -inf off them: ids (M, k) long with -1 for
    an entry to leave out (outside a draft vocabulary), logp (M, k) their log-probabilities."""
    out = logp.new_full((ids.shape[0], size + 1), float("-inf"), dtype=torch.float32)
    out.scatter_(1, torch.where(ids < 0, size, ids), logp.float())  # left-out entries land in a spare column
    return out[:, :size]


def _kl_chunk(student: Student, teacher: Teacher, h: Tensor, *teacher_in) -> tuple[Tensor, Tensor, Tensor]:
    logp = F.log_softmax(student(h).float(), dim=-1)  # (C, N)
    with torch.no_grad():
        tgt_logits, top = teacher(*teacher_in)
        support = tgt_logits.float() > float("-inf")  # (C, N) all True for a dense teacher
        # renormalised over the support; rows with an empty support (no entry in the draft
        # vocabulary) give NaN here and are zeroed just below, with their gradient
        tgt_logp = F.log_softmax(tgt_logits.float(), dim=-1).where(support, 0.0)  # (C, N)
        p = tgt_logp.exp().where(support, 0.0)
    kl = (p * (tgt_logp - logp)).sum(-1)  # (C,) exact zeros off the support
    return kl, logp.detach().argmax(-1), top


def kl_rows(student: Student, teacher: Teacher, h: Tensor, *teacher_in: Tensor | None,
            vocab: int, budget: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row KL(p_teacher || p_student) over M rows, in row chunks of `budget` // vocab.

    h (M, H) the student's input (budget None = LOSS_CHUNK_ELEMENTS); teacher_in: tensors (M, ...) (or None) handed to `teacher`
    chunk by chunk. Returns kl (M,) (differentiable), the student's argmax (M,) over its N
    tokens, and the teacher's top-1 (M,).
    """
    M, C = h.shape[0], chunk_rows(vocab, budget)
    if M <= C:
        return _kl_chunk(student, teacher, h, *teacher_in)
    parts = []
    for a in range(0, M, C):
        args = [h[a:a + C], *(x[a:a + C] if x is not None else None for x in teacher_in)]
        if torch.is_grad_enabled():  # the student's weights need gradients: recompute in backward
            parts.append(checkpoint(_kl_chunk, student, teacher, *args, use_reentrant=False))
        else:
            parts.append(_kl_chunk(student, teacher, *args))
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def on_policy_weights(hits: Tensor, supervised: Tensor) -> Tensor:
    """Which (root, depth) states the greedy draft-verify loop visits when it runs over a sample.

    hits, supervised: (B, D, L) bool: hits[b, d, t] = the head's depth-d draft from root t (its
    argmax) equals the target's top-1, on a supervised row. At T = 0 the loop's rollout over a
    sample of the target's greedy text IS that text, so its states are a subset of the training
    ones (Draft-OPD's "target-assisted rollout" collapses onto the data); which subset is the
    loop's walk. From the first supervised root t it drafts depths 0..D-1, accepts the m leading
    hits, takes the target's token, and its next root is t + m + 1; a root with no supervised
    depth 0 is skipped to the next one. At a root, depth d is verified only when depths < d all
    hit: the first miss is the verification-exposed error, the depths after it are never seen.
    Returns (B, D, L) float: 1 on the visited (root, depth) states, 0 elsewhere.
    """
    B, D, L = hits.shape
    hits = hits & supervised
    reach = torch.cat([torch.ones_like(hits[:, :1]), hits[:, :-1].long().cumprod(1).bool()], 1)  # depths < d all hit
    run = hits.long().cumprod(1).sum(1).tolist()  # (B, L) accepted drafts at each root
    ok = supervised[:, 0].tolist()
    roots = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        t = 0
        while t < L:
            if ok[b][t]:
                roots[b, t] = True
                t += run[b][t] + 1
            else:
                t += 1
    return (roots.to(hits.device)[:, None] & reach & supervised).float()
