"""Triton kernels for the rejection sampler; semantics are those of `rejection.rejection_sample`.

Read `rejection.py` first: this file must produce bit-identical outputs given the same random
tensors. That works because every float operation here is one the reference also does, in the
same order, and each is exactly rounded in IEEE float32 (subtract, max, multiply, compare; no
division, no fused multiply-add pattern), and because argmax ties go to the lowest index on
both sides.

Kernels (all tensors contiguous; B rows, k draft positions, V vocabulary):

  greedy:      _argmax_kernel          grid (B * (k+1),)  argmax of every target row, V in blocks
               _greedy_accept_kernel   grid (B,)          accepted prefix + output row
  stochastic:  _accept_kernel          grid (B,)          u * q(d) < p(d) scan + output prefix
               _recover_or_bonus_kernel grid (B,)         argmax_v w_v * noise_v, V in blocks,
                                                          w = max(0, p - q) (recovered) or p (bonus)

The stochastic kernels read only what they need: the accept scan gathers k probabilities per
row, and the sampling kernel streams one (V,) row of p (and of q when a draft was rejected).
The reported bandwidth in benchmarks/ counts the full [B,k,V] q + [B,k+1,V] p as the bound a
sampler that materialises probabilities must at least have written.
"""

import torch
import triton
import triton.language as tl

from draftkit.inference.rejection import _check_inputs


# ---------------------------------------------------------------------------------------------
# Blocked argmax with torch.argmax's tie rule (lowest index wins)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _argmax_update(best_val, best_idx, vals, idx):
    """Per-lane running max over V blocks. Strict `>`: an equal value in a later block (higher
    index) never replaces the earlier one, so each lane keeps its lowest maximal index."""
    better = vals > best_val
    return tl.where(better, vals, best_val), tl.where(better, idx, best_idx)


@triton.jit
def _argmax_finish(best_val, best_idx):
    """Reduce lanes: the max value, then the lowest index holding it. (A plain tl.argmax over
    lanes would prefer the lowest LANE, which is not the lowest vocabulary index.)"""
    top = tl.max(best_val, axis=0)
    big = tl.full(best_idx.shape, 2**31 - 1, tl.int32)
    return tl.min(tl.where(best_val == top, best_idx, big), axis=0)


@triton.jit
def _argmax_kernel(
    scores_ptr,  # (R, V) float, R = B * (k+1) rows of target scores (probs or logits)
    out_ptr,  # (R,) int64 argmax per row
    V,  # vocabulary size
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * V can exceed 2**31 for large B*k*V
    base = scores_ptr + row * V
    offs = tl.arange(0, BLOCK_V)
    # the first block initialises the lanes (masked lanes hold -inf and an index >= V; they can
    # only be "max" if the whole row is -inf, and then lane 0 / index 0 wins, as in torch)
    best_val = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best_idx = offs
    for start in range(BLOCK_V, V, BLOCK_V):
        idx = start + offs
        vals = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        best_val, best_idx = _argmax_update(best_val, best_idx, vals, idx)
    tl.store(out_ptr + row, _argmax_finish(best_val, best_idx).to(tl.int64))


@triton.jit
def _greedy_accept_kernel(
    out_tokens_ptr,  # (B, k+1) int64 output, -1 padded
    num_accepted_ptr,  # (B,) int64 output
    draft_tokens_ptr,  # (B, k) int64
    target_argmax_ptr,  # (B, k+1) int64 from _argmax_kernel
    num_draft_ptr,  # (B,) int64
    K,  # k
    BLOCK_K: tl.constexpr,  # power of two >= k+1
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)  # positions 0..k (k = the bonus slot)
    n = tl.load(num_draft_ptr + b)
    in_range = i < n  # n <= k, so this also keeps i inside the (B, k) draft row
    drafts = tl.load(draft_tokens_ptr + b * K + i, mask=in_range, other=-1)
    targets = tl.load(target_argmax_ptr + b * (K + 1) + i, mask=i < K + 1, other=-1)
    accepted = (drafts == targets) & in_range
    # first non-accepted position; positions >= n are never accepted, so this is <= n
    num_acc = tl.min(tl.where(accepted, BLOCK_K, i), axis=0)
    tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))
    # accepted drafts equal the targets: the row is the targets up to and including num_acc
    row = tl.where(i <= num_acc, targets, -1)
    tl.store(out_tokens_ptr + b * (K + 1) + i, row, mask=i < K + 1)


# ---------------------------------------------------------------------------------------------
# Stochastic path
# ---------------------------------------------------------------------------------------------


@triton.jit
def _accept_kernel(
    out_tokens_ptr,  # (B, k+1) int64 output: accepted drafts, -1 elsewhere (slot num_acc is
    #                  filled by _recover_or_bonus_kernel)
    num_accepted_ptr,  # (B,) int64 output
    draft_tokens_ptr,  # (B, k) int64
    draft_probs_ptr,  # (B, k, V) float32; not read when NO_DRAFT_PROBS
    target_probs_ptr,  # (B, k+1, V) float32
    num_draft_ptr,  # (B,) int64
    accept_uniform_ptr,  # (B, k) float32 in [0, 1)
    K,  # k
    V,  # vocabulary size
    NO_DRAFT_PROBS: tl.constexpr,  # drafts were one-hot: q(d) = 1
    BLOCK_K: tl.constexpr,  # power of two >= k+1
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    n = tl.load(num_draft_ptr + b)
    in_range = i < n
    drafts = tl.load(draft_tokens_ptr + b * K + i, mask=in_range, other=0)
    # p_i(d_i): row (b, i) of the (B, k+1, V) target, column d_i
    p = tl.load(target_probs_ptr + (b * (K + 1) + i) * V + drafts, mask=in_range, other=0.0)
    if NO_DRAFT_PROBS:
        q = tl.full((BLOCK_K,), 1.0, tl.float32)
    else:
        q = tl.load(draft_probs_ptr + (b * K + i) * V + drafts, mask=in_range, other=0.0)
    u = tl.load(accept_uniform_ptr + b * K + i, mask=in_range, other=1.0)
    # accept with probability min(1, p/q), written without division (q == 0 => accept iff p > 0)
    accepted = (u * q < p) & in_range
    num_acc = tl.min(tl.where(accepted, BLOCK_K, i), axis=0)  # first rejection, or n
    tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))
    row = tl.where(i < num_acc, drafts, -1)
    tl.store(out_tokens_ptr + b * (K + 1) + i, row, mask=i < K + 1)


