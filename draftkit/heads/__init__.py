"""Draft heads: one module per family behind one interface (base.DraftHead)."""
from draftkit.heads.base import DraftHead, HeadConfig, HeadError, SharedModules, load_head
from draftkit.heads.registry import FAMILIES, build_head, head_class

__all__ = ["DraftHead", "HeadConfig", "HeadError", "SharedModules", "load_head", "FAMILIES",
           "build_head", "head_class"]
