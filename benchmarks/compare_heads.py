"""Train every head family on the same data, token budget and seed, then measure them side by side.

Each family trains with its own recipe (recipes/<family>.yaml: head and optimizer settings) but
with the data section of one base recipe (default recipes/eagle.yaml, so the regenerated responses
and cached features are shared) and the same max_steps / batch / seed. Then every head is
evaluated with the real draft-verify loop (draftkit.inference.evaluate) on the same prompts at
T = 0 and T = 0.7: parameters, training time, τ, α_1..α_k, speedup.

    python benchmarks/compare_heads.py                               # the CPU-hour setting
    python benchmarks/compare_heads.py --max-steps 200 --limit 8      # a quick look
    python benchmarks/compare_heads.py --heads eagle=runs/eagle/head eagle3=runs/eagle3/head   # trained heads
Writes benchmarks/results/compare_heads.json and .md (the README's table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEV_PROMPTS = ROOT.parent / "shared" / "data" / "dev" / "spec_bench_400.jsonl"


def flatten(prefix: str, value) -> list[str]:
    """A mapping -> `a.b=c` overrides (lists and scalars as inline YAML)."""
    if isinstance(value, dict) and value:
        return [o for k, v in value.items() for o in flatten(f"{prefix}.{k}", v)]
    return [f"{prefix}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"]


def train(family: str, args, data_overrides: list[str]) -> dict:
    out = Path(args.out_dir) / family
    cmd = [sys.executable, "draftkit/train/run.py", f"recipes/{family}.yaml", f"output_dir={out}",
           f"train.max_steps={args.max_steps}", f"train.micro_batch_size={args.micro_batch}", "train.grad_accum=1",
           f"train.seed={args.seed}", "train.eval_every=0", "logging.wandb_project=null", "train.resume=none",
           *data_overrides, *args.override]
    if family == "eagle3":
        cmd.append(f"head.ttt_steps={args.eagle3_ttt_steps}")
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"})
    if res.returncode != 0:
        raise SystemExit(f"{family}: training failed ({res.returncode}): {' '.join(cmd)}")
    return {"train_seconds": time.time() - t0, "head_dir": str(out / "head"), "final": final_log_line(out)}


def final_log_line(out: Path) -> dict:
    """The last line of a run's train_log.jsonl ({} when the run wrote none)."""
    log = out / "train_log.jsonl"
    return json.loads(log.read_text().splitlines()[-1]) if log.is_file() else {}


def trained_before(head_dir: Path) -> dict:
    """A head trained earlier (<run>/head), with the last line of its run's training log."""
    return {"head_dir": str(head_dir), "final": final_log_line(head_dir.parent), "train_seconds": None}


def parse_heads(items: list[str]) -> dict[str, Path]:
    """--heads NAME=DIR ... -> {name: head dir}."""
    heads = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--heads: expected NAME=HEAD_DIR, got {item!r}")
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--heads {name}: no head at {path} (config.json missing)")
        heads[name] = Path(path)
    return heads


RUN_KEYS = ("tau", "acceptance_per_position", "speedup", "tokens_per_s", "draft_ms_per_step", "verify_ms_per_step")


def fmt(x, spec: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    """The README's table: one row per family and temperature."""
    md = ["| head | params | train s | held-out acc | T | τ | α_1..α_k | draft ms/step | tok/s | speedup |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for T, run in r["per_temperature"].items():
            alphas = " ".join(fmt(a) for a in run["acceptance_per_position"])
            md.append(f"| {r.get('name', r['family'])} | {r['params'] / 1e6:.1f}M | {fmt(r['train_seconds'], '.0f')} | "
                      f"{fmt(r['heldout_acc'], '.3f')} | {T} | {fmt(run['tau'])} | {alphas} | "
                      f"{fmt(run.get('draft_ms_per_step'), '.1f')} | {fmt(run.get('tokens_per_s'), '.1f')} | "
                      f"{fmt(run['speedup'])}x |")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["eagle", "eagle3", "medusa", "mtp"])
    ap.add_argument("--base-recipe", default="recipes/eagle.yaml", help="whose data section every family uses")
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eagle3-ttt-steps", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--limit", type=int, default=16, help="eval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-train", action="store_true", help="evaluate heads already in --out-dir/<family>")
    ap.add_argument("--heads", nargs="+", default=None, metavar="NAME=DIR",
                    help="evaluate these trained heads (e.g. the recipes' runs) instead of training")
    ap.add_argument("--out-dir", default="runs/compare")
    ap.add_argument("--override", nargs="*", default=[], help="extra recipe overrides for every family")
    ap.add_argument("--out", default="benchmarks/results/compare_heads.json")
    ap.add_argument("--table-only", action="store_true", help="rewrite the .md table from an existing --out JSON")
    args = ap.parse_args()
    if args.table_only:
        out = Path(args.out)
        out.with_suffix(".md").write_text(markdown(json.loads(out.read_text())["rows"]))
        print(out.with_suffix(".md").read_text())
        return

    base = yaml.safe_load((ROOT / args.base_recipe).read_text())
    data_overrides = flatten("data", base["data"]) + flatten("target", base.get("target") or {})
    if args.heads:
        trained = {name: trained_before(path) for name, path in parse_heads(args.heads).items()}
    else:
        trained = {family: trained_before(Path(args.out_dir) / family / "head") if args.skip_train
                   else train(family, args, data_overrides) for family in args.families}

    from draftkit.heads import load_head
    from draftkit.inference.drafters import DraftSettings
    from draftkit.inference.evaluate import EvalSettings, evaluate, read_prompt_file
    from draftkit.target import cpu_flags, load_target

    target = load_target(base.get("target", {}).get("path"), dtype=args.dtype)
    if not DEV_PROMPTS.is_file():
        raise SystemExit(f"needs the dev prompts at {DEV_PROMPTS} (benchmarks may read ../shared/data)")
    prompts = read_prompt_file(DEV_PROMPTS)[:: max(1, 400 // args.limit)][: args.limit]  # every category
    rows = []
    for name, run in trained.items():
        head = load_head(run["head_dir"], target).to(target.dtype).eval()
        chain = DraftSettings(mode="chain", k=min(args.k, head.max_draft_tokens or args.k))
        rep = evaluate(target, head, prompts, EvalSettings(draft=chain, compare=("plain",),
                                                           temperatures=tuple(args.temperatures),
                                                           max_new_tokens=args.max_new_tokens))
        row = {"name": name, "family": head.family, "head_dir": run["head_dir"],
               "params": sum(p.numel() for p in head.parameters()),
               "train_seconds": run.get("train_seconds"),
               "final_train_acc": run.get("final", {}).get("acc"),
               "heldout_acc": run.get("final", {}).get("heldout_acc"),
               "per_temperature": {r["temperature"]: {key: r.get(key) for key in RUN_KEYS} for r in rep["runs"]},
               "tau": rep["tau"],
               "acceptance_per_position": rep["acceptance_per_position"], "speedup": rep.get("speedup"),
               "greedy_mismatches": rep.get("greedy_mismatches")}
        rows.append(row)
        print(json.dumps(row, default=str))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("out",)}
    machine = {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "dtype": str(target.dtype),
               "dtype_choice": target.dtype_choice}
    out.write_text(json.dumps({"settings": meta, "machine": machine, "rows": rows}, indent=2, default=str))
    md = markdown(rows)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
