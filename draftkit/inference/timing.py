"""Timing on a shared machine, and plain decoding's step: the one home of both.

min_times runs callables in interleaved rounds and keeps each one's minimum (another process only
ever adds time). Plain decoding's step is timed by plain decoding itself (plain_generate, its
sampling and bookkeeping included, nothing of the speculative loop): its run of 1 + N tokens less
its run of 1 token on the same context, each the minimum over the rounds, divided by N.
Calibration (cost.measure_costs) and the decode-stage dtype choice (device.measure_decode) both
time their plain step this way; calibration also takes the median step of a real plain run
(plain_step_median_ms), the price it sets against the loop's steps.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

from draftkit.inference.decoder import plain_generate
from draftkit.inference.sampling import SamplingParams


def min_times(items: dict, rounds: int, tick=None, warmup: bool = True) -> dict:
    """ms of each callable: `rounds` interleaved rounds (after a warm-up round), the minimum kept
    (another process can only ever add time). An item may be (fn, undo): undo runs after fn, untimed."""
    best = {key: math.inf for key in items}
    for r in range(rounds + warmup):
        for key, item in items.items():
            fn, undo = item if isinstance(item, tuple) else (item, None)
            t = time.perf_counter()
            fn()
            if r or not warmup:
                best[key] = min(best[key], 1e3 * (time.perf_counter() - t))
            if undo is not None:
                undo()
        if tick is not None:
            tick()
    return best


def plain_runs(target, context: list[int], tokens: int, params: SamplingParams = SamplingParams(),
               before: Callable[[], object] | None = None) -> tuple[Callable, Callable]:
    """(first, run): plain_generate of 1 and of 1 + `tokens` tokens on `context` at batch 1 (no stop
    tokens, seed 0), to be timed among min_times' items; plain_step_ms turns their minima into one
    step. `before` (a dtype switch) runs inside both, so it cancels in the difference."""
    def first():
        if before is not None:
            before()
        plain_generate(target, [context], 1, params, [0], [])

    def run():
        if before is not None:
            before()
        plain_generate(target, [context], 1 + tokens, params, [0], [])
    return first, run


def plain_step_ms(first_ms: float, run_ms: float, tokens: int) -> float:
    """ms of one plain decoding step from the timed runs of plain_runs (the prefill cancels)."""
    return (run_ms - first_ms) / tokens


def plain_step_median_ms(target, context: list[int], tokens: int, params: SamplingParams = SamplingParams(),
                         rounds: int = 2) -> float:
    """ms of a plain decoding step as a real run pays it: the median over `rounds` runs of 1 + `tokens`
    tokens on `context` (batch 1, seed 0) of the wall time between one step's start and the next's
    (plain_generate's on_step). What the cost model sets against the speculative loop's steps, which
    it prices at their parts' minima plus the median residual of a real run (cost.measure_loop): both
    sides then carry the machine's spread alike, where plain_step_ms (a difference of minima) carries
    none of it."""
    gaps: list[float] = []
    for _ in range(rounds):
        seen: list[float] = []
        plain_generate(target, [context], 1 + tokens, params, [0], [], on_step=lambda: seen.append(time.perf_counter()))
        gaps += [1e3 * (b - a) for a, b in zip(seen, seen[1:])]
    return statistics.median_high(gaps)  # a step that ran (the upper of the middle two)


def loop_forward(target, context: list[int], width: int) -> None:
    """The target's work for one prompt of the loop at batch 1: prefill `context` (TargetCache
    forward + commit, as SpecDecoder and plain_generate prefill), then, when `width` > 0, one forward
    of `width` new tokens after it (the forward of a verify step of that width; any tokens)."""
    import torch

    from draftkit.inference.cache import TargetCache

    ids = torch.tensor([context], device=target.device)  # (1, P)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        tc = TargetCache(target, 1)
        tc.forward(ids, valid)
        tc.commit(valid)
        if width:
            tc.forward(ids[:, :width], valid[:, :width])


def forward_runs(target, context: list[int], width: int,
                 before: Callable[[], object] | None = None) -> tuple[Callable, Callable]:
    """(prefill, verify): loop_forward of `context` alone and followed by a `width`-token forward, to
    be timed among min_times' items: the first's minimum is the prefill, the difference of the two a
    verify step's forward (verify_ms). `before` (a dtype switch) runs inside both."""
    def prefill():
        if before is not None:
            before()
        loop_forward(target, context, 0)

    def verify():
        if before is not None:
            before()
        loop_forward(target, context, width)
    return prefill, verify


def verify_ms(prefill_ms: float, both_ms: float) -> float:
    """ms of the `width`-token forward from the timed runs of forward_runs (the prefill cancels)."""
    return both_ms - prefill_ms
