"""Turning logits into the distributions a speculative step samples from, and per-row randomness.

Two things live here:

* `SamplingParams` + `logits_to_probs`: temperature, top-k, top-p. The SAME processing must be
  applied to the target's logits and to the draft's logits, otherwise the rejection sampler
  corrects towards a distribution the user did not ask for.
* Per-row generators: each sequence in a batch owns a `torch.Generator`, so its random numbers
  (and therefore its sampled tokens) do not depend on which other sequences share the batch.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax); otherwise logits are divided by it
    top_k: int = 0  # keep only the k most likely tokens; 0 (or >= V) means off
    top_p: float = 1.0  # keep the smallest set of most likely tokens with mass >= top_p; 1 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p.

    Greedy (temperature == 0) returns the one-hot of argmax; ties go to the lowest index,
    exactly as `torch.argmax` breaks them. top-k/top-p cannot change the argmax, so they are
    irrelevant there.
    """
    logits = logits.float()
    if params.greedy:
        return _one_hot_argmax(logits)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        logits = _mask_outside_top_k(logits, params.top_k)
    if params.top_p < 1.0:
        logits = _mask_outside_top_p(logits, params.top_p)
    # softmax over the survivors renormalises them (masked entries are -inf -> probability 0)
    return logits.softmax(dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits)  # (..., V)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _mask_outside_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth_largest = logits.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    # `<` rather than ranking: tokens tied with the k-th value all survive (HF does the same),
    # so the result does not depend on how topk orders equal values.
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _mask_outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = logits.softmax(dim=-1)  # (..., V)
    sorted_probs = probs.sort(dim=-1, descending=True, stable=True).values  # (..., V)
    # A token is dropped when the tokens ranked above it already hold >= top_p of the mass.
    # The most likely token has zero mass above it, so at least one token always survives.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # (..., V)
    kept = (mass_above < top_p).sum(dim=-1, keepdim=True)  # (..., 1) >= 1
    cutoff = sorted_probs.gather(-1, kept - 1)  # (..., 1) the smallest kept probability
    # Every token tied with the last kept one survives (as in top-k): which of equal values a sort
    # puts first differs between CPU and GPU kernels, and the nucleus must not depend on it.
    return logits.masked_fill(probs < cutoff, float("-inf"))


# ---------------------------------------------------------------------------------------------
# Per-row randomness
# ---------------------------------------------------------------------------------------------


def make_generators(seeds: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per batch row, seeded independently."""
    generators = []
    for seed in seeds:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))
        generators.append(generator)
    return generators


def uniform(shape: Sequence[int], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(B, *rest) float32 uniforms in [0, 1); row i is drawn from generators[i] only."""
    _check_rows(shape, generators)
    rows = [torch.rand(tuple(shape[1:]), generator=g, device=g.device) for g in generators]
    return torch.stack(rows) if rows else torch.empty(tuple(shape))


def standard_exponential(shape: Sequence[int], generator: torch.Generator | None = None,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """float32 Exp(1) samples as -log(U), U ~ U[0, 1) from torch.rand.

    Not Tensor.exponential_: on the CPU that draws element by element in double precision, 0.88 ms
    for one 49,152-token row against 0.16 ms here (2-core Xeon, AVX512; the noise of one sampled
    draft position, which was most of the ~0.9 ms a drafted position costs at T > 0). U < 1, so a
    sample is never 0 (p / E is never 0 / 0); U == 0 gives +inf, i.e. a weight of 0 in the race.
    """
    if generator is not None:
        device = generator.device
    return torch.rand(tuple(shape), generator=generator, device=device).log_().neg_()


def exponential(shape: Sequence[int], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(B, *rest) float32 Exp(1) samples; row i is drawn from generators[i] only."""
    _check_rows(shape, generators)
    rows = [standard_exponential(shape[1:], g) for g in generators]
    return torch.stack(rows) if rows else torch.empty(tuple(shape))


def _check_rows(shape: Sequence[int], generators: Sequence[torch.Generator]) -> None:
    if len(shape) == 0 or shape[0] != len(generators):
        raise ValueError(f"shape {tuple(shape)} needs one generator per row, got {len(generators)}")
