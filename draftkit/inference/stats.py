"""What a run of the loop counted (`SpecStats`, `PlainStats`), and the T = 0 comparison of its
outputs with plain decoding (`compare_greedy`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftkit.inference.tree import SOURCE_HEAD, SOURCE_LOOKUP

SOURCE_NAMES = {SOURCE_HEAD: "head", SOURCE_LOOKUP: "lookup", SOURCE_HEAD | SOURCE_LOOKUP: "both"}


@dataclass
class SpecStats:
    """Counts of one or more `generate` calls. Merge with `+=`; read tau / acceptance."""

    k: int
    steps: int = 0  # verify forwards (one per loop step, whole batch)
    row_steps: int = 0  # (row, step) pairs with the row still running: the denominator of tau
    emitted: int = 0  # tokens the verify steps produced (accepted drafts + one each), before cuts
    new_tokens: int = 0  # tokens in the outputs (prefill token included, cut at EOS / max)
    # accepted_hist[n]: row-steps that accepted exactly n drafts (n = 0..k)
    accepted_hist: list[int] = field(default_factory=list)
    # position i (0-based): row-steps whose draft i was looked at (all before it accepted) ...
    reached: list[int] = field(default_factory=list)
    # ... and that accepted it. alpha_i = accepted_at[i] / reached[i] (conditional acceptance).
    accepted_at: list[int] = field(default_factory=list)
    # accepted drafts by where they came from: "head", "lookup", "both" (a node both proposed)
    accepted_by_source: dict = field(default_factory=dict)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # time in head.draft (incl. consuming the confirmed features)
    verify_s: float = 0.0  # target forward + lm_head + rejection sampler + cache roll-back
    total_s: float = 0.0  # wall time of generate(), everything included

    def __post_init__(self):
        self.accepted_hist = self.accepted_hist or [0] * (self.k + 1)
        self.reached = self.reached or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    @property
    def tau(self) -> float:
        """Mean tokens per target forward per row, the bonus / recovered token included."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """alpha_i = P(draft i accepted | drafts 1..i-1 accepted); None where never reached."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def record(self, offered: Tensor, num_accepted: Tensor, active: Tensor,
               accepted_source: Tensor | None = None) -> None:
        """One verify step: offered (B, k) bool = the walk stood at depth i with a draft to try
        (chain: i < drafts offered and i <= accepted), num_accepted (B,), active (B,) row running;
        accepted_source (B, k) uint8 source flags of the accepted drafts (draftkit.inference.tree)."""
        na, off = num_accepted[active].tolist(), offered[active].long().tolist()
        self.steps += 1
        self.row_steps += len(na)
        for a, o in zip(na, off):
            self.emitted += a + 1
            self.accepted_hist[min(a, self.k)] += 1
            for i, reached in enumerate(o[: self.k]):
                self.reached[i] += reached
            for i in range(min(a, self.k)):
                self.accepted_at[i] += 1
        if accepted_source is not None:
            for row, a in zip(accepted_source[active].tolist(), na):
                for flag in row[:a]:
                    name = SOURCE_NAMES.get(flag)
                    if name:
                        self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + 1

    def __iadd__(self, other: "SpecStats") -> "SpecStats":
        if other.k != self.k:
            raise ValueError(f"cannot merge stats of k={other.k} into k={self.k}")
        for name in ("steps", "row_steps", "emitted", "new_tokens", "prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_hist", "reached", "accepted_at"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        for name, n in other.accepted_by_source.items():
            self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + n
        return self

    def to_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "k": self.k, "tau": self.tau, "acceptance_per_position": self.acceptance_per_position,
            "accepted_length_histogram": list(self.accepted_hist), "steps": self.steps,
            "row_steps": self.row_steps, "new_tokens": self.new_tokens,
            "accepted_by_source": dict(self.accepted_by_source),
            "tokens_per_s": self.tokens_per_s, "prefill_s": self.prefill_s, "draft_s": self.draft_s,
            "verify_s": self.verify_s, "total_s": self.total_s,
            "draft_ms_per_step": 1e3 * self.draft_s / steps, "verify_ms_per_step": 1e3 * self.verify_s / steps,
        }


@dataclass
class PlainStats:
    new_tokens: int = 0
    steps: int = 0
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def __iadd__(self, other: "PlainStats") -> "PlainStats":
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.total_s += other.total_s
        return self




# A (k+1)-token forward and a 1-token step round differently. On SmolLM2-135M in bf16 their logits
# differ by up to ~0.75 at top-1 logits of ~26, i.e. ~4 bf16 epsilons of the top-1 magnitude per
# logit; the top-2 *gap* can then move by twice that. A divergence whose gap at that position is
# within NEAR_TIE_EPS epsilons of |top-1| is a near-tie (numerics); one beyond it is a bug.
NEAR_TIE_EPS = 8.0


def near_tie_tolerance(top1: float, dtype: torch.dtype) -> float:
    return NEAR_TIE_EPS * torch.finfo(dtype).eps * max(abs(top1), 1.0)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, len of the shorter one if a prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(outputs: list[list[int]], reference: list[list[int]],
                   gaps: list[list[tuple[float, float]]] | None, dtype: torch.dtype,
                   ids: list | None = None) -> dict:
    """T = 0 outputs vs plain decoding: mismatch count, near-ties, and every divergence."""
    divergences = []
    for r, (out, ref) in enumerate(zip(outputs, reference)):
        i = first_divergence(out, ref)
        if i is None:
            continue
        d = {"prompt": ids[r] if ids else r, "index": i, "got": out[i] if i < len(out) else None,
             "expected": ref[i] if i < len(ref) else None}
        if gaps is not None and i < len(gaps[r]):
            gap, top1 = gaps[r][i]
            tol = near_tie_tolerance(top1, dtype)
            d.update(gap=gap, top1=top1, tolerance=tol, near_tie=gap <= tol)
        divergences.append(d)
    return {"mismatches": len(divergences), "near_ties": sum(bool(d.get("near_tie")) for d in divergences),
            "divergences": divergences}
