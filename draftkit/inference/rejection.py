"""Speculative-decoding rejection sampling: the torch reference, a per-row loop oracle, and the
`RejectionSampler` that draws the random numbers and dispatches to torch or Triton.

One step, for batch row b with n = num_draft[b] <= k drafted tokens d_0 .. d_{n-1}:

* greedy: accept d_i while it equals argmax p_i; the first mismatch is replaced by argmax p_i;
  if all n are accepted, the bonus token argmax p_n is appended.
* stochastic (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token drawn from
  norm(max(0, p_i - q_i)) and stop; if all n are accepted, append a bonus token drawn from p_n.
  Every emitted token is then distributed exactly as the target would have sampled it.

Output: tokens (B, k+1) int64, row b = num_accepted[b] accepted drafts, then the one
recovered/bonus token, then -1 padding; num_accepted (B,) int64 in [0, n].

Random inputs are explicit tensors so that the torch and Triton paths, given the same tensors,
produce IDENTICAL outputs (no RNG inside kernels):

* accept_uniform (B, k) float32 in [0, 1). d_i is accepted iff  `u_i * q_i(d_i) < p_i(d_i)`
  evaluated in float32. For u ~ U[0, 1) this holds with probability min(1, p/q). The product
  form (rather than u < p / q) needs no division, so q == 0 is safe: then the test is 0 < p,
  i.e. accept iff the target gives the token any mass (the ratio is +inf). A token with p == 0
  is never accepted (u * q < 0 is false).
* sample_noise (B, V) float32, holding 1 / E_v with E_v ~ Exp(1) i.i.d. A draw from weights
  w (V,) is `argmax_v w_v * sample_noise_v` (exponential race / Gumbel-max trick, as in vLLM):
  argmin_v E_v / w_v is distributed as w / sum(w). We store 1/E and multiply, because a
  product is correctly rounded in IEEE float32 on every backend while Triton's fp32 division
  is not guaranteed to be. One noise row per batch row is enough: each row emits exactly ONE
  sampled token (recovered OR bonus), so the draw is never reused.
  Ties in the argmax (including all-zero weights, a float-rounding corner) go to the lowest
  index, which is how torch.argmax and our Triton kernels break ties.

`draft_probs=None` means the drafts were taken greedily from the head, i.e. q_i = one-hot(d_i):
acceptance becomes `u_i < p_i(d_i)` and the residual is p_i with the drafted token zeroed.
"""

from collections.abc import Sequence
from typing import Literal

import torch

from draftkit.inference.sampling import SamplingParams, exponential, logits_to_probs, standard_exponential, uniform

Backend = Literal["auto", "torch", "triton"]


# ---------------------------------------------------------------------------------------------
# Torch reference (vectorised over the batch)
# ---------------------------------------------------------------------------------------------


