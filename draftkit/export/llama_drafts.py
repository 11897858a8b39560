"""The llama drafts: the llama layers every engine's EAGLE drafter is built from, and the EAGLE /
EAGLE-3 layouts the engines share. vLLM (vllm.py), SGLang (sglang.py), speculators (speculators.py)
and the published reference heads (official.py) differ only in names, config fields and conventions
around these.
"""
from __future__ import annotations

import torch

from draftkit.export.layout import Context, ExportError, Shapes, check_shared

# ---- llama decoder layers -------------------------------------------------------------------------

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


# ---- EAGLE-1 -------------------------------------------------------------------------------------
# fc over [embedding, hidden] (2H -> H), then llama decoder layers `layers.{i}` whose layer 0 has no
# input_layernorm (vLLM and SGLang llama_eagle.py, the reference cnets.py); embed_tokens and lm_head
# are shared from the target (the reference stores a copy of embed_tokens, official.py checks it).
EAGLE_NAMES = (("fc.", "fc."), ("layers.{i}.", "layers.{i}."))


def eagle_shapes(c: dict, fc_bias: bool = False) -> Shapes:
    H = c["hidden_size"]
    s: Shapes = {"fc.weight": (H, 2 * H)}
    if fc_bias:
        s["fc.bias"] = (H,)
    for i in range(c["num_hidden_layers"]):
        s.update(llama_layer_shapes(f"layers.{i}.", c, input_norm=i > 0))
    return s


# ---- EAGLE-3 -------------------------------------------------------------------------------------
# One midlayer: fc over 3 aux hidden states (3 x target_hidden -> H), a llama layer whose q/k/v read
# [embedding, hidden] (2H) with an input_layernorm on the embedding and a hidden_norm on the hidden,
# norm, lm_head over draft_vocab_size rows, and the vocabulary maps d2t (OFFSETS: target id = draft
# id + d2t[draft id]) and t2d (a target-vocab mask). vLLM's llama_eagle3.py, SGLang's and the
# reference's all read this layout (vllm.py says how vLLM's loader renames it; speculators.py
# writes midlayer. as layers.0.).
EAGLE3_NAMES = (("fc.", "fc."), ("midlayer.", "midlayer."), ("norm.", "norm."), ("lm_head.", "lm_head."),
                ("d2t", "d2t"), ("t2d", "t2d"))

# Aux layer ids: vllm/v1/worker/gpu_model_runner.py (_get_eagle3_aux_layers_from_config) reads
#   config.eagle_aux_hidden_state_layer_ids (or eagle_config[...]) as is, and
#   vllm/model_executor/models/llama.py captures `hidden_states + residual` BEFORE layer idx:
#   draftkit's convention. Before layer 0 residual is still None, so 0 cannot be captured there.
VLLM_LAYERS = ("vLLM: i = hidden_states + residual captured before target decoder layer i "
               "(vllm/model_executor/models/llama.py); the same as draftkit's")


def eagle3_shapes(c: dict) -> Shapes:
    H, N = c["hidden_size"], c.get("draft_vocab_size") or c["vocab_size"]
    if c.get("num_hidden_layers", 1) != 1:
        raise ExportError(f"config.json: num_hidden_layers={c['num_hidden_layers']}; draftkit's EAGLE-3 "
                          "head has exactly one midlayer")
    return {"fc.weight": (H, 3 * c.get("target_hidden_size", H)), "norm.weight": (H,),
            "lm_head.weight": (N, H), "d2t": (N,), "t2d": (c["vocab_size"],),
            **llama_layer_shapes("midlayer.", c, d_in=2 * H, input_norm=True, hidden_norm=True)}


def eagle3_config_out(n: dict, arch: str) -> dict:
    layers = list(n["feature_layers"])
    if -1 in layers:
        raise ExportError("feature_layers: -1 (the final norm output) cannot be an aux hidden state in the engines")
    if layers != sorted(set(layers)):  # vLLM's and SGLang's llama.py: `if i in <layers>: aux.append(...)` per layer
        raise ExportError(f"feature_layers {layers}: the engines capture each aux layer once, in layer order, and "
                          "concatenate them so, but this head's fc reads them in the order listed; only distinct "
                          "layers in ascending order can be served")
    return {"architectures": [arch], **llama_config_out(n, 1), "draft_vocab_size": n["draft_vocab_size"],
            # vLLM's speculators path defaults norm_before_residual to True when absent (algos.py):
            # draftkit's midlayer keeps the un-normalised hidden as the residual.
            "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": layers}


def eagle3_config_in(c: dict, ctx: Context, layer_ids: list[int] | None) -> dict:
    if c.get("norm_before_residual"):
        raise ExportError("config.json: norm_before_residual=true; draftkit's EAGLE-3 midlayer adds the "
                          "un-normalised hidden as the residual")
    if c.get("bias"):
        raise ExportError("config.json: bias=true (fc with a bias); draftkit's EAGLE-3 fc has none")
    arch = llama_config_in(c)
    if layer_ids is None:  # the engines' default: (2, N // 2, N - 3) of the target, as draftkit's
        n = ctx.native.get("target", {}).get("num_layers") or ctx.need_target(
            "config.json has no eagle_aux_hidden_state_layer_ids; the default depends on the target").num_layers
        layer_ids = [2, n // 2, n - 3]
    return {**arch, "draft_vocab_size": c.get("draft_vocab_size") or c["vocab_size"],
            "feature_layers": list(layer_ids)}


def d2t_to_t2d(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    ids = torch.arange(d2t.shape[0]) + d2t.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != ids.numel()):
        raise ExportError(f"d2t: draft ids do not map onto distinct target ids in 0..{vocab - 1}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return t2d


def eagle3_tensors_out(state: dict, ctx: Context) -> dict:
    # The engines read only d2t; t2d travels as the reference layout has it, and must agree.
    if not torch.equal(d2t_to_t2d(state["d2t"], state["t2d"].shape[0]), state["t2d"].bool()):
        raise ExportError("t2d disagrees with d2t (the engines read only d2t, so t2d would be ignored)")
    return state


def eagle3_tensors_in(state: dict, ctx: Context) -> dict:
    if "embed_tokens.weight" in state:
        state = check_shared(state, "embed_tokens.weight", ctx.need_target("embed_tokens.weight is stored").embed_tokens.weight, ctx)
    state["d2t"] = state["d2t"].long()
    t2d = d2t_to_t2d(state["d2t"], ctx.native["vocab_size"])
    if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
        raise ExportError("t2d disagrees with d2t (draft ids are target id - offset)")
    state["t2d"] = t2d
    return state


# ---- targets the llama drafts cannot serve -------------------------------------------------------
# Gemma targets multiply the token embedding by sqrt(hidden_size) inside the model (HF
# Gemma3TextScaledWordEmbedding), and draftkit's heads are trained on that scaled embedding; the
# engines' llama drafters call the shared embed_tokens directly, unscaled (each engine module says
# where, with refuse_target).
GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")
GEMMA_EMBEDDING = ("the target scales its token embedding by sqrt(hidden_size) inside the model and the head "
                   "was trained on that, but {src} embeds draft tokens with the target's embed_tokens unscaled")
