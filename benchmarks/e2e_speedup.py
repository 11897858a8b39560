"""End-to-end speedup of drafting configurations over plain decoding: chain vs tree vs hybrid vs
lookup, over sizes, batch 1, all interleaved prompt by prompt in ONE run.

    python benchmarks/e2e_speedup.py --head runs/eagle/head --limit 15 --dtype bfloat16
    python benchmarks/e2e_speedup.py --head runs/eagle/head --configs "chain k=3" "tree topk=4 depth=5 budget=16" \\
        "hybrid topk=2 depth=4 budget=8 lookup_len=8" "lookup lookup_len=8"

Several heads side by side, interleaved in the same run (a config names its head with head=NAME):

    python benchmarks/e2e_speedup.py --head eagle3=runs/eagle3/head dflash=runs/dflash/head \\
        --configs "chain k=7 head=eagle3" "chain k=7 head=dflash"

A config is a mode (chain | tree | hybrid | lookup) followed by DraftSettings fields. For every
prompt, plain decoding and every config decode it in rotated order (so machine load hits all alike);
at T = 0 every output is compared with plain decoding (mismatches, and bf16 near-ties).
Prompts: ../shared/data/dev/spec_bench_400.jsonl, --limit of them spread evenly over the file so
every category is in. Prints a table (overall and per category) and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from draftkit.heads import load_head
from draftkit.inference.decoder import SpecDecoder, plain_generate
from draftkit.inference.stats import PlainStats, SpecStats, TeacherForced, compare_greedy
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.cli_eval import resolve_head_dir
from draftkit.inference.evaluate import _prepare, read_prompt_file
from draftkit.inference.sampling import SamplingParams
from draftkit.target import cpu_flags, load_target

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT.parent / "shared" / "data" / "dev" / "spec_bench_400.jsonl"
DEFAULT_CONFIGS = [
    "lookup lookup_len=8",
    "chain k=3", "chain k=5",
    "tree topk=2 depth=4 budget=8", "tree topk=4 depth=5 budget=16", "tree topk=8 depth=6 budget=32",
    "hybrid topk=2 depth=4 budget=8 lookup_len=8", "hybrid topk=4 depth=5 budget=16 lookup_len=8",
    "hybrid topk=2 depth=4 budget=8 lookup_len=8 head_off_at=4",
]


def parse_config(text: str) -> tuple[DraftSettings, str | None]:
    """"mode key=value ..." -> (DraftSettings, the head it names with head=NAME, or None)."""
    mode, *pairs = text.split()
    fields, head = {}, None
    for pair in pairs:
        key, _, val = pair.partition("=")
        if key == "head":
            head = val
            continue
        fields[key] = None if val in ("none", "null") else int(val)
    return DraftSettings(mode=mode, chosen_by="user", **fields), head


def parse_heads(items: list[str] | None) -> dict[str, str]:
    """--head DIR | NAME=DIR ... -> {name: dir}; a bare DIR is named "head"."""
    heads = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        name, path = (name, path) if sep else ("head", item)
        if not name or not path or name in heads:
            raise SystemExit(f"--head: expected DIR or NAME=DIR with distinct names, got {item!r}")
        heads[name] = path
    return heads


def config_head(text: str, named: str | None, heads: dict) -> str | None:
    """Which head a config drafts with: the one it names, else the only one (None: no head)."""
    if named is not None:
        if named not in heads:
            raise SystemExit(f"config {text!r}: head={named} is not one of --head {sorted(heads)}")
        return named
    if len(heads) > 1:
        raise SystemExit(f"config {text!r}: several heads given ({sorted(heads)}): name one with head=NAME")
    return next(iter(heads), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", nargs="+", help="head directory, or NAME=DIR ... for several (configs other than "
                   "lookup need one)")
    p.add_argument("--target", help="target path (default: the embedded SmolLM2-135M)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=15)
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--force", action="store_true", help="use a head recorded for another target")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_speedup.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(args.target, dtype=args.dtype)
    head_dirs = parse_heads(args.head)
    heads = {n: load_head(resolve_head_dir(d), target, strict_target=not args.force).to(dtype=target.dtype).eval()
             for n, d in head_dirs.items()}
    parsed = {c: parse_config(c) for c in args.configs}
    configs, uses = {}, {}
    for c, (s, named) in parsed.items():
        uses[c] = None if s.mode == "lookup" else config_head(c, named, heads)
        if s.mode == "lookup" or uses[c] is not None:
            configs[c] = s
    decoders = {}
    for name, s in configs.items():
        drafter, kw = s.decoder_args(heads.get(uses[name]))
        decoders[name] = SpecDecoder(target, drafter, **kw)
    everything = read_prompt_file(args.prompts)
    chosen = everything[:: max(1, len(everything) // args.limit)][: args.limit]
    items, _ = _prepare(target, chosen, 80, args.max_new_tokens)
    params = SamplingParams(args.temperature)
    names = ["plain", *decoders]
    totals = {n: PlainStats() if n == "plain" else SpecStats(decoders[n].k) for n in names}
    per_cat: dict[str, dict] = {}
    outputs = {n: [] for n in names}
    for d in decoders.values():  # warm-up, not timed
        d.generate([items[0]["ids"]], 4)
    plain_generate(target, [items[0]["ids"]], 4)
    t0 = time.perf_counter()
    for i, it in enumerate(items):
        order = names[i % len(names):] + names[: i % len(names)]
        cat = per_cat.setdefault(it["category"], {n: PlainStats() if n == "plain" else SpecStats(totals[n].k)
                                                  for n in names})
        for n in order:
            if n == "plain":
                out, st, _ = plain_generate(target, [it["ids"]], args.max_new_tokens, params, [i])
            else:
                out, st = decoders[n].generate([it["ids"]], args.max_new_tokens, params, [i])
            totals[n] += st
            cat[n] += st
            outputs[n].append(out[0])
        print(f"  {i + 1}/{len(items)} prompts, {time.perf_counter() - t0:.0f} s", flush=True)

    def row(n, stats, plain):
        if n == "plain":
            return {"tokens_per_s": stats.tokens_per_s}
        d = stats.to_dict()
        return {"tau": d["tau"], "acceptance_per_position": d["acceptance_per_position"],
                "accepted_by_source": d["accepted_by_source"], "tokens_per_s": d["tokens_per_s"],
                "speedup": d["tokens_per_s"] / plain.tokens_per_s if plain.tokens_per_s else None,
                "draft_ms_per_step": d["draft_ms_per_step"], "verify_ms_per_step": d["verify_ms_per_step"]}

    result_rows = {}
    scorer = TeacherForced(target)
    for n in names:
        r = row(n, totals[n], totals["plain"])
        if n != "plain" and params.greedy:
            cmp = compare_greedy(outputs[n], outputs["plain"], [it["ids"] for it in items], scorer)
            r.update(greedy_mismatches=cmp["mismatches"], greedy_near_ties=cmp["near_ties"], greedy_max_gap=cmp["max_gap"])
        r["per_category"] = {c: row(n, st[n], st["plain"]) for c, st in per_cat.items()}
        result_rows[n] = r
    cats = sorted(per_cat)
    print(f"\n{'config':<58} {'tau':>5} {'tok/s':>6} {'speedup':>7} {'mism':>9}  " + "  ".join(f"{c[:10]:>10}" for c in cats))
    for n, r in result_rows.items():
        mism = f"{r.get('greedy_mismatches', '-')}/{r.get('greedy_near_ties', '-')}"
        per = "  ".join(f"{(r['per_category'][c].get('speedup') or 1.0):9.2f}x" for c in cats)
        print(f"{n:<58} {r.get('tau', 1.0):5.2f} {r['tokens_per_s']:6.1f} {r.get('speedup') or 1.0:6.2f}x {mism:>9}  {per}")
    result = {"heads": head_dirs, "config_heads": {n: uses[n] for n in configs}, "target": target.info(),
              "dtype": args.dtype, "threads": args.threads,
              "temperature": args.temperature, "prompts": args.prompts, "limit": args.limit,
              "num_prompts": len(items), "max_new_tokens": args.max_new_tokens,
              "machine": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
              "dtype_choice": target.dtype_choice, "torch": torch.__version__,
              "configs": {n: s.to_dict() for n, s in configs.items()}, "rows": result_rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    best = max((n for n in result_rows if n != "plain"), key=lambda n: result_rows[n]["speedup"] or 0)
    print(f"best: {best}: {result_rows[best]['speedup']:.2f}x, tau {result_rows[best]['tau']:.2f}; wrote {out}")


if __name__ == "__main__":
    main()