def rejection_sample(
    draft_tokens: torch.Tensor,  # (B, k) int64
    draft_probs: torch.Tensor | None,  # (B, k, V) float32, or None = one-hot drafts
    target_probs: torch.Tensor,  # (B, k+1, V) float32 (greedy: any scores, only argmax is used)
    num_draft: torch.Tensor,  # (B,) int64, 0 <= num_draft[b] <= k
    accept_uniform: torch.Tensor | None,  # (B, k) float32 in [0, 1); unused when greedy
    sample_noise: torch.Tensor | None,  # (B, V) float32 = 1 / Exp(1); unused when greedy
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_tokens (B, k+1) int64 padded with -1, num_accepted (B,) int64)."""
    _check_inputs(draft_tokens, draft_probs, target_probs, num_draft)
    k = draft_tokens.shape[1]
    in_range = torch.arange(k, device=draft_tokens.device) < num_draft[:, None]  # (B, k)
    if greedy:
        target_tokens = target_probs.argmax(dim=-1)  # (B, k+1)
        accepted = (draft_tokens == target_tokens[:, :k]) & in_range  # (B, k)
        num_accepted = _accepted_prefix_len(accepted)  # (B,)
        # accepted drafts equal the target tokens, so the row is just target_tokens, cut after
        # the correction / bonus at position num_accepted
        last = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # (B,)
    else:
        assert accept_uniform is not None and sample_noise is not None
        accepted = _stochastic_accept(draft_tokens, draft_probs, target_probs, accept_uniform)
        num_accepted = _accepted_prefix_len(accepted & in_range)  # (B,)
        weights = _final_weights(draft_tokens, draft_probs, target_probs, num_draft, num_accepted)
        last = race_sample(weights, sample_noise)  # (B,)
    return _assemble_output(draft_tokens, num_accepted, last), num_accepted


def _stochastic_accept(
    draft_tokens: torch.Tensor,  # (B, k)
    draft_probs: torch.Tensor | None,  # (B, k, V) | None
    target_probs: torch.Tensor,  # (B, k+1, V)
    accept_uniform: torch.Tensor,  # (B, k)
) -> torch.Tensor:
    """(B, k) bool: u * q(d) < p(d) per position (ignores num_draft and earlier rejections)."""
    k = draft_tokens.shape[1]
    index = draft_tokens[..., None]  # (B, k, 1)
    p = target_probs[:, :k].gather(-1, index).squeeze(-1)  # (B, k)  p_i(d_i)
    if draft_probs is None:
        q = torch.ones_like(p)  # one-hot draft: q_i(d_i) = 1
    else:
        q = draft_probs.gather(-1, index).squeeze(-1)  # (B, k)  q_i(d_i)
    return accept_uniform * q < p


def _accepted_prefix_len(accepted: torch.Tensor) -> torch.Tensor:
    """(B, k) bool -> (B,) int64 length of the leading run of True (the first False stops it)."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _final_weights(
    draft_tokens: torch.Tensor,  # (B, k)
    draft_probs: torch.Tensor | None,  # (B, k, V) | None
    target_probs: torch.Tensor,  # (B, k+1, V)
    num_draft: torch.Tensor,  # (B,)
    num_accepted: torch.Tensor,  # (B,)
) -> torch.Tensor:
    """(B, V) unnormalised weights of the one sampled token: residual or bonus distribution."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    p = target_probs[rows, num_accepted]  # (B, V)  p at the first non-accepted position
    if k == 0:
        return p  # nothing was drafted: always the bonus
    # q only matters where a draft was rejected (num_accepted < num_draft <= k); clamp the index
    # so rows that take the bonus (num_accepted may equal k) still gather something valid.
    q_pos = num_accepted.clamp(max=k - 1)  # (B,)
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, draft_tokens[rows, q_pos][:, None], 1.0)  # (B, V)
    else:
        q = draft_probs[rows, q_pos]  # (B, V)
    residual = (p - q).clamp_min(0.0)  # (B, V)  max(0, p - q), normalised implicitly by argmax
    rejected = (num_accepted < num_draft)[:, None]  # (B, 1)
    return torch.where(rejected, residual, p)


def race_sample(weights: torch.Tensor, sample_noise: torch.Tensor) -> torch.Tensor:
    """(..., V) weights >= 0, (..., V) 1/Exp(1) noise -> (...) int64 token ~ weights/sum(weights)."""
    return (weights * sample_noise).argmax(dim=-1)


def _assemble_output(
    draft_tokens: torch.Tensor,  # (B, k)
    num_accepted: torch.Tensor,  # (B,)
    last: torch.Tensor,  # (B,) the recovered / bonus token
) -> torch.Tensor:
    B, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device)  # (k+1,)
    padded_drafts = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # (B, k+1)
    out = torch.where(positions < num_accepted[:, None], padded_drafts, -1)  # (B, k+1)
    return out.scatter_(1, num_accepted[:, None], last[:, None])


def _check_inputs(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
) -> None:
    """Shape checks only: nothing here reads tensor values, so it never syncs a GPU."""
    B, k = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (B, k + 1):
        got = tuple(target_probs.shape)
        raise ValueError(f"target_probs must be (B, k+1, V) = ({B}, {k + 1}, V), got {got}")
    if draft_probs is not None and draft_probs.shape != (B, k, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be (B, k, V), got {tuple(draft_probs.shape)}")
    if num_draft.shape != (B,):
        raise ValueError(f"num_draft must be (B,) = ({B},), got {tuple(num_draft.shape)}")


# ---------------------------------------------------------------------------------------------
# Per-row loop: the obviously-correct oracle (tests) and the naive baseline (benchmark)
# ---------------------------------------------------------------------------------------------


def rejection_sample_loop(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniform: torch.Tensor | None,
    sample_noise: torch.Tensor | None,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rejection_sample`, written as the textbook loop over rows and positions.

    Arithmetic stays in float32 tensors (not Python floats, which are float64) so the accept
    test rounds exactly like the vectorised and Triton paths.
    """
    B, k = draft_tokens.shape
    out = torch.full((B, k + 1), -1, dtype=torch.long)
    num_accepted = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        tokens = _loop_one_row(
            draft_tokens[b],
            None if draft_probs is None else draft_probs[b],
            target_probs[b],
            int(num_draft[b]),
            None if greedy else accept_uniform[b],
            None if greedy else sample_noise[b],
        )
        out[b, : len(tokens)] = torch.tensor(tokens)
        num_accepted[b] = len(tokens) - 1
    return out, num_accepted


