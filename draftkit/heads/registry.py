"""Head families by name. Each family lives in its own module and is imported on first use."""
from __future__ import annotations

import importlib

from draftkit.heads.base import DraftHead, HeadError

FAMILIES: dict[str, str] = {
    "eagle": "draftkit.heads.eagle:EagleHead",
    "eagle3": "draftkit.heads.eagle3:Eagle3Head",
    "medusa": "draftkit.heads.medusa:MedusaHead",
    "mtp": "draftkit.heads.mtp:MTPHead",
    "dflash": "draftkit.heads.dflash:DFlashHead",
}


def head_class(family: str) -> type[DraftHead]:
    if family not in FAMILIES:
        raise HeadError(f"head.type: unknown head family {family!r}; known: {', '.join(FAMILIES)}")
    module, name = FAMILIES[family].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        raise HeadError(f"head.type: family {family!r} is not available ({e})") from e


def build_head(settings: dict, target) -> DraftHead:
    """A fresh head from a recipe's `head` mapping ({type: ..., family fields}), sized to `target`."""
    settings = dict(settings)
    return head_class(settings.get("type", "")).for_target(settings, target)
