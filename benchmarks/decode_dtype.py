"""Which dtype should eval's loop run in on this CPU? Time what the loop does, in float32 and bfloat16:
a prefill of P tokens, and a forward of w new tokens (w = 1: a plain decode step; w > 1: a verify of a
chain or tree) after a context of P tokens, for several P and w. Dtypes interleaved round by round, the
minimum of the rounds kept (noise only adds time).

    python benchmarks/decode_dtype.py --contexts 32 128 512 --widths 1 4 8 16 --rounds 3

Why: `dtype: auto` chooses eval's decode dtype from one-token steps after a 32-token context (draftkit/
device.py). On a CPU that only emulates bf16 (AVX2) that step is memory-bound and bf16 wins, but the loop
also prefills every prompt and verifies several tokens per step, which are compute-bound. This script
measures all three so the choice can be judged. Prints a table, writes
benchmarks/results/decode_dtype.json (atomically). Run it alone (../shared/bin/one-at-a-time).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from draftkit.inference.report import atomic_write
from draftkit.inference.timing import forward_runs, min_times, verify_ms
from draftkit.target import auto_basis, load_target

DTYPES = ("float32", "bfloat16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="benchmarks/results/decode_dtype.json")
    args = ap.parse_args(argv)

    target = load_target(args.target, dtype="float32")
    own = target.dtype_tensors()
    copies = {"float32": own, "bfloat16": [t.to(torch.bfloat16) for t in own]}
    tokens = ((torch.arange(max(args.contexts)) * 7 + 3) % target.vocab_size).tolist()  # any tokens
    items = {}
    for name in DTYPES:
        use = (lambda name=name: target.set_tensors(copies[name]))
        for p in args.contexts:
            for w in args.widths:
                items[name, "prefill", p, w], items[name, "both", p, w] = forward_runs(target, tokens[:p], w, use)
    try:
        ms = min_times(items, args.rounds)  # interleaved rounds after a warm-up round, the minimum kept
    finally:
        target.set_tensors(own)
    best: dict[tuple, float] = {}
    for name in DTYPES:
        for p in args.contexts:
            best[name, "prefill", p, 0] = min(ms[name, "prefill", p, w] for w in args.widths)
            for w in args.widths:
                best[name, "step", p, w] = verify_ms(ms[name, "prefill", p, w], ms[name, "both", p, w])

    rows = []
    print(f"{'what':>8} {'P':>5} {'w':>3} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16/fp32':>9}")
    for p in args.contexts:
        keys = [("prefill", p, 0)] + [("step", p, w) for w in args.widths]
        for what, pp, w in keys:
            f, b = best[("float32", what, pp, w)], best[("bfloat16", what, pp, w)]
            rows.append({"what": what, "context": pp, "width": w, "float32_ms": round(f, 2),
                         "bfloat16_ms": round(b, 2), "ratio": round(b / f, 3)})
            print(f"{what:>8} {pp:>5} {w or '':>3} {f:9.1f} {b:9.1f} {b / f:9.2f}")
    out = {"target": target.name, "rounds": args.rounds, "threads": torch.get_num_threads(),
           "machine": platform.machine(), "cpu": auto_basis(target.device), "torch": torch.__version__,
           "rows": rows}
    atomic_write(Path(args.out), json.dumps(out, indent=1))
    print(f"wrote {args.out} ({out['cpu']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
