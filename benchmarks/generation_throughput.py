"""Response tokens/s of batched target generation (draftkit.distill.regenerate) vs batch size.

    python benchmarks/generation_throughput.py                      # embedded SmolLM2 GGUF, fp32
    python benchmarks/generation_throughput.py --dtypes fp32 bf16 --model /path/to/hf_dir
    python benchmarks/generation_throughput.py --dtypes bf16 --batch-sizes 16 64 --num-prompts 128
    python benchmarks/generation_throughput.py --dtypes bf16 --attention gqa --schedulers batch refill
    python benchmarks/generation_throughput.py --dtypes fp32 bf16 --attention gqa --schedulers refill vllm \
        --batch-sizes 32 --num-prompts 32 --max-new-tokens 64          # vLLM (data.responses.engine) vs refill

Each batch size runs with transformers' "sdpa" attention and with draftkit's GQA attention
(draftkit/attention.py, what draftkit.target loads on CPU), one after the other on the same model
and prompts, and the table gives their ratio. Scheduler "vllm" answers the same token ids through
vLLM (draftkit/engines/vllm_data.py, what data.responses.engine: vllm runs; its own venv), batch
size = vLLM's max_num_seqs; its seconds are the generation's alone (the worker times it; the
engine start and model load are reported beside, as `load_seconds`), and it runs once per batch
size whatever --attention says (vLLM has its own).

Each batch size answers max(batch size, --min-prompts) prompts (capped by --num-prompts), sorted
by length as `regenerate` does, after one short warm-up call. Prompts come from
../shared/data/train/*.jsonl when present, else they are synthesized Magpie-style by the target.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from draftkit.attention import register as register_gqa_attention
from draftkit.distill import GenerationSettings, PromptSource, SynthesisSettings, load_prompts, synthesize_prompts
from draftkit.distill.refill import generate_refill
from draftkit.distill.regenerate import chat_ids, generate_batch
from draftkit.engines.vllm_data import DataSampling, generate_responses
from draftkit.prompts import stop_token_ids
from draftkit.target import embedded_model_dir, load_target

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTENTION = {"sdpa": lambda: "sdpa", "gqa": register_gqa_attention}


def load_bench_prompts(model, tok, n: int, path: str | None = None):
    if path:  # the recipe's own prompts, e.g. the Magpie prompts a training run cached
        return load_prompts([PromptSource(path)], limit=n, seed=0), path
    files = sorted((ROOT.parent / "shared" / "data" / "train").glob("*.jsonl"))
    if files:
        return load_prompts([PromptSource(str(f)) for f in files], limit=n, seed=0), "shared/data/train"
    return synthesize_prompts(model, tok, n, SynthesisSettings(batch_size=min(n, 32), max_new_tokens=96)), "magpie"


def run_vllm(model_dir, dtype: str, model, tok, ids: list[list[int]], batch_size: int, max_new_tokens: int) -> dict:
    """The same prompts through vLLM; seconds of generation only (load_seconds beside)."""
    stats = {}
    sampling = DataSampling(max_tokens=max_new_tokens, stop_token_ids=stop_token_ids(model, tok))
    outs = [o for _, chunk in generate_responses(model_dir, dtype, ids, [0] * len(ids), sampling,
                                                 chunk_size=batch_size, stats=stats) for o in chunk]
    stops = set(sampling.stop_token_ids)
    tokens, dt = sum(map(len, outs)), stats["wall_s"]
    return {"scheduler": "vllm", "batch_size": batch_size, "prompts": len(ids), "response_tokens": tokens,
            "truncated": sum(1 for o in outs if not stops.intersection(o)), "seconds": round(dt, 2),
            "tok_per_s": round(tokens / dt, 1), "load_seconds": round(stats["load_seconds"], 1),
            "vllm_version": stats["vllm_version"]}


def run(model, tok, prompts, batch_size: int, max_new_tokens: int, scheduler: str = "batch",
        model_dir: str | None = None) -> dict:
    settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size, scheduler=scheduler)
    ids = sorted((chat_ids(tok, p.messages, True) for p in prompts), key=len)
    if scheduler == "vllm":
        return run_vllm(model_dir, str(model.dtype).removeprefix("torch."), model, tok, ids, batch_size,
                        max_new_tokens)
    generate_batch(model, tok, ids[:batch_size], GenerationSettings(max_new_tokens=4))  # warm-up
    tokens, truncated, t0 = 0, 0, time.perf_counter()
    if scheduler == "refill":  # finished rows take the next prompt at once (distill/refill.py)
        outs = [o for _, o in generate_refill(model, tok, ids, settings)]
    else:
        outs = [o for b in range(0, len(ids), batch_size)
                for o in generate_batch(model, tok, ids[b: b + batch_size], settings)]
    for o in outs:
        tokens += o["num_tokens"]
        truncated += o["truncated"]
    dt = time.perf_counter() - t0
    return {"scheduler": scheduler, "batch_size": batch_size, "prompts": len(ids), "response_tokens": tokens,
            "truncated": truncated, "seconds": round(dt, 2), "tok_per_s": round(tokens / dt, 1)}


def _cpu_flag(flag: str) -> bool | None:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None


def write_json(args, results: list[dict], origin: str) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model or GGUF, "max_new_tokens": args.max_new_tokens, "prompts_from": origin,
            "threads": torch.get_num_threads(), "device": args.device if args.device == "cpu" else
            torch.cuda.get_device_name(), "platform": platform.platform(), "torch": torch.__version__,
            "cpu_avx512_bf16": _cpu_flag("avx512_bf16")}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model dir (default: the embedded SmolLM2-135M GGUF)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least")
    ap.add_argument("--prompts", help="prompt file to answer (JSON/JSONL, any shape draftkit reads; default: "
                    "../shared/data/train/*.jsonl, else Magpie prompts the target writes)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--attention", nargs="+", default=list(ATTENTION), choices=list(ATTENTION),
                    help="sdpa: transformers' own; gqa: draftkit's CPU attention without KV-cache copies")
    ap.add_argument("--schedulers", nargs="+", default=["batch"], choices=["batch", "refill", "vllm"],
                    help="batch: model.generate per batch; refill: finished rows take the next prompt; "
                    "vllm: vLLM's engine (its own venv, scripts/setup_vllm.sh)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 is "
                    "far faster when other processes share the cores, as spinning threads starve")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generation_throughput.json"))
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in args.dtypes:
        t = time.perf_counter()
        target = load_target(args.model, dtype=DTYPES[name], device=args.device)
        model, tok = target.model, target.tokenizer
        print(f"[{name}] target loaded in {time.perf_counter() - t:.1f}s", flush=True)
        prompts, origin = load_bench_prompts(model, tok, args.num_prompts, args.prompts)
        model_dir = (args.model or str(embedded_model_dir())) if "vllm" in args.schedulers else None
        for bs in args.batch_sizes:
            n = min(len(prompts), max(bs, args.min_prompts))
            for attention, scheduler in ((a, s) for a in args.attention for s in args.schedulers):
                if scheduler == "vllm" and attention != args.attention[0]:
                    continue  # vLLM has its own attention: once per batch size
                model.set_attn_implementation(ATTENTION[attention]())
                r = {"dtype": name, "attention": "vllm" if scheduler == "vllm" else attention,
                     **run(model, tok, prompts[:n], bs, args.max_new_tokens, scheduler, model_dir)}
                results.append(r)
                write_json(args, results, origin)
                print(f"  {name:5s} {attention:5s} {scheduler:6s} bs={bs:3d} prompts={r['prompts']:3d} tokens={r['response_tokens']:5d} "
                      f"truncated={r['truncated']:3d} {r['seconds']:7.1f}s {r['tok_per_s']:7.1f} tok/s", flush=True)
    print("\n| dtype | attention | scheduler | batch | prompts | tokens | truncated | s | tok/s | vs sdpa batch |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ref = next((x for x in results if x["attention"] == "sdpa" and x["scheduler"] == "batch"
                    and x["dtype"] == r["dtype"] and x["batch_size"] == r["batch_size"]), None)
        ratio = f"{r['tok_per_s'] / ref['tok_per_s']:.2f}x" if ref else "–"
        print(f"| {r['dtype']} | {r['attention']} | {r['scheduler']} | {r['batch_size']} | {r['prompts']} | {r['response_tokens']} | "
              f"{r['truncated']} | {r['seconds']} | {r['tok_per_s']} | {ratio} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
