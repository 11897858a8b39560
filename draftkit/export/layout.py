"""A `Layout`: how one head family is laid out for one engine, the registry of them, and the tensor
tools layouts are written with (renaming, shape checks, dropping what an engine lacks).

A `Layout` says:
  names        (native prefix, engine prefix) pairs; `{i}` stands for an index. Every tensor of the
               head must match exactly one row, else the export fails naming it (it would be lost).
  config_out   native config -> the engine's config.json (only fields that engine's loader reads).
  config_in    the engine's config.json -> native config fields (architecture only).
  expected     engine config -> {tensor name: shape}: the parameters the engine's module builds
               from that config, read off its loader source. An export must produce exactly these:
               a missing one stays randomly initialised in the engine, an extra one is silently
               skipped (SGLang) or renamed into nothing (vLLM).
  tensors_out / tensors_in   hooks for tensors that are not plain renames (biases the engine
               lacks, d2t conventions, shared embeddings the engine needs stored, ...).
The engine modules (vllm.py, sglang.py, speculators.py, official.py) each `register` their tables;
the package's __init__ imports them, so every table is in LAYOUTS once `draftkit.export` is imported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

Shapes = dict[str, tuple[int, ...]]
FORMATS = ("draftkit", "vllm", "sglang", "speculators")
IMPORT_ONLY = ("eagle-official", "eagle3-official", "medusa-official")


class ExportError(ValueError):
    """An export or import that would not load faithfully; the message names the tensor or field."""


class TargetNeeded(ExportError):
    """A layout needs the target (a tensor it shares with the head) and none was given: `why` says
    what for. `draftkit inspect` then takes the given or the recorded target (export/cli_inspect.py)."""

    def __init__(self, why: str):
        super().__init__(f"{why}: pass --target MODEL (the target the head was trained against)")
        self.why = why


@dataclass
class Context:
    """What a layout may need beyond the head: the target (for shared tensors) and the native config."""

    native: dict[str, Any]  # full native config.json (family fields, target info, recipe_hash)
    target: Any = None  # draftkit.target.Target | None
    contract: dict[str, Any] | None = None  # on import: the contract found in the directory
    verifier: dict[str, Any] | None = None  # on export: the verifier it names (export/verifier.py)

    def table(self, layout: "Layout") -> tuple:
        return layout.names(self.native) if callable(layout.names) else layout.names

    def need_target(self, why: str):
        """The target; on export without one, the head's recorded target, loaded from the verifier
        the export names when that is a local model directory whose fingerprint was checked."""
        if self.target is None and self.verifier is not None:
            self.target = recorded_target(self.verifier, why)
        if self.target is None:
            raise TargetNeeded(why)
        return self.target


def recorded_target(verifier: dict, why: str):
    """Load the verifier an export names (export/verifier.py) as the target: only a local directory
    checked against the head's fingerprint; anything else is an error naming what is missing."""
    import logging
    from pathlib import Path

    name = verifier.get("name_or_path")
    if not (verifier.get("checked") and name and Path(name).is_dir()):
        state = ("its fingerprint could not be checked" if name and Path(name).is_dir() else
                 "it is not a local model directory" + (f" ({verifier['note']})" if verifier.get("note") else ""))
        raise ExportError(f"{why}: the head's recorded target {name!r} cannot be used: {state}; pass --target MODEL "
                          "(the target the head was trained against)")
    from draftkit.target import Target, _load_shell

    logging.getLogger(__name__).warning("note: %s: loading the head's recorded target %s (fingerprint %s checked)",
                                        why, name, verifier.get("fingerprint"))
    model, config = _load_shell(name, {"dtype": torch.float32})  # embeddings, final norm, lm_head: what exports read
    return Target(model, None, name=name, config=config)


def _identity_tensors(state: dict[str, Tensor], ctx: Context) -> dict[str, Tensor]:
    return state


@dataclass(frozen=True)
class Layout:
    format: str
    family: str
    source: str  # the engine file this layout follows
    names: tuple[tuple[str, str], ...] | Callable[[dict], tuple]  # callable: of the native config
    config_out: Callable[[dict, Context], dict]
    config_in: Callable[[dict, Context], dict]
    expected: Callable[[dict], Shapes]
    # Tensors the engine's loader accepts but does not use (e.g. a stored copy of the shared
    # embedding); allowed on import, where tensors_in must consume (check and drop) them.
    optional: Callable[[dict], Shapes] = lambda c: {}
    tensors_out: Callable[[dict, Context], dict] = _identity_tensors  # native names, before renaming
    tensors_in: Callable[[dict, Context], dict] = _identity_tensors  # native names, after renaming
    # Files beside the weights the engine reads (name -> bytes), from the native tensors (DFlash's
    # mask_embedding.pt); written into the same atomic directory.
    files_out: Callable[[dict, Context], dict[str, bytes]] = lambda state, ctx: {}
    # Contract location: inside config.json when the engine's config class ignores unknown keys.
    sidecar: bool = False
    # The feature-layer convention of the ids this layout writes (see contract.py).
    layer_ids_out: Callable[[list[int]], list[int]] = list
    layer_ids_in: Callable[[list[int]], list[int]] = list
    layer_convention: str | None = None  # None = the draftkit convention (draftkit.target)
    d2t_convention: str | None = None  # None = as the native head (contract.native_d2t_convention)
    weights_file: str = "model.safetensors"


