"""Serving formats (vLLM, SGLang, speculators) for trained heads, checked at export, and imports back.

    export_head(HEAD_DIR, "vllm", OUT)           native -> engine layout + contract
    import_head(DIR, "sglang", OUT, target=...)   engine / published layout -> native
Each (format, family) is a small table in vllm.py / sglang.py / speculators.py / official.py.
"""
from draftkit.export.formats import (FORMATS, IMPORT_ONLY, ExportError, detect_format, export_head, import_head,
                                     layout_for)

__all__ = ["FORMATS", "IMPORT_ONLY", "ExportError", "detect_format", "export_head", "import_head", "layout_for"]
