"""The offline task sets as training prompts, minus anything Spec-Bench asks: a development data source.

Issue 20 names regenerated answers to GSM8K, HumanEval and Alpaca prompts among the data levers. The
project's development copies (`../shared/data/train/`: 80 prompts each from the EAGLE repo, and
FastChat's Vicuna bench) are not on a user's machine, so no recipe reads them; this writes their first
turns as JSONL (`{"turns": [prompt]}`, a shape `data.sources` reads) for a measurement run, e.g.

    python benchmarks/task_sets.py --out data/task_sets.jsonl
    deepspeed draftkit/train/run.py recipes/eagle-mix.yaml output_dir=runs/eagle-mix-tasks \
        'data.sources=[{path: data/sharegpt_1100.jsonl, weight: 0.69}, {path: data/task_sets.jsonl, weight: 0.31}]'

Spec-Bench's math category is GSM8K's test set, which the EAGLE repo's gsm8k prompts overlap: a prompt
whose whitespace-normalized, lower-cased first 120 characters occur in any of the 400 Spec-Bench prompts
(or theirs in it) is dropped and counted, so the measured categories are never trained on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftkit.inference.evaluate import read_prompt_file

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_SETS = [SHARED / "train" / f"{name}_80.jsonl" for name in ("gsm8k", "humaneval", "alpaca", "vicuna_bench")]
PREFIX = 120


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _first_turns(path: Path) -> list[str]:
    """The user turn of each prompt in a prompt file (any shape draftkit reads; errors name the file)."""
    return [p.messages[-1]["content"] for p in read_prompt_file(path)]


def overlaps(prompt: str, measured: list[str]) -> bool:
    """True when the prompt's normalized opening is in a measured prompt, or a measured opening in it."""
    p = _norm(prompt)
    return any(p[:PREFIX] in m or m[:PREFIX] in p for m in measured)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="*", type=Path, default=DEFAULT_SETS, help="JSONL files with `turns`")
    ap.add_argument("--exclude", type=Path, default=SHARED / "dev" / "spec_bench_400.jsonl",
                    help="prompts never to train on (JSONL with `turns`)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    measured = [_norm(t) for t in _first_turns(args.exclude)]
    kept = []
    for path in args.sets:
        prompts = _first_turns(path)
        ok = [p for p in prompts if not overlaps(p, measured)]
        print(f"{path.name}: {len(prompts)} prompts, {len(prompts) - len(ok)} dropped (in {args.exclude.name})")
        kept += ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in kept), encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {len(kept)} prompts to {args.out}")


if __name__ == "__main__":
    main()