LAYOUTS: dict[tuple[str, str], Layout] = {}
REFUSALS: dict[tuple[str, str], str] = {}  # (format, family) -> why that engine cannot carry it


def register(layout: Layout) -> Layout:
    LAYOUTS[(layout.format, layout.family)] = layout
    return layout


def refuse(fmt: str, family: str, why: str) -> None:
    REFUSALS[(fmt, family)] = why


# (format, family, target model_type) -> why that engine cannot serve the head for that target
TARGET_REFUSALS: dict[tuple[str, str, str], str] = {}


def refuse_target(fmt: str, families: tuple[str, ...], model_types: tuple[str, ...], why: str) -> None:
    for family in families:
        for model_type in model_types:
            TARGET_REFUSALS[(fmt, family, model_type)] = why


def check_target_architecture(fmt: str, native: dict) -> None:
    """Refuse an export whose engine would serve the head wrongly for the target it was trained on."""
    t = native.get("target") or {}
    why = TARGET_REFUSALS.get((fmt, native["family"], t.get("model_type")))
    if why:
        raise ExportError(f"format {fmt!r} cannot serve this '{native['family']}' head for its target "
                          f"{t.get('name')} (model_type {t.get('model_type')}): {why}. The draftkit format "
                          "keeps it (draftkit eval runs it)")


def layout_for(fmt: str, family: str) -> Layout:
    """The registered layout of (format, family), or an ExportError saying why there is none and
    which formats can carry the family (the engine modules register when draftkit.export is imported)."""
    if fmt not in FORMATS + IMPORT_ONLY:
        raise ExportError(f"unknown format {fmt!r}; known: {', '.join(FORMATS + IMPORT_ONLY)}")
    if (fmt, family) in LAYOUTS:
        return LAYOUTS[(fmt, family)]
    why = REFUSALS.get((fmt, family), f"no {fmt} layout for the '{family}' family")
    can = sorted(f for (f, fam) in LAYOUTS if fam == family and f in FORMATS)
    raise ExportError(f"format {fmt!r} cannot carry a '{family}' head: {why}"
                      + (f" (formats that can: {', '.join(can)})" if can else ""))


# ---- renaming ----------------------------------------------------------------------------------

def _prefix_regex(prefix: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)"))


def rename(state: dict[str, Tensor], table: tuple[tuple[str, str], ...], reverse: bool, where: str,
           keep: set[str] | frozenset = frozenset()) -> dict[str, Tensor]:
    """Rename every tensor through the table; a tensor no row matches is an error naming it.
    Names in `keep` (optional tensors a layout's tensors_in consumes) pass through unchanged."""
    rows = [(b, a) if reverse else (a, b) for a, b in table]
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name in keep:
            out[name] = t
            continue
        for src, dst in rows:
            m = _prefix_regex(src).match(name)
            if m:
                new = dst.format(**{k: int(v) for k, v in m.groupdict().items()}) + name[m.end():]
                break
        else:
            raise ExportError(f"{where}: tensor '{name}' has no place in this layout (it would be lost)")
        if new in out:
            raise ExportError(f"{where}: tensors map onto the same name '{new}'")
        out[new] = t
    return out


def table_matches(name: str, table, reverse: bool) -> bool:
    """Whether some row of the table (its engine side when reverse) takes the tensor `name`."""
    return any(_prefix_regex(b if reverse else a).match(name) for a, b in table)


def check_tensors(tensors: dict[str, Tensor], expected: Shapes, where: str, optional: Shapes | None = None) -> None:
    """Exactly the expected names (plus any optional ones), with the expected shapes."""
    optional = optional or {}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - set(optional))
    expected = {**optional, **expected}
    if missing:
        raise ExportError(f"{where}: missing tensor(s) {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} (the engine would leave them uninitialised)")
    if extra:
        raise ExportError(f"{where}: tensor(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} "
                          "are not read by the engine's loader (they would be ignored)")
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != tuple(shape):
            raise ExportError(f"{where}: tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                              f"the config says {tuple(shape)}")



# ---- tensors an engine has no place for -------------------------------------------------------

def zero_bias_dropped(state: dict, name: str, where: str, hint: str) -> dict:
    """Drop a bias the engine's module does not have; only an all-zero one can go without loss."""
    if name in state:
        if torch.count_nonzero(state[name]):
            raise ExportError(f"{where}: the engine's module has no '{name}' and would drop this trained, "
                              f"non-zero tensor; {hint}")
        state = {k: v for k, v in state.items() if k != name}
    return state


def check_shared(state: dict, name: str, target_weight, ctx: Context) -> dict:
    """A stored copy of a shared target tensor must equal the target's; then it is dropped."""
    if name in state:
        t = ctx.need_target(f"{name} is stored: checking it")
        if not torch.equal(state[name].to(target_weight.dtype), target_weight.detach().cpu()):
            raise ExportError(f"{name}: the stored copy differs from target {t.name}'s; this head was "
                              "trained against another target (or another revision of it)")
        state = {k: v for k, v in state.items() if k != name}
    return state
