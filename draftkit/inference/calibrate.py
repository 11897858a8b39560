"""Calibration for `draftkit eval --draft auto|calibrate`: measure this machine's verify, draft and
plain-decoding cost and trace the head on a few prompts at the requested temperatures, and choose
the draft shape from them (the cost model itself is draftkit/inference/cost.py). It prints the
choice with its predicted tau and speedup in one line (plain decoding when no shape pays, with
the measured costs that say why), a warning for every inconsistency in the profile, and a progress
bar with an ETA while it measures; `--calibration-budget` bounds its time.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from draftkit.inference.cost import MIN_TRACE_TOKENS, Calibration, SearchSpace, auto_draft, format_choice
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.evaluate import EvalPrompt, EvalSettings, _prepare

MAX_CALIBRATION_TOKENS = 64
# How many prompts `draftkit eval --draft auto` traces when --calibration-prompts is not given. A lookup
# chain's tau depends on which prompts calibrate more than on the model: with 4 Spec-Bench prompts the
# cost model held its 10% goal on 7 of 8 shapes (lookup 10 at T = 0: tau 1.34 predicted, 1.59 measured),
# with 16 on 8 of 8 (benchmarks/results/cost_model_accuracy_amx_bf16_eaglemix_calib{4,16}.json). The
# budget (--calibration-budget) still bounds the time: more prompts means shorter traces, not a longer wait.
CALIBRATION_PROMPTS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Calibration's flags on `draftkit eval` (cli_eval.py calls this)."""
    p.add_argument("--calibration-budget", type=float, default=None, metavar="SECONDS",
                   help="auto/calibrate: seconds the measuring may take: fewer measuring rounds, shorter traces and "
                        "then fewer prompts when over (default 120 on CPU, 60 on GPU, where every prompt is still "
                        f"traced for at least {MIN_TRACE_TOKENS} tokens, however long that takes)")


def calibration_prompts(items: list[dict], n: int, skip: set | None = None) -> list[list[int]]:
    """The token ids of calibration_items(items, n, skip)."""
    return [it["ids"] for it in calibration_items(items, n, skip)]


def calibration_items(items: list[dict], n: int, skip: set | None = None) -> list[dict]:
    """n of the items (dicts with "ids" and "category"), taken in turn from each category (the
    list's order within one; all one category when the prompts have none) and spread over each
    category's prompts, so that the profile sees the mix the evaluation will see. `skip`: id
    tuples not to take."""
    by_cat: dict[str, list[dict]] = {}
    for it in items:
        if skip is None or tuple(it["ids"]) not in skip:
            by_cat.setdefault(it["category"], []).append(it)
    cats = list(by_cat.values())
    counts = [n // len(cats) + (i < n % len(cats)) for i in range(len(cats))]
    picks = []
    for j in range(max(counts, default=0)):  # round j: the j-th pick of every category that has one
        for c, k in zip(cats, counts):
            m = min(k, len(c))  # a category smaller than its share gives each of its prompts once
            if j < m:
                picks.append(c[j * len(c) // m])
    return picks


def calibrate(target, head, prompts: list[EvalPrompt], settings: EvalSettings, n: int,
              budget_s: float | None = None, progress: bool = True,
              space: SearchSpace | None = None) -> tuple[DraftSettings, Calibration]:
    """--draft auto on a head without a `draft:` section (or --draft calibrate): measure on n
    prompts spread over the list at settings' temperatures, choose the draft shape within the
    head's limits and `space` (the fields the user fixed: only shapes with them are measured, so
    the printed prediction is the returned shape's), print it with its prediction, and return it with
    the Calibration it came from (its ranked rows give SGLang's tree: export/serving.py). Prompts
    of two or more categories also get the best shape per category, reported beside the choice.
    A failure (a bad head, a setting the head cannot draft) is raised as a SpecError naming
    calibration, for eval's error path."""
    from draftkit.heads.base import HeadError
    from draftkit.inference.errors import SpecError

    try:
        items, _ = _prepare(target, prompts, 16, settings.max_new_tokens)
        picked = calibration_items(items, n)
        if not picked:
            raise SpecError("calibration: no prompt fits the context")
        calib = [it["ids"] for it in picked]
        chosen, cal = auto_draft(target, head, calib, settings.draft, categories=[it["category"] for it in picked],
                               temperatures=settings.temperatures, top_k=settings.top_k, top_p=settings.top_p,
                               max_new_tokens=min(MAX_CALIBRATION_TOKENS, settings.max_new_tokens),
                               run_tokens=settings.max_new_tokens, budget_s=budget_s, seed=settings.seed,
                               progress=progress, space=space)
    except HeadError as e:
        raise SpecError(f"calibration: {e}") from e
    print(format_choice(chosen), file=sys.stderr, flush=True)
    return replace(chosen, measured={**chosen.measured, "calibration_prompts": len(calib)}), cal
