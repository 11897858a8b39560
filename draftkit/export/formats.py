"""Export and import: a native head -> an engine's layout, checked and with its contract, and back.

    export_head(HEAD_DIR, "vllm", OUT)           native -> engine layout + contract
    import_head(DIR, "sglang", OUT, target=...)   engine / published layout -> native

Both run one `Layout` (export/layout.py: what a layout says, the registry, renaming and checks),
found with `layout_for(format, family)`; the tables are the engine modules' (vllm.py, sglang.py,
speculators.py, official.py, sharing llama_drafts.py), registered when `draftkit.export` is imported.
Directories are read and written by export/files.py; the contract a directory carries is contract.py's.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from torch import Tensor

from draftkit.export.contract import check_target, make_contract, native_from_contract
from draftkit.export.files import (CONTRACT_KEY, check_native, dtype_name, find_contract, native_out, read_dir,
                                   read_native, write_dir)
from draftkit.export.layout import (IMPORT_ONLY, Context, ExportError, Layout, check_target_architecture, check_tensors,
                                    layout_for, rename, table_matches)
from draftkit.export.verifier import VerifierError, resolve_verifier
from draftkit.target import DTYPES


log = logging.getLogger(__name__)

DRAFT_VOCAB_DROPPED = "dropped: engine drafts over the full target vocabulary"
# Formats whose EAGLE-1 has no draft vocabulary at all, so a draft-vocabulary head is expanded to the
# full vocabulary by default (with a note): vLLM's llama_eagle.py has no d2t / hot-token map. SGLang's
# EAGLE-1 takes a --speculative-token-map instead, so there the choice stays the user's (--full-vocab).
FULL_VOCAB_BY_DEFAULT = ("vllm",)


def drop_draft_vocab(native: dict, state: dict[str, Tensor], layout: Layout, full_vocab: bool | None,
                     where: str) -> tuple[dict, dict[str, Tensor], str]:
    """A head with a draft vocabulary (d2t / t2d) for a layout that has no place for one: refused,
    or with full_vocab the head is exported as drafting over the full target vocabulary (its native
    config says draft_vocab_size None, so an import gives back the head the engine runs); the note
    for the contract comes third. full_vocab None: True for FULL_VOCAB_BY_DEFAULT (logged), else refused."""
    n = native.get("draft_vocab_size")
    if full_vocab is None and layout.format in FULL_VOCAB_BY_DEFAULT:
        full_vocab = True
        log.warning("note: %s: the head drafts over a reduced vocabulary (draft_vocab_size=%s) but %s has no d2t: "
                    "exported drafting over the full target vocabulary (the target's lm_head; the contract records "
                    "it as draft_vocab)", where, n, layout.source)
    if not full_vocab:
        raise ExportError(f"{where}: the head drafts over a reduced vocabulary (draft_vocab_size={n}, tensors "
                          f"d2t / t2d) but {layout.source} has no draft-vocabulary support: the engine would "
                          "draft over the full target vocabulary with the target's lm_head, and d2t would be "
                          "lost. Pass --full-vocab (full_vocab=True) to export it that way, or keep "
                          "--format draftkit")
    state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    return {**native, "draft_vocab_size": None}, state, f"{DRAFT_VOCAB_DROPPED} (trained with draft_vocab_size={n})"


def export_head(head_dir: str | Path, fmt: str, out: str | Path, *, target=None, overwrite: bool = False,
                dtype: str | None = None, full_vocab: bool | None = None, verifier: str | None = None) -> Path:
    """Convert a native head directory into `fmt` at `out`, checked against the engine's layout.

    full_vocab: for a head with a draft vocabulary (d2t) and an engine layout without one, export
    it drafting over the full target vocabulary (recorded in the contract) instead of refusing;
    None (default): so for vLLM, whose EAGLE-1 has no d2t at all (a note is logged), refused elsewhere.
    verifier: the model directory or hub id the export names as the head's verifier (default: the
    target it was trained on, export/verifier.py), checked against the head's target fingerprint.
    target: None = loaded from the verifier only if a layout needs a tensor the head shares with
    the target (Context.need_target)."""
    native, state = read_native(Path(head_dir))
    family = native["family"]
    if fmt == "draftkit":
        layout = None
    else:
        layout = layout_for(fmt, family)
        check_target_architecture(fmt, native)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ExportError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    if target is not None:
        problems = check_target(native, target)
        if problems:
            raise ExportError(f"{head_dir}: does not fit target {target.name}: " + "; ".join(problems))
    where = f"{fmt} export of {family} head {head_dir}"
    try:
        named = resolve_verifier(native, verifier)
    except VerifierError as e:
        raise ExportError(f"{head_dir}: {e}") from e
    if layout is None:
        contract = {**make_contract(native, state, "draftkit", None), "verifier": named}
        return write_dir(Path(out), {**native_out(native, state), CONTRACT_KEY: contract}, state, overwrite,
                         metadata={"draftkit_family": family})
    ctx = Context(native=native, target=target, verifier=named)
    if fmt == "vllm" and target is not None:
        from draftkit.export.vllm import window_note  # vllm.py registers layouts and imports this module
        note = window_note(target, family)
        if note:
            log.warning("note: %s: %s", where, note)
    dropped = None
    if "d2t" in state and not table_matches("d2t", ctx.table(layout), reverse=False):
        native, state, dropped = drop_draft_vocab(native, state, layout, full_vocab, where)
        ctx.native = native
    files = layout.files_out(state, ctx)
    tensors = rename(layout.tensors_out(dict(state), ctx), ctx.table(layout), reverse=False, where=where)
    config = layout.config_out(native, ctx)
    config.setdefault("torch_dtype", dtype_name(tensors))
    check_tensors(tensors, layout.expected(config), where)
    contract = {**make_contract(native, tensors, fmt, layout), "verifier": named}
    if dropped:
        contract["draft_vocab"] = dropped
    if layout.sidecar:
        return write_dir(Path(out), config, tensors, overwrite, sidecar=contract, weights_file=layout.weights_file,
                         files=files)
    return write_dir(Path(out), {**config, CONTRACT_KEY: contract}, tensors, overwrite,
                     weights_file=layout.weights_file, files=files)


def import_head(src: str | Path, fmt: str, out: str | Path, *, target=None, overwrite: bool = False,
                family: str | None = None) -> Path:
    """Convert a directory in `fmt` (an export of ours, or a published head) into a native head."""
    native, state = to_native(src, fmt, target=target, family=family)
    return write_dir(Path(out), native_out(native, state), state, overwrite,
                     metadata={"draftkit_family": native["family"]})


def to_native(src: str | Path, fmt: str, *, target=None, family: str | None = None) -> tuple[dict, dict[str, Tensor]]:
    """Read `src` in `fmt` and convert it in memory into (native config, native tensors), checked."""
    src = Path(src)
    cfg, tensors = read_dir(src)
    contract = find_contract(src, cfg)
    if fmt == "draftkit":
        native = {k: v for k, v in cfg.items() if k != CONTRACT_KEY}
        if "family" not in native:
            raise ExportError(f"{src}/config.json: no 'family' field; pick the --format it is in")
        check_native(native, tensors, str(src))
        state = tensors
    else:
        family = family or (contract or {}).get("family") or detect_family(fmt, cfg)
        layout = layout_for(fmt, family)
        where = f"{fmt} import of {src}"
        if fmt in IMPORT_ONLY and target is not None:  # published heads: the target fills the dims
            cfg.setdefault("hidden_size", target.hidden_size)
            cfg.setdefault("vocab_size", target.vocab_size)
        check_tensors(tensors, layout.expected(cfg), where, layout.optional(cfg))
        ctx = Context(native=native_from_contract(contract, family), target=target, contract=contract)
        arch = layout.config_in(cfg, ctx)
        ctx.native = merge_native(family, arch, ctx, where)
        table = ctx.table(layout)
        keep = {n for n in layout.optional(cfg) if n in tensors and not table_matches(n, table, reverse=True)}
        state = layout.tensors_in(rename(tensors, table, reverse=True, where=where, keep=keep), ctx)
        native = ctx.native  # tensors_in may settle fields the config cannot say (a bias, a vocab map)
        check_native(native, state, where)
    if target is not None:
        problems = check_target(native, target)
        if problems:
            raise ExportError(f"{src}: does not fit target {target.name}: " + "; ".join(problems))
    return native, state


def merge_native(family: str, arch: dict, ctx: Context, where: str) -> dict:
    """Native config = the contract's (training fields, target info) + the architecture read from
    the engine config. Where both say something about the architecture they must agree."""
    base = dict(ctx.native)
    for k, v in arch.items():
        if k in base and k in ctx.native.get("_from_contract", ()) and _norm(base[k]) != _norm(v):
            raise ExportError(f"{where}: config.json says {k}={v!r} but the draftkit contract says "
                              f"{base[k]!r} (config and contract disagree)")
        base[k] = v
    base.pop("_from_contract", None)
    if not base.get("target") and ctx.target is not None:
        base["target"] = ctx.target.info()
    base["family"] = family
    base.setdefault("type", family)
    return base


def _norm(v):
    return json.loads(json.dumps(v)) if isinstance(v, (dict, list, tuple)) else v


def detect_family(fmt: str, cfg: dict) -> str:
    """The head family of a directory without a contract, from its config.json."""
    arch = " ".join(cfg.get("architectures") or [])
    if cfg.get("speculators_model_type"):
        return {"eagle3": "eagle3", "mtp": "mtp", "eagle": "eagle"}.get(cfg["speculators_model_type"], cfg["speculators_model_type"])
    if cfg.get("model_type") == "medusa" or "medusa_num_heads" in cfg or "Medusa" in arch:
        return "medusa"
    if "DFlash" in arch:
        return "dflash"
    if "Eagle3" in arch or "draft_vocab_size" in cfg or fmt == "eagle3-official":
        return "eagle3"
    if "NextN" in arch or "MTP" in arch or cfg.get("model_type") in ("deepseek_mtp",):
        return "mtp"
    return "eagle"


def detect_format(directory: Path, cfg: dict) -> str:
    contract = find_contract(directory, cfg)
    if contract and contract.get("format"):
        return contract["format"]
    if "family" in cfg and "draftkit_format" in cfg:
        return "draftkit"
    if cfg.get("speculators_model_type"):
        return "speculators"
    arch = " ".join(cfg.get("architectures") or [])
    if "LlamaForCausalLMEagle" in arch:
        return "sglang"
    if arch.startswith("Eagle") or arch.startswith("DFlash") or cfg.get("model_type") == "medusa":
        return "vllm"
    if "medusa_num_heads" in cfg:
        return "medusa-official"
    return "eagle3-official" if "draft_vocab_size" in cfg else "eagle-official"
