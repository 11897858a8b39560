"""Serving formats as small per-(format, family) tables, and the export / import that run them.

A `Layout` says how one head family is laid out for one engine:
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
The engine modules (vllm.py, sglang.py, speculators.py, official.py) each register their tables.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from draftkit.heads.base import HEAD_FORMAT_VERSION, HeadError, check_state_dict, read_head_config, replace_dir
from draftkit.heads.registry import head_class

Shapes = dict[str, tuple[int, ...]]
FORMATS = ("draftkit", "vllm", "sglang", "speculators")
IMPORT_ONLY = ("eagle-official", "eagle3-official", "medusa-official")
CONTRACT_KEY = "draftkit_contract"


class ExportError(ValueError):
    """An export or import that would not load faithfully; the message names the tensor or field."""


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
        if self.target is None:
            raise ExportError(f"{why}: pass --target MODEL (the target the head was trained against)")
        return self.target


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
    _load_tables()
    if fmt not in FORMATS + IMPORT_ONLY:
        raise ExportError(f"unknown format {fmt!r}; known: {', '.join(FORMATS + IMPORT_ONLY)}")
    if (fmt, family) in LAYOUTS:
        return LAYOUTS[(fmt, family)]
    why = REFUSALS.get((fmt, family), f"no {fmt} layout for the '{family}' family")
    can = sorted(f for (f, fam) in LAYOUTS if fam == family and f in FORMATS)
    raise ExportError(f"format {fmt!r} cannot carry a '{family}' head: {why}"
                      + (f" (formats that can: {', '.join(can)})" if can else ""))


def _load_tables() -> None:
    from draftkit.export import dflash, official, sglang, speculators, vllm  # noqa: F401  (they register)


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


def _matches(name: str, table, reverse: bool) -> bool:
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


# ---- shapes of the engines' llama layers ----------------------------------------------------------

def llama_layer_shapes(prefix: str, c: dict, d_in: int | None = None, input_norm: bool = True,
                       hidden_norm: bool = False) -> Shapes:
    """Parameters of a llama decoder layer as vLLM / SGLang build it (q/k/v/o, gate/up/down, norms)."""
    H, I = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    nq, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    d_in = d_in or H
    s = {f"{prefix}self_attn.q_proj.weight": (nq * hd, d_in), f"{prefix}self_attn.k_proj.weight": (nkv * hd, d_in),
         f"{prefix}self_attn.v_proj.weight": (nkv * hd, d_in), f"{prefix}self_attn.o_proj.weight": (H, nq * hd),
         f"{prefix}mlp.gate_proj.weight": (I, H), f"{prefix}mlp.up_proj.weight": (I, H),
         f"{prefix}mlp.down_proj.weight": (H, I), f"{prefix}post_attention_layernorm.weight": (H,)}
    if input_norm:
        s[f"{prefix}input_layernorm.weight"] = (H,)
    if hidden_norm:
        s[f"{prefix}hidden_norm.weight"] = (H,)
    return s


LLAMA_DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "max_position_embeddings", "vocab_size")


def llama_config_out(n: dict, num_layers: int) -> dict:
    """The llama config.json fields vLLM's and SGLang's llama layers read, from a native config."""
    rope = dict(n.get("rope_parameters") or {})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"model_type": "llama", **{k: n[k] for k in LLAMA_DIMS}, "num_hidden_layers": num_layers,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "rope_theta": rope.get("rope_theta", 10000.0),
            **({"rope_scaling": scaling} if scaling.get("rope_type", "default") != "default" else {}),
            "rope_parameters": rope}


def llama_config_in(c: dict) -> dict:
    """Native dimension fields from a llama-style config.json (the inverse of llama_config_out)."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ExportError(f"config.json lacks {', '.join(missing)}")
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias") or c.get("mlp_bias"):
        raise ExportError("config.json: only silu llama layers without attention/mlp bias are supported")
    rope = c.get("rope_parameters") or {"rope_type": "default", **(c.get("rope_scaling") or {}),
                                        "rope_theta": c.get("rope_theta", 10000.0)}
    return {"hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
            "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
            "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            "rms_norm_eps": float(c.get("rms_norm_eps", 1e-5)), "vocab_size": c["vocab_size"],
            "max_position_embeddings": c.get("max_position_embeddings", 4096), "rope_parameters": dict(rope)}


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


