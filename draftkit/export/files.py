"""Head directories on disk: safetensors (or published torch pickles) + config.json read and
written atomically, the draftkit contract found in them, and the native draftkit head checked
against its own config.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from draftkit.export.layout import ExportError
from draftkit.heads.base import HEAD_FORMAT_VERSION, HeadError, check_state_dict, read_head_config, replace_dir
from draftkit.heads.registry import head_class

CONTRACT_KEY = "draftkit_contract"


def read_tensors(path: Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file; a corrupt or truncated file is an error naming it."""
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ExportError(f"{path}: not a readable safetensors file (corrupt or truncated?): {e}") from e


def read_dir(directory: Path) -> tuple[dict, dict[str, Tensor]]:
    directory = Path(directory)
    try:
        cfg = read_head_config(directory)
    except HeadError as e:
        raise ExportError(str(e)) from e
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(directory.glob("*.bin")) + sorted(directory.glob("*.pt"))
        if bins:
            return cfg, _read_torch_pickles(bins)
        raise ExportError(f"{directory}: no *.safetensors file")
    tensors: dict[str, Tensor] = {}
    for f in files:
        tensors.update(read_tensors(f))
    return cfg, tensors


def _read_torch_pickles(files: list[Path]) -> dict[str, Tensor]:
    """Published heads that predate safetensors (EAGLE-1, Medusa-1): weights only, never code."""
    out: dict[str, Tensor] = {}
    for f in files:
        try:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # a truncated zip raises several types
            raise ExportError(f"{f}: cannot read torch weights ({e})") from e
    return out


def write_dir(out: Path, config: dict, tensors: dict[str, Tensor], overwrite: bool, *,
              sidecar: dict | None = None, weights_file: str = "model.safetensors",
              metadata: dict | None = None, files: dict[str, bytes] | None = None) -> Path:
    """Write atomically: build in a temp dir beside `out`, then swap it in (never half-written)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / weights_file,
                  metadata={"format": "pt", **(metadata or {})})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        if sidecar is not None:
            (tmp / "draftkit.json").write_text(json.dumps(sidecar, indent=2, default=str) + "\n")
        for name, data in (files or {}).items():  # a layout's extra files (Layout.files_out)
            (tmp / name).write_bytes(data)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def dtype_name(tensors: dict[str, Tensor]) -> str:
    kinds = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else ("mixed:" + ",".join(sorted(kinds)) if kinds else "none")


# ---- the native head -----------------------------------------------------------------------------

def read_native(directory: Path) -> tuple[dict, dict[str, Tensor]]:
    """A native head directory, checked: its config builds a head whose tensors are exactly these."""
    cfg, tensors = read_dir(directory)
    family = cfg.get("family")
    if family is None:
        raise ExportError(f"{directory}/config.json: no 'family' field: not a native draftkit head "
                          "(convert it first: draftkit import DIR --format ...)")
    check_native(cfg, tensors, str(directory))
    return cfg, tensors


def native_config(family: str, cfg: dict, where: str):
    cls = head_class(family)
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    try:
        return cls.config_from_dict({k: v for k, v in cfg.items() if k in fields}, "config")
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from e


def check_native(cfg: dict, tensors: dict[str, Tensor], where: str) -> None:
    config = native_config(cfg["family"], cfg, where)
    with torch.device("meta"):
        head = head_class(cfg["family"])(config)
    try:
        check_state_dict(head, tensors, where)
    except HeadError as e:
        raise ExportError(str(e)) from e


def native_out(cfg: dict, tensors: dict[str, Tensor]) -> dict:
    """The native config.json as save_pretrained writes it (family first, then the fields)."""
    return {"draftkit_format": HEAD_FORMAT_VERSION, "family": cfg["family"],
            **{k: v for k, v in cfg.items() if k not in ("draftkit_format", "family")}}


def find_contract(directory: Path, cfg: dict) -> dict | None:
    if isinstance(cfg.get(CONTRACT_KEY), dict):
        return cfg[CONTRACT_KEY]
    side = Path(directory) / "draftkit.json"
    if side.is_file():
        try:
            return json.loads(side.read_text())
        except json.JSONDecodeError as e:
            raise ExportError(f"{side}: not valid JSON: {e}") from e
    return None
