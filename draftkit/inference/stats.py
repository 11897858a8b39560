"""What a run of the loop counted (`SpecStats`, `PlainStats`), and the T = 0 comparison of its
outputs with plain decoding (`compare_greedy`, the teacher-forced near-tie criterion)."""
from __future__ import annotations

import copy
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


# ---------------------------------------------------------------------------------------------
# T = 0 comparison with plain decoding: the teacher-forced near-tie criterion
# ---------------------------------------------------------------------------------------------

# How far below the top a token's float32 log-probability may be for a swap to count as rounding.
# A (k+1)-token verify and a 1-token step of a 16-bit target round differently: on SmolLM2-135M in
# bf16 single logits move by up to ~0.75 (bf16 keeps 8 significant bits: one ulp is 0.125 at a
# logit of ~26), most by far less, so two tokens within a few tenths of a nat trade places; a bug
# (a wrong position, a wrong mask, a rolled-back slot read) emits a token nats below the top.
# Measured: SmolLM2-135M-Instruct in bf16, 16 Spec-Bench prompts x 64 tokens, the quick recipe's
# head (hybrid, head tree, lookup): 31 divergences, the largest 0.29 nats, the median 0.035 (in
# several it is plain decoding that took the token below the float32 top). 0.5 nats (probability
# ratio >= e^-0.5 = 0.61 to the top) keeps a margin over that. fp32 rounds 2^16 times finer: 1e-3
# nats there.
TIE_GAP_NATS = {torch.float32: 1e-3, torch.float64: 1e-6}
TIE_GAP_16BIT = 0.5


def tie_gap(dtype: torch.dtype) -> float:
    """The default gap (nats) of compare_greedy for a target computing in `dtype`."""
    return TIE_GAP_NATS.get(dtype, TIE_GAP_16BIT)


class TeacherForced:
    """The target's next-token log-probabilities in float32 on a given prefix (prompt + tokens).

    The float32 copy of the model is made once, on the first query (the target itself when it is
    float32 already), so a run without divergences never pays for it; answers are memoised by
    prefix (evaluate compares again after every batch).
    """

    def __init__(self, target):
        self.target = target
        self._model = None
        self._memo: dict[tuple[int, ...], Tensor] = {}

    @property
    def model(self):
        if self._model is None:
            m = self.target.model
            self._model = m if next(m.parameters()).dtype == torch.float32 else copy.deepcopy(m).float()
        return self._model

    @torch.inference_mode()
    def logprobs(self, prefix: list[int]) -> Tensor:
        """(V,) float32 log-probabilities of the token after `prefix`, one full forward (no cache)."""
        key = tuple(prefix)
        if key not in self._memo:
            ids = torch.tensor([prefix], device=self.target.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, -1].float()  # (V,)
            self._memo[key] = logits.log_softmax(-1).cpu()
        return self._memo[key]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, len of the shorter one if a prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(outputs: list[list[int]], reference: list[list[int]], prompts: list[list[int]],
                   scorer: TeacherForced | None, names: list | None = None, gap: float | None = None) -> dict:
    """T = 0 outputs vs plain decoding (`reference`), with the teacher-forced criterion of engine
    test suites: where a row first differs, the target's float32 log-probabilities on the shared
    prefix (prompt + the common tokens) score both tokens; the swap is a near-tie, excused, iff
    each is within `gap` nats of the top (default tie_gap(target dtype)). Anything else (a token
    outside the gap, one row ending early, no scorer) is a failure, named in "failures".

    Returns mismatches, near_ties (excused), failures (one line each), max_gap (the largest gap
    seen at a divergence, nats; None if none was scored), tolerance (the gap), divergences.
    """
    tol = gap if gap is not None else (tie_gap(scorer.target.dtype) if scorer is not None else 0.0)
    divergences, failures = [], []
    for r, (out, ref) in enumerate(zip(outputs, reference)):
        i = first_divergence(out, ref)
        if i is None:
            continue
        name = names[r] if names else r
        got, exp = (out[i] if i < len(out) else None), (ref[i] if i < len(ref) else None)
        d = {"prompt": name, "index": i, "got": got, "expected": exp, "tolerance": tol, "near_tie": False}
        if scorer is not None and got is not None and exp is not None:
            lp = scorer.logprobs(list(prompts[r]) + ref[:i])  # (V,)
            top = float(lp.max())
            d.update(gap_got=top - float(lp[got]), gap_expected=top - float(lp[exp]))
            d["gap"] = max(d["gap_got"], d["gap_expected"])
            d["near_tie"] = d["gap"] <= tol
        if not d["near_tie"]:
            why = f"{d['gap']:.3f} nats below the top > {tol:g}" if "gap" in d else "not scored"
            failures.append(f"prompt {name} token {i}: got {got}, expected {exp} ({why})")
        divergences.append(d)
    gaps = [d["gap"] for d in divergences if "gap" in d]
    return {"mismatches": len(divergences), "near_ties": sum(d["near_tie"] for d in divergences),
            "failures": failures, "max_gap": max(gaps) if gaps else None, "tolerance": tol,
            "divergences": divergences}
