"""The contract every export carries: what the head was trained on, in words an engine user can check.

It lives in config.json under `draftkit_contract` (vLLM, SGLang, transformers and speculators
config classes keep unknown keys as attributes and ignore them), or in a sidecar `draftkit.json`
for a layout whose config is parsed strictly.
"""
from __future__ import annotations

from typing import Any

import draftkit
from draftkit.export.files import dtype_name, native_config
from draftkit.export.serving import ENGINE_DRAFT_KEY, serving_lines
from draftkit.heads.registry import head_class
from draftkit.target import FINAL

FINGERPRINT_OF = ("sha256[:16] over (shape, float32 bytes) of the target's input embedding weight, "
                  "then its lm_head weight (draftkit.target.fingerprint_tensors)")
DRAFTKIT_LAYERS = ("draftkit: i = residual stream entering target decoder layer i, before any norm "
                   "(transformers hidden_states[i], 0 = token embeddings); -1 = output of the final norm")


def feature_layers(native: dict) -> list[int]:

    family = native["family"]
    return list(head_class(family).feature_layers_of(native_config(family, native, "config")))


def make_contract(native: dict, tensors: dict, fmt: str, layout) -> dict[str, Any]:

    layers = feature_layers(native)
    engine_layers = layout.layer_ids_out(layers) if layout else layers
    return {
        "draftkit_version": draftkit.__version__,
        "format": fmt,
        "family": native["family"],
        "engine_source": layout.source if layout else "draftkit/heads/base.py (save_pretrained)",
        "target": dict(native.get("target") or {}),
        "fingerprint_of": FINGERPRINT_OF,
        "hidden_size": native.get("hidden_size"),
        "vocab_size": native.get("vocab_size"),
        "feature_layers": layers,
        "feature_layer_convention": DRAFTKIT_LAYERS,
        "engine_feature_layers": engine_layers,
        "engine_feature_layer_convention": getattr(layout, "layer_convention", None) or DRAFTKIT_LAYERS,
        "d2t_convention": getattr(layout, "d2t_convention", None) or native_d2t_convention(native),
        "dtype": dtype_name(tensors),
        "recipe_hash": native.get("recipe_hash"),
        "draft": native.get("draft"),  # the DraftSettings `draftkit eval --draft auto` measured, if any
        # what each engine should serve (engines/vllm_auto.py: measured in vLLM; SGLang's from our loop)
        ENGINE_DRAFT_KEY: native.get(ENGINE_DRAFT_KEY),
        "head": {k: v for k, v in native.items() if k not in ("draftkit_format", "draftkit_contract", ENGINE_DRAFT_KEY)},
    }


def native_d2t_convention(native: dict) -> str:
    if native["family"] != "eagle3" and not native.get("draft_vocab_size"):
        return "none: the head drafts over the full target vocabulary"
    return "offset: target_id = draft_id + d2t[draft_id] (EAGLE-3 reference)"


def native_from_contract(contract: dict | None, family: str) -> dict:
    """The native config an import starts from: the contract's head (training fields, target info,
    recipe hash); `_from_contract` lists the architecture keys the engine config must agree with."""
    if not contract:
        return {"type": family, "family": family}
    head = dict(contract.get("head") or {})
    if head.get("family", family) != family:
        raise ValueError(f"contract says family {head.get('family')!r}, layout is {family!r}")
    head["_from_contract"] = tuple(k for k in head if k not in ("target", "recipe_hash", "family", "type"))
    if contract.get(ENGINE_DRAFT_KEY):  # kept through an import, so a re-export carries it
        head[ENGINE_DRAFT_KEY] = contract[ENGINE_DRAFT_KEY]
    return head


def check_target(native_or_contract: dict, target) -> list[str]:
    """Problems (empty = fits) between a head config or contract and a loaded target."""
    problems = []
    for name, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        want = native_or_contract.get(name)
        if want is not None and want != have:
            problems.append(f"{name}: head has {want}, target {target.name} has {have}")
    info = native_or_contract.get("target") or {}
    want = info.get("fingerprint")
    if want and want != target.fingerprint:
        problems.append(f"fingerprint: head was trained against {info.get('name')} ({want}); "
                        f"this target's embedding/lm_head fingerprint is {target.fingerprint}")
    layers = native_or_contract.get("feature_layers")
    if layers is None and "family" in native_or_contract:
        try:
            layers = feature_layers(native_or_contract)
        except Exception:  # an incomplete config: the size checks above say enough
            layers = []
    for i in layers or []:
        if i != FINAL and not 0 <= i < target.num_layers:
            problems.append(f"feature layer {i} does not exist in {target.name} ({target.num_layers} layers)")
    return problems


def describe(contract: dict, directory: str | None = None) -> list[str]:
    """Human lines for `draftkit inspect` (directory: where the contract is, named in the vLLM flags)."""
    t = contract.get("target") or {}
    return [
        f"contract: draftkit {contract.get('draftkit_version')}, format {contract.get('format')}, "
        f"family {contract.get('family')} (layout follows {contract.get('engine_source')})",
        f"trained on: {t.get('name')} [{t.get('architecture')}] fingerprint {t.get('fingerprint')}",
        f"sizes: hidden {contract.get('hidden_size')}, vocab {contract.get('vocab_size')}, dtype {contract.get('dtype')}",
        f"feature layers: {contract.get('feature_layers')} ({contract.get('feature_layer_convention')})",
        f"  as the engine reads them: {contract.get('engine_feature_layers')} "
        f"({contract.get('engine_feature_layer_convention')})",
        f"d2t: {contract.get('d2t_convention')}",
        *([f"draft vocabulary: {contract['draft_vocab']}"] if contract.get("draft_vocab") else []),
        f"recipe hash: {contract.get('recipe_hash')}",
        *serving_lines(contract, directory),
        *([verifier_line(contract["verifier"])] if contract.get("verifier") else []),
    ]


def verifier_line(v: dict) -> str:
    checked = (f"checked: fingerprint {v.get('fingerprint')}" if v.get("checked")
               else "NOT CHECKED against the head's target")
    return f"verifier: {v.get('name_or_path')} ({checked})" + (f"; {v['note']}" if v.get("note") else "")


