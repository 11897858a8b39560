"""Calibration for `draftkit eval --draft auto|calibrate`: measure this machine's verify and draft
cost and the head's acceptance profile on a few prompts, and choose the draft shape from them
(the cost model itself is draftkit/inference/cost.py)."""
from __future__ import annotations

import sys

from draftkit.inference.cost import auto_draft, format_choice
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.evaluate import EvalPrompt, EvalSettings, _prepare


def calibrate(target, head, prompts: list[EvalPrompt], settings: EvalSettings, n: int) -> DraftSettings:
    """--draft auto on a head without a `draft:` section (or --draft calibrate): measure on the
    first n prompts, choose the draft shape, print why, and return it."""

    items, _ = _prepare(target, prompts, 16, settings.max_new_tokens)
    calib = [it["ids"] for it in items[:: max(1, len(items) // max(n, 1))][:n]]
    print(f"draft auto: measuring verify/draft cost and the acceptance profile on {len(calib)} prompts ...",
          file=sys.stderr, flush=True)
    chosen, _ = auto_draft(target, head, calib, settings.draft, max_new_tokens=min(48, settings.max_new_tokens))
    print(format_choice(chosen), file=sys.stderr, flush=True)
    return chosen
