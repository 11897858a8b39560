"""SGLang layouts: what SGLang's draft-model loaders read, family by family.

SGLang's loaders skip names they do not know without a word, so an extra tensor here is an error.
"""
from __future__ import annotations

import torch

from draftkit.export.layout import Context, ExportError, Layout, refuse, refuse_target, register
from draftkit.export.llama_drafts import (EAGLE3_NAMES, EAGLE_NAMES, GEMMA_EMBEDDING, GEMMA_TYPES, eagle3_config_in,
                                          eagle3_config_out, eagle3_shapes, eagle3_tensors_in, eagle3_tensors_out,
                                          eagle_shapes, llama_config_in, llama_config_out)

# ---- EAGLE-1 ---------------------------------------------------------------------------------------
# python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle / LlamaModel):
#   fc = nn.Linear(2H, H) *with* a bias (torch default); layers.{i} = LlamaDecoderLayer, layer 0's
#   input_layernorm replaced by identity; output = hidden + residual. load_weights prefixes `model.`
#   and drops lm_head.*; the EAGLE worker then shares the target's embed_tokens and lm_head
#   (set_embed_and_head), so neither is stored.


def _eagle_out(n: dict, ctx: Context) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle"], **llama_config_out(n, n["num_layers"])}


def _eagle_in(c: dict, ctx: Context) -> dict:
    return {**llama_config_in(c), "num_layers": c["num_hidden_layers"],
            "fc_bias": bool(ctx.native.get("fc_bias", True))}


def _eagle_tensors_out(state: dict, ctx: Context) -> dict:
    if "fc.bias" not in state:  # SGLang's fc always has a bias: a zero one is the same function
        w = state["fc.weight"]
        state["fc.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    return state


def _eagle_tensors_in(state: dict, ctx: Context) -> dict:
    if not ctx.native.get("fc_bias", True):
        if torch.count_nonzero(state["fc.bias"]):
            raise ExportError("fc.bias is non-zero but the draftkit contract says fc_bias=false "
                              "(config and tensors disagree)")
        del state["fc.bias"]
    return state


register(Layout(
    format="sglang", family="eagle", source="python/sglang/srt/models/llama_eagle.py",
    names=EAGLE_NAMES, config_out=_eagle_out, config_in=_eagle_in,
    expected=lambda c: eagle_shapes(c, fc_bias=True),
    tensors_out=_eagle_tensors_out, tensors_in=_eagle_tensors_in,
    layer_convention="EAGLE-1 reads the target's final-norm output (no aux layer ids)"))


# ---- EAGLE-3 -------------------------------------------------------------------------------------
# python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3): fc = Linear(3H, H,
#   bias=config.bias or False); midlayer with q/k/v over 2H, input_layernorm (embedding) and
#   hidden_norm (hidden), residual = the un-normalised hidden; norm; lm_head over draft_vocab_size
#   rows (tie_word_embeddings must be false, else lm_head = embed_tokens); load_weights turns d2t
#   into hot_token_id = d2t + arange (OFFSETS) and skips t2d; unknown names are skipped silently.
#   The EAGLE-3 worker shares only embed_tokens from the target.
# Aux layer ids: sglang/srt/model_executor/model_runner.py reads eagle_config.eagle_aux_hidden_state_layer_ids
#   and models/llama.py set_eagle3_layers_to_capture captures before layer id + 1, i.e. SGLang's id k
#   is the OUTPUT of layer k = draftkit k + 1. The export writes draftkit ids - 1 there, and the
#   draftkit ids at the top level, which is what vLLM reads first: the same directory loads right in both.
SGLANG_LAYERS = ("SGLang: k = output of target decoder layer k, captured before layer k + 1 "
                 "(models/llama.py set_eagle3_layers_to_capture); draftkit id = SGLang id + 1")


def _eagle3_out(n: dict, ctx: Context) -> dict:
    if 0 in n["feature_layers"]:  # SGLang id -1: llama.py captures before layer 0 with residual still None
        raise ExportError("feature_layers: SGLang cannot capture layer 0 (the embedding): models/llama.py adds a "
                          "residual that is None before the first layer; train the head on layers >= 1")
    c = eagle3_config_out(n, "LlamaForCausalLMEagle3")
    c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in n["feature_layers"]],
                         "use_aux_hidden_state": True}
    return c


def _eagle3_in(c: dict, ctx: Context) -> dict:
    nested = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [i + 1 for i in nested] if nested else None
    top = c.get("eagle_aux_hidden_state_layer_ids")
    if ids and top and list(top) != ids:
        raise ExportError(f"config.json: eagle_aux_hidden_state_layer_ids {list(top)} (vLLM's convention) and "
                          f"eagle_config's {list(nested)} (SGLang's, +1) name different layers")
    return eagle3_config_in(c, ctx, ids or (list(top) if top else None))


register(Layout(
    format="sglang", family="eagle3", source="python/sglang/srt/models/llama_eagle3.py",
    names=EAGLE3_NAMES, config_out=_eagle3_out, config_in=_eagle3_in, expected=eagle3_shapes,
    optional=lambda c: {"embed_tokens.weight": (c["vocab_size"], c["hidden_size"])},
    tensors_out=eagle3_tensors_out, tensors_in=eagle3_tensors_in,
    layer_ids_out=lambda ids: [i - 1 for i in ids], layer_convention=SGLANG_LAYERS,
    d2t_convention="offset: hot_token_id = d2t + arange(draft_vocab) (llama_eagle3.py load_weights)"))

refuse("sglang", "medusa", "SGLang has no Medusa drafter (python/sglang/srt/models has EAGLE, EAGLE-3 and "
       "NextN/MTP only); export --format vllm")
refuse("sglang", "mtp", "SGLang's MTP drafters (deepseek_nextn.py, ...) use the target family's own decoder "
       "layer, and draftkit's MTP depth is a llama layer: no faithful SGLang layout")
refuse_target("sglang", ("eagle", "eagle3"), GEMMA_TYPES,
              GEMMA_EMBEDDING.format(src="python/sglang/srt/models/llama_eagle*.py"))
