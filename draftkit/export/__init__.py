"""Serving formats (vLLM, SGLang, speculators) for trained heads, checked at export, and imports back.

    export_head(HEAD_DIR, "vllm", OUT)           native -> engine layout + contract
    import_head(DIR, "sglang", OUT, target=...)   engine / published layout -> native

Each (format, family) is a small table (a `Layout`, export/layout.py) in vllm.py / sglang.py / dflash.py /
speculators.py / official.py, which share the llama / EAGLE-3 parts in llama_drafts.py. Importing
the package registers them all; formats.py runs them.
"""
from draftkit.export import dflash, official, sglang, speculators, vllm  # noqa: F401  (each registers its layouts)
from draftkit.export.formats import ExportError, detect_format, export_head, import_head, layout_for
from draftkit.export.layout import FORMATS, IMPORT_ONLY

__all__ = ["FORMATS", "IMPORT_ONLY", "ExportError", "detect_format", "export_head", "import_head", "layout_for"]