@triton.jit
def _recover_or_bonus_kernel(
    out_tokens_ptr,  # (B, k+1) int64; writes slot num_accepted[b]
    num_accepted_ptr,  # (B,) int64 from _accept_kernel
    num_draft_ptr,  # (B,) int64
    draft_tokens_ptr,  # (B, k) int64
    draft_probs_ptr,  # (B, k, V) float32; not read when NO_DRAFT_PROBS
    target_probs_ptr,  # (B, k+1, V) float32
    sample_noise_ptr,  # (B, V) float32, 1 / Exp(1)
    K,  # k
    V,  # vocabulary size
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    num_acc = tl.load(num_accepted_ptr + b)
    rejected = num_acc < tl.load(num_draft_ptr + b)  # else every draft was accepted: bonus
    # q is only needed on rejection (then num_acc < n <= k); clamp keeps the address valid
    q_pos = tl.minimum(num_acc, K - 1)
    d = tl.load(draft_tokens_ptr + b * K + q_pos, mask=rejected, other=-1)
    p_row = target_probs_ptr + (b * (K + 1) + num_acc) * V
    q_row = draft_probs_ptr + (b * K + q_pos) * V
    noise_row = sample_noise_ptr + b * V
    offs = tl.arange(0, BLOCK_V)
    best_val = tl.full((BLOCK_V,), -1.0, tl.float32)  # scores are >= 0, so block 0 always wins
    best_idx = offs
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        in_vocab = idx < V
        p = tl.load(p_row + idx, mask=in_vocab, other=0.0)
        if NO_DRAFT_PROBS:
            q = tl.where(idx == d, 1.0, 0.0)  # one-hot(d); d == -1 (bonus) matches nothing
        else:
            # skip the q read entirely for bonus rows
            q = tl.load(q_row + idx, mask=in_vocab & rejected, other=0.0)
        # same ops as the reference: max(0, p - q) for a rejection, p itself for the bonus
        w = tl.where(rejected, tl.maximum(p - q, 0.0), p)
        noise = tl.load(noise_row + idx, mask=in_vocab, other=0.0)
        score = tl.where(in_vocab, w * noise, -1.0)  # padding lanes never win
        best_val, best_idx = _argmax_update(best_val, best_idx, score, idx)
    token = _argmax_finish(best_val, best_idx)
    tl.store(out_tokens_ptr + b * (K + 1) + num_acc, token.to(tl.int64))


# ---------------------------------------------------------------------------------------------
# Host wrapper: same signature and contract as rejection.rejection_sample
# ---------------------------------------------------------------------------------------------


def rejection_sample_triton(
    draft_tokens: torch.Tensor,  # (B, k) int64
    draft_probs: torch.Tensor | None,  # (B, k, V) float32 | None (one-hot drafts)
    target_probs: torch.Tensor,  # (B, k+1, V) float32 (greedy: any scores; only argmax used)
    num_draft: torch.Tensor,  # (B,) int64
    accept_uniform: torch.Tensor | None,  # (B, k) float32; unused when greedy
    sample_noise: torch.Tensor | None,  # (B, V) float32 = 1/Exp(1); unused when greedy
    greedy: bool,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(draft_tokens, draft_probs, target_probs, num_draft)
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    out = torch.empty((B, k + 1), dtype=torch.long, device=target_probs.device)
    num_accepted = torch.empty((B,), dtype=torch.long, device=target_probs.device)
    if B == 0:
        return out, num_accepted
    BLOCK_K = triton.next_power_of_2(k + 1)
    BLOCK_V = min(triton.next_power_of_2(V), block_v)
    draft_tokens = draft_tokens.long().contiguous()
    num_draft = num_draft.long().contiguous()
    target_probs = target_probs.contiguous()
    if greedy:
        target_argmax = torch.empty((B, k + 1), dtype=torch.long, device=target_probs.device)
        _argmax_kernel[(B * (k + 1),)](target_probs, target_argmax, V, BLOCK_V=BLOCK_V)
        _greedy_accept_kernel[(B,)](
            out, num_accepted, draft_tokens, target_argmax, num_draft, k, BLOCK_K=BLOCK_K
        )
        return out, num_accepted

    assert accept_uniform is not None and sample_noise is not None
    no_q = draft_probs is None
    # a placeholder pointer when there is no q; the kernels never dereference it (constexpr)
    q = target_probs if no_q else draft_probs.float().contiguous()
    target_probs = target_probs.float()
    accept_uniform = accept_uniform.float().contiguous()
    sample_noise = sample_noise.float().contiguous()
    _accept_kernel[(B,)](
        out, num_accepted, draft_tokens, q, target_probs, num_draft, accept_uniform,
        k, V, NO_DRAFT_PROBS=no_q, BLOCK_K=BLOCK_K,
    )
    _recover_or_bonus_kernel[(B,)](
        out, num_accepted, num_draft, draft_tokens, q, target_probs, sample_noise,
        k, V, NO_DRAFT_PROBS=no_q, BLOCK_V=BLOCK_V,
    )
    return out, num_accepted
