"""Draft-vocabulary coverage on a prompt file: the share of what the target says there that a draft
vocabulary holds (issue 20: 13.5% of the target's Spec-Bench tokens fell outside the shipped head's 8k).

    python benchmarks/vocab_coverage.py recipes/eagle-mix.yaml                  # after `draftkit prepare` of it
    python benchmarks/vocab_coverage.py recipes/eagle.yaml --head runs/eagle/head   # a trained head's vocabulary
    python benchmarks/vocab_coverage.py recipes/eagle-mix.yaml data.num_prompts=200 --prompts my_traffic.jsonl

The vocabulary: a trained head's (--head), else the one the trainer chooses from the recipe's prepared
data (stage 1, finished: `draftkit prepare RECIPE`, or --prepared DIR): the head.draft_vocab_size (or
--size) most frequent loss tokens of its training samples (heads/vocab.sample_counts, as train/loop.py).
The target's continuations: its greedy answer to every prompt of --prompts (distill/regenerate.py with
the recipe's data.responses at T = 0 and --max-new-tokens, cached beside the training responses),
tokenized as a training sample is (the response and its closing end-of-turn token). Per category and
pooled: tokens, inside, inside_fraction (heads/vocab.coverage), beside the recipe's held-aside responses
(the figure the trainer logs as heldout_in_draft_vocab) when the vocabulary comes from prepared data.
--samples N chooses it from N of the training samples instead (evenly spaced: two data sets compared at equal size).
acceptance_gap.py's outside_draft_vocab is 1 - inside_fraction of the draft loop's continuations (the
same greedy tokens, up to bf16 batch numerics). Prints a table; --out writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftkit.config import PromptSource, load_recipe  # noqa: E402
from draftkit.heads.vocab import build_draft_vocab, coverage, sample_counts  # noqa: E402
from draftkit.inference.report import atomic_write  # noqa: E402
from draftkit.target import cpu_flags, load_target  # noqa: E402
from draftkit.train.distributed import Dist  # noqa: E402

DEFAULT_PROMPTS = ROOT / "benchmarks" / "results" / "specbench_dev60.jsonl"
POOLED = "all prompts"
HELD = "held-aside (recipe)"
ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def draft_vocab(args, recipe, target) -> tuple[torch.Tensor, str, object]:
    """(t2d (V,) bool, where it came from, the Prepared data it was chosen from or None)."""
    from draftkit.distill.prepare import load_prepared, trained_on
    from draftkit.heads import load_head

    if args.head:
        return load_head(args.head, target).t2d.cpu(), f"head {args.head}", None
    size = args.size or recipe.head.get("draft_vocab_size")
    if not size:
        sys.exit("head.draft_vocab_size is not set in the recipe: pass --size N (or --head DIR)")
    out = Path(args.prepared).expanduser() if args.prepared else trained_on(
        recipe, target, recipe.samples_needed(recipe.train.micro_batch_size * recipe.train.grad_accum))
    if out is None:
        sys.exit(f"the recipe's prepared data is not in the cache: run `draftkit prepare {args.recipe} "
                 f"{' '.join(args.overrides)}` first, or pass --prepared DIR / --head DIR")
    data = load_prepared(out)
    train = spread(data.train, args.samples)
    _, t2d = build_draft_vocab(size, target.vocab_size, counts=sample_counts(train, target.vocab_size))
    return t2d, f"the {size} most frequent loss tokens of {len(train)} training samples of {out}", data


def spread(samples: list, n: int | None) -> list:
    """n of the samples, evenly spaced (prepared samples are in prompt order, part after part of the
    mixture: each part keeps its share), or all of them: mixtures compared at equal size."""
    if n is None or n >= len(samples):
        return samples
    return [samples[i * len(samples) // n] for i in range(n)]


def continuations(recipe, target, path: str, max_new_tokens: int) -> list:
    """The target's greedy answer to every prompt of `path` (cached like training responses)."""
    from draftkit.distill.prepare import data_context
    from draftkit.distill.regenerate import regenerate
    from draftkit.distill.sources import load_prompts

    prompts = load_prompts([PromptSource(path)], limit=None, seed=0)
    settings = dataclasses.replace(recipe.data.responses, mode="regenerate", temperature=0.0,
                                   max_new_tokens=max_new_tokens)
    return regenerate(data_context(recipe, target, ONE), prompts, settings)


def by_category(tokenizer, convs: list, t2d: torch.Tensor) -> dict[str, dict]:
    """heads/vocab.coverage of each category's response tokens (tokenized as training samples), and pooled."""
    from draftkit.distill.samples import tokenize_conversation

    groups: dict[str, list[dict]] = {}
    for c in convs:
        sample = tokenize_conversation(tokenizer, c, "response")
        if sample is not None:
            groups.setdefault(c.prompt.category or "uncategorized", []).append(sample)
    groups[POOLED] = [s for g in list(groups.values()) for s in g]
    return {name: {"prompts": len(s), **coverage(t2d, sample_counts(s, t2d.numel()))} for name, s in groups.items()}


def print_table(res: dict) -> None:
    print(f"draft vocabulary: {res['vocab']} ({res['vocab_size']} tokens)")
    print(f"{'group':<22}{'prompts':>8}{'tokens':>9}{'inside':>9}{'outside':>9}")
    for name, g in res["groups"].items():
        out = "n/a" if g["inside_fraction"] is None else f"{1 - g['inside_fraction']:.3f}"
        inside = "n/a" if g["inside_fraction"] is None else f"{g['inside_fraction']:.3f}"
        print(f"{name:<22}{g['prompts']:>8}{g['tokens']:>9}{inside:>9}{out:>9}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="the recipe whose target, data settings and prepared data to use")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides of the recipe")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompt file (default: the Spec-Bench dev60)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="continuation length (acceptance_gap: 128)")
    ap.add_argument("--head", help="measure this trained head's draft vocabulary instead of choosing one")
    ap.add_argument("--prepared", help="the prepared directory to choose the vocabulary from (default: the recipe's)")
    ap.add_argument("--size", type=int, help="vocabulary size (default: the recipe's head.draft_vocab_size)")
    ap.add_argument("--samples", type=int, help="choose the vocabulary from this many training samples, evenly "
                                                "spaced (default: all, as the trainer): data sets at equal size")
    ap.add_argument("--out", help="write the figures as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    t = recipe.target
    target = load_target(t.path, gguf_file=t.gguf_file, dtype=t.dtype, trust_remote_code=t.trust_remote_code)
    t0 = time.perf_counter()
    t2d, where, data = draft_vocab(args, recipe, target)
    groups = by_category(target.tokenizer, continuations(recipe, target, args.prompts, args.max_new_tokens), t2d)
    if data is not None and data.holdout_samples:
        groups[HELD] = {"prompts": len(data.holdout_samples),
                        **coverage(t2d, sample_counts(data.holdout_samples, target.vocab_size))}
    res = {"what": "share of the target's greedy continuation tokens inside a draft vocabulary",
           "command": " ".join(sys.argv), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "vocab": where, "vocab_size": int(t2d.sum()), "target_dtype": str(target.dtype).removeprefix("torch."),
           "cpu_flags": cpu_flags(), "seconds": round(time.perf_counter() - t0, 1), "groups": groups}
    print_table(res)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(args.out), json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
