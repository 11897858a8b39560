"""End-to-end speedup of speculative decoding over plain decoding, T = 0, batch 1, for k = 1..8.

    python benchmarks/e2e_speedup.py --head runs/eagle/head --limit 8
    python benchmarks/e2e_speedup.py --head runs/eagle/head --ks 2 3 4 --dtype bfloat16 --threads 2

For each k, `draftkit.inference.evaluate` decodes the prompts with the head and plainly, interleaved
prompt by prompt (so machine load hits both alike), and checks the outputs are identical. Without
--head the n-gram drafter is measured instead. Prompts: ../shared/data/dev/spec_bench_400.jsonl
(--limit of them, spread evenly over the file so every category is in). Prints a table and writes JSON (--out) with tau, alpha_i and speedup per k.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from draftkit.heads import load_head
from draftkit.inference.evaluate import evaluate, read_prompt_file, resolve_head_dir
from draftkit.target import load_target

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT.parent / "shared" / "data" / "dev" / "spec_bench_400.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", help="head directory; without it the n-gram drafter is measured")
    p.add_argument("--target", help="target path (default: the embedded SmolLM2-135M)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ngram", action="store_true", help="also measure the n-gram drafter at every k")
    p.add_argument("--force", action="store_true", help="use a head recorded for another target")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_speedup.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(args.target, dtype=args.dtype)
    head = None
    if args.head:
        head = load_head(resolve_head_dir(args.head), target, strict_target=not args.force)
        head.to(dtype=target.dtype).eval()
    everything = read_prompt_file(args.prompts)
    prompts = everything[:: max(1, len(everything) // args.limit)][: args.limit]  # spread over the categories
    rows = []
    print(f"{'k':>2}  {'tau':>5}  {'tok/s':>6}  {'plain':>6}  {'speedup':>7}  {'draft ms':>8}  {'verify ms':>9}  "
          f"{'plain ms':>8}  {'ngram tau':>9}  {'ngram x':>7}  mism  alpha_1..k", flush=True)
    for k in args.ks:
        t0 = time.perf_counter()
        rep = evaluate(target, head, prompts, k=k, temperatures=[0.0], max_new_tokens=args.max_new_tokens,
                       batch_size=1, ngram=args.ngram or head is None)
        ng = rep.get("ngram") or {}
        row = {key: rep.get(key) for key in ("k", "tau", "acceptance_per_position", "accepted_length_histogram",
                                              "tokens_per_s", "baseline_tokens_per_s", "speedup",
                                              "draft_ms_per_step", "verify_ms_per_step", "plain_ms_per_step",
                                              "greedy_mismatches", "greedy_near_ties", "num_prompts")}
        row.update(ngram_tau=ng.get("tau"), ngram_speedup=ng.get("speedup"), seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"{k:>2}  {row['tau']:5.2f}  {row['tokens_per_s']:6.1f}  {row['baseline_tokens_per_s']:6.1f}  "
              f"{row['speedup']:6.2f}x  {row['draft_ms_per_step']:8.1f}  {row['verify_ms_per_step']:9.1f}  "
              f"{row['plain_ms_per_step']:8.1f}  {row['ngram_tau'] or 0:9.2f}  {row['ngram_speedup'] or 0:6.2f}x  "
              f"{row['greedy_mismatches']:>4}  " + " ".join(f"{a:.2f}" if a is not None else "-"
                                                        for a in row["acceptance_per_position"]), flush=True)
    best = max(rows, key=lambda r: r["speedup"] or 0)
    result = {"head": args.head, "target": target.info(), "dtype": args.dtype, "threads": args.threads,
              "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "best_k": best["k"], "best_speedup": best["speedup"], "best_tau": max(r["tau"] for r in rows),
              "per_k": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"best k={best['k']}: speedup {best['speedup']:.2f}x, tau {best['tau']:.2f}; wrote {out}")


if __name__ == "__main__":
    main()
