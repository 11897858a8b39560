"""Which dtype each stage runs in: `dtype: auto` per stage, and a forced dtype for all of them.

Two stages, because bf16 pays differently where the CPU only emulates it (AVX2, no AVX512-BF16/AMX):
  batched  compute-bound work: data generation (responses, synthesized prompts), prefill-heavy
           feature computation, training. Emulated bf16 is ~5x slower than float32 there (a 16x128
           prefill: 31.2 s in bf16, 5.65 s in fp32), so auto follows the flags alone
           (draftkit.target.resolve_dtype): bfloat16 with AMX or AVX512-BF16 (or a CUDA GPU with
           bf16), else float32. It is the dtype load_target loads in; `draftkit prepare` and
           `train` run only this stage (the trainer's holdout eval decodes with its training
           target as loaded: casting it would change the features it trains on).
  decode   `draftkit eval`'s draft-verify loop, its calibration and the plain-decoding baseline:
           one-token steps, which are memory-bound (halving the bytes read can win even with
           emulated arithmetic), but also every prompt's prefill and every verify step's forward of
           several tokens, which are compute-bound. auto = the batched choice where bf16 is native
           (bf16 everywhere) or the device is not a CPU; on a CPU without native bf16 a short
           measurement of the actual target decides (measure_decode), in float32 and bfloat16,
           interleaved, min over DECODE_REPEATS rounds (inference/timing.py): plain decoding's step
           (DECODE_STEPS steps after a DECODE_CONTEXT-token prefill, timed as calibration times it),
           a prefill of PREFILL_CONTEXT tokens and a VERIFY_WIDTH-token forward after it. bfloat16
           only when it is faster by DECODE_MARGIN at all three, else float32. Measured on an
           AVX2-only CPU (benchmarks/results/decode_dtype_avx2.json): bf16 took 0.43-0.56x fp32's
           one-token step but 1.1-1.3x its 8-token verify and 3-6x its prefill, so a choice from the
           one-token step alone ran eval's loop (and its plain baseline) in the slower dtype.
A forced dtype (float32 / bfloat16 / float16) is every stage's, and nothing is measured. The
choice is logged in one line (per stage, the measurement, the CPU flags) and eval writes it into
report.json (`dtype_stages`). The measurement is not cached: it costs about 2 x DECODE_REPEATS x
(four prefills + DECODE_STEPS steps + a verify; ~10 s on the embedded target on an AVX2 CPU, most
of it bf16's prefills), and a cached one would outlive a busy machine's noise.
While it runs, a bfloat16 copy of the target's tensors exists beside the float32 ones (1.5x the
float32 target's memory for those seconds); the float32 tensors themselves are never rounded.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from draftkit.target import AUTO_DTYPE, Target, TargetError, auto_basis, resolve_dtype

log = logging.getLogger(__name__)

DECODE_STEPS = 4  # one-token steps per round: plain decoding of 1 + DECODE_STEPS tokens less that of 1
DECODE_CONTEXT = 32  # tokens prefilled before them (in both runs: the difference leaves it out)
DECODE_REPEATS = 3  # interleaved rounds per dtype; the minimum is kept (noise only ever adds time)
PREFILL_CONTEXT = 64  # prompt tokens of the timed prefill (Spec-Bench prompts: 100-750)
VERIFY_WIDTH = 8  # tokens of the timed verify forward: a chain of 7 drafts, a tree of 8 nodes
DECODE_MARGIN = 0.10  # bfloat16 decodes only when each timing is at least 10% shorter than float32's
MEASURED = ("float32", "bfloat16")


@dataclass(frozen=True)
class StageDtypes:
    """The dtype name of each stage and what the choice was made from."""

    batched: str  # data generation, prefill-heavy features, training
    decode: str  # eval's loop, its calibration, plain decoding
    basis: str  # "forced", or auto's basis (draftkit.target.auto_basis: the CPU flags)
    decode_ms: dict[str, float] | None = None  # ms per one-token step per dtype, when measured
    prefill_ms: dict[str, float] | None = None  # ms of a PREFILL_CONTEXT-token prefill per dtype
    verify_ms: dict[str, float] | None = None  # ms of a VERIFY_WIDTH-token forward per dtype

    def describe(self) -> str:
        """The line the user sees: the dtype per stage, the measurement if any, the flags."""
        if self.basis == "forced":
            return f"dtype {self.decode} (forced) for every stage"
        if self.decode_ms is None:
            how = "not measured: bf16 is native here" if self.batched == "bfloat16" else "not measured off a CPU"
        else:
            def ms(d):
                return ", ".join(f"{k} {v:.1f} ms" for k, v in (d or {}).items())
            how = (f"one-token decode measured {ms(self.decode_ms)}; {VERIFY_WIDTH}-token verify {ms(self.verify_ms)}; "
                   f"{PREFILL_CONTEXT}-token prefill {ms(self.prefill_ms)} (min of {DECODE_REPEATS} rounds; "
                   f"bfloat16 only when {DECODE_MARGIN:.0%} faster at all three)")
        return f"dtype auto: batched stages {self.batched}, decode {self.decode} ({how}; {self.basis})"

    def to_dict(self) -> dict:
        return {**asdict(self), "margin": DECODE_MARGIN if self.decode_ms else None, "line": self.describe()}


def stage_dtypes(dtype: str, target: Target) -> StageDtypes:
    """The per-stage dtypes of `dtype` ("auto" or a forced name) for `target`, which must be
    loaded in the batched dtype (load_target(dtype=dtype) does): module doc's rule."""
    batched, _ = resolve_dtype(dtype, target.device)
    if dtype != AUTO_DTYPE:
        return StageDtypes(batched, batched, "forced")
    basis = auto_basis(target.device)
    if batched == "bfloat16" or target.device.type != "cpu":
        return StageDtypes(batched, batched, basis)
    if str(target.dtype) != f"torch.{batched}":
        raise TargetError(f"dtype auto: target {target.name} is {target.dtype}, not the batched stages' {batched} "
                          "it must be loaded in before the decode dtype is measured")
    ms = measure_decode(target)
    faster = all(m["bfloat16"] < (1 - DECODE_MARGIN) * m["float32"] for m in ms.values())
    return StageDtypes(batched, "bfloat16" if faster else "float32", basis, ms["step"], ms["prefill"], ms["verify"])


