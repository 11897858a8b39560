"""Published third-party release layouts (import only): the official EAGLE / EAGLE-3 and Medusa heads.

These directories do not say which target they were trained on beyond a name, so an import needs
the target (`--target MODEL`): it fills the target info, and any stored copy of the target's
embedding is checked against it rather than trusted.
"""
from __future__ import annotations

import dataclasses

from draftkit.export.layout import Context, ExportError, Layout, Shapes, check_shared, register
from draftkit.export.llama_drafts import (EAGLE3_NAMES, EAGLE_NAMES, eagle3_config_in, eagle3_config_out,
                                          eagle3_shapes, eagle3_tensors_in, eagle_shapes, llama_config_in,
                                          llama_config_out)
from draftkit.heads.base import HeadConfig


# ---- EAGLE-1 -------------------------------------------------------------------------------------
# SafeAILab/EAGLE eagle/model/cnets.py (EAGLE-1 `Model`): fc = Linear(2H, H, bias=True),
# layers.{i} llama layers with no input_layernorm on layer 0, embed_tokens stored (a copy of the
# target's); config.json is the target's llama config with num_hidden_layers = draft layers.

def _eagle_in(c: dict, ctx: Context) -> dict:
    t = ctx.need_target("importing a published EAGLE head")
    return {**llama_config_in(c), "num_layers": c["num_hidden_layers"], "fc_bias": True, "target": t.info()}


def _eagle_tensors_in(state: dict, ctx: Context) -> dict:
    state = check_shared(state, "embed_tokens.weight", ctx.target.embed_tokens.weight, ctx)
    if "fc.bias" not in state:
        ctx.native["fc_bias"] = False
    return state


register(Layout(
    format="eagle-official", family="eagle", source="SafeAILab/EAGLE eagle/model/cnets.py",
    names=EAGLE_NAMES, config_out=lambda n, ctx: {"architectures": ["LlamaForCausalLM"],
                                                  **llama_config_out(n, n["num_layers"])},
    config_in=_eagle_in, expected=eagle_shapes,
    optional=lambda c: {"fc.bias": (c["hidden_size"],),
                        "embed_tokens.weight": (c["vocab_size"], c["hidden_size"])},
    tensors_in=_eagle_tensors_in))


# ---- EAGLE-3 -------------------------------------------------------------------------------------
# SafeAILab/EAGLE eagle/model/cnets.py (EAGLE-3 `Model`) as released (yuhuili/EAGLE3-*): the names
# vLLM's and SGLang's llama_eagle3.py read (midlayer.*, fc, norm, lm_head, d2t offsets, t2d), a
# llama config with draft_vocab_size, and NO aux layer ids: the reference captures before layers
# (2, N // 2, N - 3) of the target (its modified modeling_llama), i.e. draftkit's convention.
def _eagle3_in(c: dict, ctx: Context) -> dict:
    t = ctx.need_target("importing a published EAGLE-3 head")
    ctx.native.setdefault("target", t.info())
    return eagle3_config_in(c, ctx, c.get("eagle_aux_hidden_state_layer_ids"))


register(Layout(
    format="eagle3-official", family="eagle3", source="SafeAILab/EAGLE eagle/model/cnets.py (EAGLE-3)",
    names=EAGLE3_NAMES, config_out=lambda n, ctx: eagle3_config_out(n, "LlamaForCausalLMEagle3"),
    config_in=_eagle3_in, expected=lambda c: {k: v for k, v in eagle3_shapes(c).items() if k != "t2d"},
    optional=lambda c: {"t2d": (c["vocab_size"],), "embed_tokens.weight": (c["vocab_size"], c["hidden_size"])},
    tensors_in=eagle3_tensors_in))


# ---- Medusa-1 ------------------------------------------------------------------------------------
# FasterDecoding/Medusa medusa/model/medusa_model.py (MedusaModel.medusa_head): head i =
# Sequential(ResBlock x L, Linear(H, V, bias=False)), ResBlock.linear with a bias; saved as
# medusa_lm_head.safetensors with names `{i}.{j}.linear.*` and `{i}.{L}.weight`; config.json has
# medusa_num_heads / medusa_num_layers and the base model's name only (dims come from the target).
def _medusa_names(n: dict) -> tuple:
    L = n["num_layers"]
    return (("medusa_head.{i}." + f"{L}.", "{i}." + f"{L}."), ("medusa_head.{i}.{j}.linear.", "{i}.{j}.linear."))


def _medusa_shapes(c: dict) -> Shapes:
    H, V = c.get("hidden_size"), c.get("vocab_size")
    if H is None or V is None:
        raise ExportError("a published Medusa head does not record its dims: pass --target MODEL")
    K, L = c["medusa_num_heads"], c.get("medusa_num_layers", 1)
    s: Shapes = {}
    for i in range(K):
        for j in range(L):
            s[f"{i}.{j}.linear.weight"], s[f"{i}.{j}.linear.bias"] = (H, H), (H,)
        s[f"{i}.{L}.weight"] = (V, H)
    return s


def target_dims(target) -> dict:
    """Every HeadConfig field a head takes from its target (sizes, rope, target info)."""
    hc = HeadConfig()
    hc.fill_from_target(target)
    return {k: v for k, v in dataclasses.asdict(hc).items() if k not in ("type", "layer_convention")}


def _medusa_in(c: dict, ctx: Context) -> dict:
    t = ctx.need_target("importing a published Medusa head")
    return {**target_dims(t), "num_heads": c["medusa_num_heads"], "num_layers": c.get("medusa_num_layers", 1), "share_lm_head": False,
            "target": t.info()}


register(Layout(
    format="medusa-official", family="medusa", source="FasterDecoding/Medusa medusa/model/medusa_model.py",
    names=_medusa_names, config_out=lambda n, ctx: {"medusa_num_heads": n["num_heads"],
                                                    "medusa_num_layers": n["num_layers"]},
    config_in=_medusa_in, expected=_medusa_shapes))
