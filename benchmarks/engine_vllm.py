"""Heads served by vLLM (CPU) beside vLLM plain, vLLM's ngram / suffix and draftkit's loop under vLLM's rule.

    python benchmarks/engine_vllm.py --heads runs/quick/head [--limit 12] [--max-new-tokens 64]
        [--dtypes float32 bfloat16] [--temperatures 0 1] [--batch-sizes 1 4 16] [--k 3]
    python benchmarks/engine_vllm.py --heads runs/eagle3/head runs/dflash/head@7 runs/dflash/head@3   # a head's own k

Embedded target (SmolLM2-135M), Spec-Bench dev prompts (benchmarks/results/specbench_dev60.jsonl),
every method in one run per dtype: plain, ngram and suffix (where arctic-inference is installed:
scripts/setup_vllm_suffix.sh; otherwise a note says why not) once, then each head (a native head,
exported here, or a vLLM export), each head's T = 0 greedy tokens checked against that one plain run.
Prints a table and writes JSON to benchmarks/results/engine_vllm.json (--out). vLLM comes from scripts/setup_vllm.sh (draftkit/engines/vllm.py: find_python).
Exit 1 when our loop and the engine disagree beyond the tolerance (engines/vllm.py: compare).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from draftkit.target import cpu_flags  # noqa: E402  (one home: the phrase every result records)


def head_and_k(item: str, k: int) -> tuple[str, int]:
    """--heads item "DIR" or "DIR@K" -> (DIR, its k; --k when none is given)."""
    path, sep, own = item.rpartition("@")
    if not sep or not own.isdigit() or int(own) < 1:
        return item, k
    return path, int(own)


def serve_heads(target, heads: list[str], ids: list[list[int]], base):
    """Each head through engine_eval, one dtype's settings `base`: vLLM plain and the model-free methods
    (base.methods: ngram, and suffix where arctic-inference imports) served with the first head only, and plain's outputs handed to every later head (engine_eval's `plain`), so every
    head gets its own T = 0 check "vLLM with the head = vLLM plain" (vllm_eval.greedy_outputs_check)
    and its own result fields. A head given as DIR@K is served with num_speculative_tokens K (base.k
    otherwise). Yields (head, report without outputs, the outputs taken out of it)."""
    from draftkit.engines.vllm_eval import engine_eval, plain_outputs

    plain = None
    for n, item in enumerate(heads):
        head, k = head_and_k(item, base.k)
        s = replace(base, methods=base.methods if n == 0 else ("head",), k=k)
        report = engine_eval(target, head, ids, s, plain=plain)
        plain = plain or plain_outputs(report)
        kept = {"dtype": base.dtype, "head": head, "k": k, "prompts": ids, "engine": {}, "loop": {}}
        for m, runs in report["engine"].items():
            kept["engine"][m] = {name: r.pop("outputs") for name, r in runs.items() if isinstance(r, dict) and "outputs" in r}
        kept["loop"] = {name: r.pop("outputs") for name, r in report["loop"].items() if "outputs" in r}
        report.update(dtype=base.dtype, head=head, k=k, prompts=len(ids))
        yield head, report, kept


def main() -> int:
    from draftkit.engines.vllm import find_python
    from draftkit.engines.vllm_eval import EngineEvalSettings, format_report
    from draftkit.inference.evaluate import encode, read_prompt_file
    from draftkit.target import load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True,
                    help="native heads or vLLM exports, each DIR or DIR@K (served with its own k)")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/results/specbench_dev60.jsonl"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--every", type=int, default=1,
                    help="every Nth prompt (the dev file is ordered by category: --every 2 keeps 6 of each of 5)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--loop-batch-sizes", type=int, nargs="+", default=None,
                    help="our loop's batch sizes (default: --batch-sizes); other engine runs are compared with "
                         "the loop's smallest batch at the same temperature")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--cpu-sampler-as-shipped", action="store_true",
                    help="T > 0: serve vLLM CPU's rejection sampler as shipped (0.32.0 applies an uninitialised "
                         "temperature: benchmarks/vllm_t1_trace.py) instead of with the worker's correction")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engine_vllm.json")
    args = ap.parse_args()
    python = find_python()
    prompts = read_prompt_file(args.prompts)[:: args.every][: args.limit]
    result = {"cpu_flags": cpu_flags(), "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    ok = True
    outputs = []  # every run's token ids, beside the figures (the T = 0 divergences can be traced again offline)
    for dtype in args.dtypes:
        target = load_target(None, dtype=dtype)
        ids = [i for i in (encode(target.tokenizer, p) for p in prompts) if i]
        base = EngineEvalSettings(k=args.k, temperatures=tuple(args.temperatures), max_new_tokens=args.max_new_tokens,
                                  batch_sizes=tuple(args.batch_sizes), dtype=dtype, python=python,
                                  loop_batch_sizes=tuple(args.loop_batch_sizes) if args.loop_batch_sizes else None,
                                  cpu_sampler_fix=not args.cpu_sampler_as_shipped)
        for head, report, kept in serve_heads(target, args.heads, ids, base):
            outputs.append(kept)
            print(f"\n== {head} k={report['k']} ({dtype}, {len(ids)} prompts, {args.max_new_tokens} new tokens, CPU {cpu_flags()})")
            print(format_report(report))
            result["runs"].append(report)
            ok &= report["ok"] or dtype != "float32"  # bf16: differences reported, not failures
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    side = args.out.with_name(args.out.stem + "_outputs.json")
    side.write_text(json.dumps(outputs))
    print(f"wrote {args.out} and {side}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