# ---- reading and writing directories -------------------------------------------------------------

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
        for name, data in (files or {}).items():
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


def native_shapes(family: str, cfg: dict, where: str) -> Shapes:
    """The tensors a head with this config has, built on the meta device (no memory, no init)."""
    config = native_config(family, cfg, where)
    with torch.device("meta"):
        head = head_class(family)(config)
    return {k: tuple(v.shape) for k, v in head.state_dict().items()}


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


# ---- export and import ---------------------------------------------------------------------------

DRAFT_VOCAB_DROPPED = "dropped: engine drafts over the full target vocabulary"


def drop_draft_vocab(native: dict, state: dict[str, Tensor], layout: Layout, full_vocab: bool,
                     where: str) -> tuple[dict, dict[str, Tensor], str]:
    """A head with a draft vocabulary (d2t / t2d) for a layout that has no place for one: refused,
    or with full_vocab the head is exported as drafting over the full target vocabulary (its native
    config says draft_vocab_size None, so an import gives back the head the engine runs); the note
    for the contract comes third."""
    n = native.get("draft_vocab_size")
    if not full_vocab:
        raise ExportError(f"{where}: the head drafts over a reduced vocabulary (draft_vocab_size={n}, tensors "
                          f"d2t / t2d) but {layout.source} has no draft-vocabulary support: the engine would "
                          "draft over the full target vocabulary with the target's lm_head, and d2t would be "
                          "lost. Pass --full-vocab (full_vocab=True) to export it that way, or keep "
                          "--format draftkit")
    state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    return {**native, "draft_vocab_size": None}, state, f"{DRAFT_VOCAB_DROPPED} (trained with draft_vocab_size={n})"


def export_head(head_dir: str | Path, fmt: str, out: str | Path, *, target=None, overwrite: bool = False,
                dtype: str | None = None, full_vocab: bool = False, verifier: str | None = None) -> Path:
    """Convert a native head directory into `fmt` at `out`, checked against the engine's layout.

    full_vocab: for a head with a draft vocabulary (d2t) and an engine layout without one, export
    it drafting over the full target vocabulary (recorded in the contract) instead of refusing.
    verifier: the model directory or hub id the export names as the head's verifier (default: the
    target it was trained on, export/verifier.py), checked against the head's target fingerprint."""
    from draftkit.export.contract import make_contract
    from draftkit.export.verifier import VerifierError, resolve_verifier

    native, state = read_native(Path(head_dir))
    family = native["family"]
    if fmt == "draftkit":
        layout = None
    else:
        layout = layout_for(fmt, family)
        check_target_architecture(fmt, native)
    if dtype is not None:
        from draftkit.target import DTYPES
        if dtype not in DTYPES:
            raise ExportError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    if target is not None:
        from draftkit.export.contract import check_target
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
    dropped = None
    if "d2t" in state and not _matches("d2t", ctx.table(layout), reverse=False):
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


def import_head(src: str | Path, fmt: str, out: str | Path, *, target=None, overwrite: bool = False,
                family: str | None = None) -> Path:
    """Convert a directory in `fmt` (an export of ours, or a published head) into a native head."""
    native, state = to_native(src, fmt, target=target, family=family)
    return write_dir(Path(out), native_out(native, state), state, overwrite,
                     metadata={"draftkit_family": native["family"]})


def to_native(src: str | Path, fmt: str, *, target=None, family: str | None = None) -> tuple[dict, dict[str, Tensor]]:
    """Read `src` in `fmt` and convert it in memory into (native config, native tensors), checked."""
    from draftkit.export.contract import check_target, native_from_contract

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
        keep = {n for n in layout.optional(cfg) if n in tensors and not _matches(n, table, reverse=True)}
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