def _loop_one_row(
    drafts: torch.Tensor,  # (k,)
    q: torch.Tensor | None,  # (k, V)
    p: torch.Tensor,  # (k+1, V)
    n: int,
    u: torch.Tensor | None,  # (k,), None = greedy
    noise: torch.Tensor | None,  # (V,)
) -> list[int]:
    tokens: list[int] = []
    for i in range(n):
        d = int(drafts[i])
        if u is None:  # greedy
            target = int(p[i].argmax())
            if target != d:
                return tokens + [target]
        else:
            q_i = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([d]), 1.0) if q is None else q[i]
            if not bool(u[i] * q_i[d] < p[i, d]):
                return tokens + [int(((p[i] - q_i).clamp_min(0.0) * noise).argmax())]
        tokens.append(d)
    bonus = p[n].argmax() if u is None else (p[n] * noise).argmax()
    return tokens + [int(bonus)]


# ---------------------------------------------------------------------------------------------
# The sampler the decoder calls
# ---------------------------------------------------------------------------------------------


class RejectionSampler:
    """Logits in, verified tokens out; one semantics for the torch and Triton backends.

    backend: "torch", "triton", or "auto" (Triton for CUDA tensors, torch otherwise).
    """

    def __init__(self, backend: Backend = "auto") -> None:
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown backend {backend!r}")
        self.backend = backend

    def __call__(
        self,
        draft_tokens: torch.Tensor,  # (B, k) int64
        draft_probs: torch.Tensor | None,  # (B, k, V): the head's probs after logits_to_probs(params)
        target_logits: torch.Tensor,  # (B, k+1, V) raw target logits
        num_draft: torch.Tensor,  # (B,) int64
        params: SamplingParams,
        generators: Sequence[torch.Generator] | None = None,  # one per row; None = global RNG
        draw_width: int | None = None,  # draw uniforms for max(k, draw_width) drafts, use the first k
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, k = draft_tokens.shape
        V = target_logits.shape[-1]
        if params.greedy:
            # logits_to_probs would give one-hot(argmax); the greedy path only takes argmax, so
            # the raw logits give the same tokens without materialising (B, k+1, V) one-hots.
            # No random numbers are drawn, so generators do not advance.
            target, accept_uniform, sample_noise = target_logits, None, None
        else:
            target = logits_to_probs(target_logits, params)  # (B, k+1, V) float32
            # A row's stream must not depend on how wide the other rows' drafts made this step:
            # with draw_width fixed per run, every row draws the same count every step.
            accept_uniform = self._uniform((B, max(k, draw_width or 0)), generators, target.device)[:, :k]
            sample_noise = inverse_exponential(self._exponential((B, V), generators, target.device))  # (B, V)
            if draft_probs is not None:
                draft_probs = draft_probs.float()
        sample = self._dispatch(target)
        return sample(
            draft_tokens.long(), draft_probs, target, num_draft.long(), accept_uniform, sample_noise, params.greedy
        )

    def _dispatch(self, target: torch.Tensor):
        use_triton = self.backend == "triton" or (self.backend == "auto" and target.is_cuda)
        if not use_triton:
            return rejection_sample
        # imported on first use: triton.jit reads TRITON_INTERPRET when the kernels are defined,
        # so importing rejection.py must not freeze that choice early
        from draftkit.inference.triton_rejection import rejection_sample_triton  # noqa: PLC0415

        return rejection_sample_triton

    @staticmethod
    def _uniform(shape: tuple[int, int], generators, device) -> torch.Tensor:
        if generators is None:
            return torch.rand(shape, device=device)
        return uniform(shape, generators).to(device)

    @staticmethod
    def _exponential(shape: tuple[int, int], generators, device) -> torch.Tensor:
        if generators is None:
            return standard_exponential(shape, device=device)
        return exponential(shape, generators).to(device)


def inverse_exponential(exp_noise: torch.Tensor) -> torch.Tensor:
    """1 / E, with E clamped away from 0: E == 0 would give inf, and 0 * inf = NaN would win
    torch.argmax (NaN counts as the maximum) but not the Triton kernel. 1/tiny is still finite."""
    return exp_noise.clamp_min(torch.finfo(torch.float32).tiny).reciprocal()
