"""Which dtype each stage runs in: `dtype: auto` per stage, and a forced dtype for all of them.

Two stages, because bf16 pays differently where the CPU only emulates it (AVX2, no AVX512-BF16/AMX):
  batched  compute-bound work: data generation (responses, synthesized prompts), prefill-heavy
           feature computation, training. Emulated bf16 is ~5x slower than float32 there (a 16x128
           prefill: 31.2 s in bf16, 5.65 s in fp32), so auto follows the flags alone
           (draftkit.target.resolve_dtype): bfloat16 with AMX or AVX512-BF16 (or a CUDA GPU with
           bf16), else float32. It is the dtype load_target loads in; `draftkit prepare` and
           `train` run only this stage (the trainer's holdout eval decodes with its training
           target as loaded: casting it would change the features it trains on).
  decode   one token per target forward: `draftkit eval`'s draft-verify loop, its calibration and
           the plain-decoding baseline. Memory-bound, so halving the bytes read can win even with
           emulated arithmetic (one-token decode 45 ms bf16 vs 74 ms fp32 on that CPU). auto = the
           batched choice where bf16 is native (bf16 everywhere) or the device is not a CPU; on a
           CPU without native bf16 a short measurement decides (measure_decode): plain decoding's
           step of the actual target, timed as calibration times it (inference/timing.py:
           DECODE_STEPS steps after a DECODE_CONTEXT-token prefill), in float32 and bfloat16,
           interleaved, min over DECODE_REPEATS rounds; bfloat16 only when it is faster by
           DECODE_MARGIN, else float32.
A forced dtype (float32 / bfloat16 / float16) is every stage's, and nothing is measured. The
choice is logged in one line (per stage, the measurement, the CPU flags) and eval writes it into
report.json (`dtype_stages`). The measurement is not cached: it costs about 2 x DECODE_REPEATS x
(two short prefills + DECODE_STEPS steps), and a cached one would outlive a busy machine's noise.
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
DECODE_MARGIN = 0.10  # bfloat16 decodes only when its step is at least 10% shorter than float32's
MEASURED = ("float32", "bfloat16")


@dataclass(frozen=True)
class StageDtypes:
    """The dtype name of each stage and what the choice was made from."""

    batched: str  # data generation, prefill-heavy features, training
    decode: str  # one-token decoding: eval's loop, its calibration, plain decoding
    basis: str  # "forced", or auto's basis (draftkit.target.auto_basis: the CPU flags)
    decode_ms: dict[str, float] | None = None  # ms per one-token step per dtype, when measured

    def describe(self) -> str:
        """The line the user sees: the dtype per stage, the measurement if any, the flags."""
        if self.basis == "forced":
            return f"dtype {self.decode} (forced) for every stage"
        if self.decode_ms is None:
            how = "not measured: bf16 is native here" if self.batched == "bfloat16" else "not measured off a CPU"
        else:
            ms = ", ".join(f"{k} {v:.1f} ms" for k, v in self.decode_ms.items())
            how = (f"one-token decode measured {ms} (min of {DECODE_REPEATS} rounds of {DECODE_STEPS} steps; "
                   f"bfloat16 only when {DECODE_MARGIN:.0%} faster)")
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
    decode = "bfloat16" if ms["bfloat16"] < (1 - DECODE_MARGIN) * ms["float32"] else "float32"
    return StageDtypes(batched, decode, basis, ms)


def measure_decode(target: Target, repeats: int = DECODE_REPEATS) -> dict[str, float]:
    """{dtype: ms per one-token decode step} for float32 (the target as loaded) and bfloat16 (a
    temporary copy of its tensors, as Target.cast makes them): plain decoding's step, timed as
    calibration times it (draftkit/inference/timing.py: DECODE_STEPS steps after a DECODE_CONTEXT-
    token prefill, batch 1), the dtypes interleaved round by round and the minimum of `repeats`
    rounds kept. The target's own tensors are put back whatever happens."""
    from draftkit.inference.timing import min_times, plain_runs, plain_step_ms

    own = target.dtype_tensors()
    copies = {"float32": own, "bfloat16": [t.to(torch.bfloat16) for t in own]}
    context = ((torch.arange(DECODE_CONTEXT) * 7 + 3) % target.vocab_size).tolist()  # any tokens
    items = {}
    for name in MEASURED:
        use = (lambda name=name: target.set_tensors(copies[name]))  # the dtype switch: in both runs, so it cancels
        items[name, "first"], items[name, "run"] = plain_runs(target, context, DECODE_STEPS, before=use)
    try:
        ms = min_times(items, repeats, warmup=False)
    finally:
        target.set_tensors(own)
    return {name: plain_step_ms(ms[name, "first"], ms[name, "run"], DECODE_STEPS) for name in MEASURED}


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
