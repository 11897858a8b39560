"""Held-aside top-1 agreement of exported heads on ONE recipe's held-aside samples.

    python benchmarks/heldout_agreement.py --recipe recipes/eagle.yaml --heads runs/a/head runs/b/head
    python benchmarks/heldout_agreement.py --recipe recipes/eagle.yaml data.num_prompts=2500 --heads ...

The trainer's held-aside top-1 is measured on each run's own held-aside samples: a head trained on
ShareGPT's kept replies is scored on ShareGPT's text, one trained on the target's regenerated
responses on the target's text, so the two figures are not comparable. This scores every head on
the same samples (the recipe's held-aside prompts with the target's responses; stage 1 of that
recipe must be finished: `draftkit prepare RECIPE [overrides]`), with the trainer's own loss
(`head.loss`: top-1 of the head against the target's next token, positions in the loss mask),
features computed online by the recipe's target, under the recipe's autocast (the trainer's own
heldout_sums). Writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftkit.config import load_recipe
from draftkit.distill.prepare import finished, load_prepared
from draftkit.heads.base import load_head
from draftkit.target import load_target
from draftkit.train.data import FeatureStore
from draftkit.train.deepspeed_config import head_autocast
from draftkit.train.loop import TrainWrapper, heldout_sums


def agreement(head, samples: list[dict], target, pad_id: int, autocast, micro: int) -> dict:
    store = FeatureStore(target, head.feature_layers, None)  # online: the target computes them
    model = TrainWrapper(head.eval(), autocast)
    loss, acc, tokens = heldout_sums(lambda chunk: model(store.batch(chunk, pad_id)), samples, micro).tolist()
    return {"heldout_acc": acc / tokens, "heldout_loss": loss / tokens, "positions": int(tokens)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value), as given to the training run")
    p.add_argument("--heads", nargs="+", required=True, help="exported head directories")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    recipe = load_recipe(a.recipe, a.overrides)
    t = recipe.target
    target = load_target(t.path, gguf_file=t.gguf_file, dtype=t.dtype, trust_remote_code=t.trust_remote_code)
    micro = recipe.train.micro_batch_size
    out = finished(recipe, target, recipe.samples_needed(micro))
    if out is None:
        sys.exit(f"{a.recipe}: stage 1 is not finished for these settings; run `draftkit prepare {a.recipe} "
                 f"{' '.join(a.overrides)}` first")
    samples = load_prepared(out).holdout_samples
    pad_id = target.tokenizer.pad_token_id or 0
    autocast = head_autocast(recipe.train, torch.device("cpu"))
    rows = []
    print(f"{len(samples)} held-aside samples of {a.recipe} {' '.join(a.overrides)} ({out})")
    print(f"{'head':<48} {'top-1':>7} {'loss':>7} {'positions':>9}")
    for directory in a.heads:
        head = load_head(directory, target)
        row = {"head": directory, **agreement(head, samples, target, pad_id, autocast, micro)}
        rows.append(row)
        print(f"{directory:<48} {row['heldout_acc']:>7.3f} {row['heldout_loss']:>7.3f} {row['positions']:>9}")
    if a.out:
        Path(a.out).write_text(json.dumps({"recipe": a.recipe, "overrides": a.overrides, "prepared": str(out),
                                           "samples": len(samples), "heads": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