def measure_decode(target: Target, repeats: int = DECODE_REPEATS) -> dict[str, dict[str, float]]:
    """{"step" | "prefill" | "verify": {dtype: ms}} for float32 (the target as loaded) and bfloat16
    (a temporary copy of its tensors, as Target.cast makes them), batch 1: plain decoding's step,
    timed as calibration times it (DECODE_STEPS steps after a DECODE_CONTEXT-token prefill), a
    PREFILL_CONTEXT-token prefill and a VERIFY_WIDTH-token forward after it (draftkit/inference/
    timing.py), the dtypes interleaved round by round and the minimum of `repeats` rounds kept. The
    target's own tensors are put back whatever happens."""
    from draftkit.inference.timing import forward_runs, min_times, plain_runs, plain_step_ms, verify_ms

    own = target.dtype_tensors()
    copies = {"float32": own, "bfloat16": [t.to(torch.bfloat16) for t in own]}
    tokens = ((torch.arange(max(DECODE_CONTEXT, PREFILL_CONTEXT)) * 7 + 3) % target.vocab_size).tolist()  # any
    items = {}
    for name in MEASURED:
        use = (lambda name=name: target.set_tensors(copies[name]))  # the dtype switch: in both runs, so it cancels
        items[name, "first"], items[name, "run"] = plain_runs(target, tokens[:DECODE_CONTEXT], DECODE_STEPS, before=use)
        items[name, "prefill"], items[name, "both"] = forward_runs(target, tokens[:PREFILL_CONTEXT], VERIFY_WIDTH,
                                                                   before=use)
    try:
        ms = min_times(items, repeats, warmup=False)
    finally:
        target.set_tensors(own)
    return {"step": {n: plain_step_ms(ms[n, "first"], ms[n, "run"], DECODE_STEPS) for n in MEASURED},
            "prefill": {n: ms[n, "prefill"] for n in MEASURED},
            "verify": {n: verify_ms(ms[n, "prefill"], ms[n, "both"]) for n in MEASURED}}


def use_decode_dtype(dtype: str, target: Target, head=None) -> StageDtypes:
    """Eval's switch to the decode stage: choose (stage_dtypes), log the line, and cast the target
    (and the head) to the decode dtype where it differs from the one loaded, saying so. Where the
    choice was measured, target.dtype_choice becomes the per-stage line."""
    stages = stage_dtypes(dtype, target)
    log.info("%s", stages.describe())
    if stages.decode_ms is not None:
        target.dtype_choice = stages.describe()
    if stages.decode != stages.batched:
        log.info("target cast %s -> %s for the decode stage (the loop, its calibration and plain decoding)",
                 stages.batched, stages.decode)
        target.cast(stages.decode, target.dtype_choice)
        if head is not None:
            head.to(dtype=target.dtype)
    return stages
