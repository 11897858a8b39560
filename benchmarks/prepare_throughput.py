"""Stage 2 of `draftkit prepare` (offline target features): bytes per token and tokens/s per layout.

    python benchmarks/prepare_throughput.py                                   # recipes/eagle3.yaml's prepared data
    python benchmarks/prepare_throughput.py --num-samples 32 --topk 16 8
    python benchmarks/prepare_throughput.py --prepared ~/.cache/draftkit/data/prepared/<fingerprint>
    python benchmarks/prepare_throughput.py --prompts ../shared/data/train/alpaca_80.jsonl   # prompts only

For the recipe's target (default: the embedded SmolLM2-135M, hidden 576, 30 layers) and its head's
feature layers (EAGLE-3: three), computes the features of the same N samples in each layout of
draftkit/train/data.py's FeatureStore, into a scratch directory, one after the other:
    bf16+final    bfloat16 three layers + the final hidden state + top-1 id (the reference)
    fp8+final     float8 e4m3 (an fp32 scale per token and layer) + the final hidden state
    bf16+top{k}   bfloat16 three layers + the target's top-k ids (int32) and log-probs (float16)
    fp8+top{k}    float8 three layers + top-k                       (train.target_topk = k)
and prints bytes/token measured from the files on disk (headers included) and computed from the
layout, the ratio to the reference, features tokens/s (target forward + writing), and for top-k
layouts the mean probability mass the top-k holds. The same layouts' bytes/token are computed for
a hidden size of 4096 (Llama-3-8B, layers 2/16/29): the issue's reference is 32 KiB there.

Samples: --prepared DIR (a `draftkit prepare` directory), else --prompts FILE (prompt tokens only),
else the recipe's own prepared data (run `draftkit prepare RECIPE` first). Writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from draftkit.config import load_recipe
from draftkit.heads import build_head
from draftkit.target import load_target
from draftkit.train.data import FeatureStore, layout_bytes

ROOT = Path(__file__).resolve().parents[1]

LLAMA3_8B = {"hidden_size": 4096, "layers": (2, 16, 29)}  # EAGLE-3's default (2, N//2, N-3) for N = 32


def layouts(topks: list[int]) -> list[tuple[str, str, int]]:
    """(name, train.feature_storage, train.target_topk), the reference first."""
    out = [("bf16+final", "bfloat16", 0), ("fp8+final", "float8", 0)]
    for k in topks:
        out += [(f"bf16+top{k}", "bfloat16", k), (f"fp8+top{k}", "float8", k)]
    return out


def bench_samples(args, recipe, target) -> tuple[list[dict], str]:
    """The first --num-samples samples {input_ids, loss_mask} and where they came from."""
    from draftkit.distill.prepare import finished, load_prepared

    if args.prompts:
        from draftkit.distill import PromptSource, load_prompts
        from draftkit.distill.regenerate import chat_ids

        prompts = load_prompts([PromptSource(args.prompts)], limit=args.num_samples, seed=0)
        ids = [chat_ids(target.tokenizer, p.messages, True) for p in prompts]
        return [{"input_ids": list(i), "loss_mask": [1] * len(i)} for i in ids], f"prompts {args.prompts}"
    directory = Path(args.prepared).expanduser() if args.prepared else None
    if directory is None:
        from draftkit.train.deepspeed_config import build_deepspeed_config

        ds = build_deepspeed_config(recipe, 1, torch.cuda.is_available())
        directory = finished(recipe, target, recipe.samples_needed(ds["train_batch_size"]))
        if directory is None:
            sys.exit(f"error: {args.recipe}'s data is not prepared: run `draftkit prepare {args.recipe}` "
                     "first, or pass --prepared DIR or --prompts FILE")
    data = load_prepared(directory)
    return (data.train + data.holdout_samples)[: args.num_samples], f"prepared {directory}"


def measure(target, layers, samples, storage: str, topk: int, scratch: Path, batch_size: int, pad: int) -> dict:
    """Features of `samples` in one layout, as `draftkit prepare --features` computes them (sorted
    by length, batch_size at a time): seconds, bytes on disk, top-k mass."""
    store = FeatureStore(target, layers, scratch, storage, topk)
    todo = sorted(samples, key=lambda s: len(s["input_ids"]))
    t0 = time.perf_counter()
    for i in range(0, len(todo), batch_size):
        store.ensure(todo[i: i + batch_size], pad)
    seconds = time.perf_counter() - t0
    files = sorted(store.dir.glob("*.safetensors"))
    tokens = sum(len(s["input_ids"]) for s in samples)
    mass = None
    if topk:
        sums = []
        for f in files:
            with safe_open(f, framework="pt") as fh:  # memory-mapped, as training reads them
                sums.append(fh.get_tensor("topk_logp").float().exp().sum(-1))
        mass = round(torch.cat(sums).mean().item(), 4)
    return {"files": len(files), "tokens": tokens, "bytes": sum(f.stat().st_size for f in files),
            "bytes_per_token_layout": store.bytes_per_token(), "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "topk_mass": mass}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "eagle3.yaml"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides key.path=value")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--topk", type=int, nargs="+", default=[16], help="top-k values to measure")
    ap.add_argument("--batch-size", type=int, default=None, help="samples per forward (default: the recipe's micro batch)")
    ap.add_argument("--prepared", help="a `draftkit prepare` directory to take the samples from")
    ap.add_argument("--prompts", help="a prompt file (JSON/JSONL): features of the prompts' tokens only")
    ap.add_argument("--scratch", help="where the layouts' files are written (default: a temporary directory, removed)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prepare_throughput.json"))
    args = ap.parse_args()

    recipe = load_recipe(args.recipe, args.overrides)
    t = recipe.target
    target = load_target(t.path, gguf_file=t.gguf_file, dtype=t.dtype, trust_remote_code=t.trust_remote_code,
                         device="cuda" if torch.cuda.is_available() else "cpu")
    layers = build_head(recipe.head, target).feature_layers
    samples, origin = bench_samples(args, recipe, target)
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else None
    pad = 0 if pad is None else pad
    batch = args.batch_size or recipe.train.micro_batch_size
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    try:
        measure(target, layers, samples[:batch], "target", 0, scratch / "warmup", batch, pad)  # warm-up
        results = []
        for name, storage, k in layouts(args.topk):
            r = measure(target, layers, samples, storage, k, scratch / name, batch, pad)
            r.update(layout=name, storage=storage, topk=k)
            results.append(r)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    ref = results[0]["bytes"] / results[0]["tokens"]
    big_ref = layout_bytes(LLAMA3_8B["hidden_size"], LLAMA3_8B["layers"], "bfloat16")
    for r in results:
        r["bytes_per_token"] = round(r["bytes"] / r["tokens"], 1)
        r["ratio"] = round(ref / r["bytes_per_token"], 2)
        r["bytes_per_token_4096"] = layout_bytes(LLAMA3_8B["hidden_size"], LLAMA3_8B["layers"], r["storage"], r["topk"])
        r["ratio_4096"] = round(big_ref / r["bytes_per_token_4096"], 2)

    tokens = results[0]["tokens"]
    print(f"{target.name} (hidden {target.hidden_size}, {target.num_layers} layers, {str(target.dtype)[6:]}), "
          f"layers {list(layers)}, {len(samples)} samples, {tokens} tokens ({origin}), batch {batch}")
    head = f"{'layout':<12} {'B/tok disk':>10} {'B/tok layout':>12} {'ratio':>6} {'tok/s':>8} {'top-k mass':>10}"
    head += f" | {'B/tok H=4096':>12} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in results:
        mass = "" if r["topk_mass"] is None else f"{r['topk_mass']:.3f}"
        print(f"{r['layout']:<12} {r['bytes_per_token']:>10.1f} {r['bytes_per_token_layout']:>12} {r['ratio']:>5.2f}x "
              f"{r['tokens_per_s']:>8.1f} {mass:>10} | {r['bytes_per_token_4096']:>12} {r['ratio_4096']:>5.2f}x")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"target": target.name, "hidden_size": target.hidden_size, "num_layers": target.num_layers,
            "dtype": str(target.dtype).replace("torch.", ""), "feature_layers": list(layers),
            "samples": len(samples), "tokens": tokens, "samples_from": origin, "batch_size": batch,
            "reference": "bf16+final", "llama3_8b": {"hidden_size": 4096, "layers": list(LLAMA3_8B["layers"]),
                                                     "reference_bytes_per_token": big_ref},
            "threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__}
    from draftkit.inference.report import atomic_write

    atomic_write(out, json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
