"""vLLM layouts: what vLLM's draft-model loaders read, family by family.

Each table cites the vLLM file it follows. vLLM prefixes non-lm_head names with `model.` itself and
stacks q/k/v and gate/up while loading, so checkpoints keep transformers' per-projection names.
"""
from __future__ import annotations

import torch

from draftkit.export.layout import Context, ExportError, Layout, Shapes, refuse, refuse_target, register, zero_bias_dropped
from draftkit.export.llama_drafts import (EAGLE3_NAMES, EAGLE_NAMES, GEMMA_EMBEDDING, GEMMA_TYPES, VLLM_LAYERS,
                                          eagle3_config_in, eagle3_config_out, eagle3_shapes, eagle3_tensors_in,
                                          eagle3_tensors_out, eagle_shapes, llama_config_in, llama_config_out)

# ---- EAGLE-1 ---------------------------------------------------------------------------------------
# vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM / LlamaModel):
#   fc = Linear(2H, H, bias=False); layers.{i} = LlamaDecoderLayer with layer 0's input_layernorm
#   replaced by Identity; output = hidden + residual (no final norm); embed_tokens and lm_head are
#   shared from the target (embed_tokens.* is skipped when PP == 1; there is no lm_head param).


def _eagle_out(n: dict, ctx: Context) -> dict:
    # architectures: vLLM's registry maps EagleLlamaForCausalLM to llama_eagle.py
    # (vllm/model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS).
    return {"architectures": ["EagleLlamaForCausalLM"], **llama_config_out(n, n["num_layers"])}


def _eagle_in(c: dict, ctx: Context) -> dict:
    # vLLM's fc has no bias: a head trained with one carries a zero bias (see _eagle_tensors_in).
    return {**llama_config_in(c), "num_layers": c["num_hidden_layers"],
            "fc_bias": bool(ctx.native.get("fc_bias", False))}


def _eagle_tensors_out(state: dict, ctx: Context) -> dict:
    return zero_bias_dropped(state, "fc.bias", "vllm export",
                             "train with `fc_bias: false`, or export --format sglang (SGLang's fc has a bias)")


def _eagle_tensors_in(state: dict, ctx: Context) -> dict:
    if "fc.bias" in state:  # a third-party vLLM-layout file with a bias vLLM would not load: keep it
        ctx.native["fc_bias"] = True
    elif ctx.native.get("fc_bias"):
        state["fc.bias"] = torch.zeros(state["fc.weight"].shape[0], dtype=state["fc.weight"].dtype)
    return state


register(Layout(
    format="vllm", family="eagle", source="vllm/model_executor/models/llama_eagle.py",
    names=EAGLE_NAMES, config_out=_eagle_out, config_in=_eagle_in, expected=eagle_shapes,
    optional=lambda c: {"fc.bias": (c["hidden_size"],)},
    tensors_out=_eagle_tensors_out, tensors_in=_eagle_tensors_in,
    layer_convention="EAGLE-1 reads the target's final-norm output (vLLM passes the target's last hidden "
                     "state; no aux layer ids)"))



# ---- EAGLE-3 -------------------------------------------------------------------------------------
# vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM):
#   fc = Linear(3 * target_hidden, H, bias=False) on the concatenated aux hidden states;
#   layers.0 (loaded from `midlayer.*`, renamed by load_weights) with q/k/v reading 2H, an
#   input_layernorm on the embedding and a hidden_norm on the hidden; norm; lm_head over
#   draft_vocab_size rows; `d2t` renamed to draft_id_to_target_id and used as OFFSETS
#   (targets = arange(draft_vocab) + d2t in compute_logits). `t2d` is skipped by the loader.
#   A tensor named draft_id_to_target_id would NOT load (it gets a `model.` prefix and is then
#   skipped), so the file keeps the reference name `d2t`.
#   embed_tokens is shared from the target when the file has none.
# Aux layer ids: VLLM_LAYERS (llama_drafts.py, shared with the speculators format vLLM serves).


def _eagle3_ids(c: dict) -> list[int] | None:
    ids = c.get("eagle_aux_hidden_state_layer_ids") or (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def _vllm_eagle3_out(n: dict, ctx: Context) -> dict:
    if 0 in n["feature_layers"]:
        raise ExportError("feature_layers: vLLM cannot capture layer 0 (llama.py adds a residual that is "
                          "None before the first layer); train with layers >= 1 or export --format sglang")
    return eagle3_config_out(n, "LlamaForCausalLMEagle3")  # registry.py maps it to llama_eagle3.py


register(Layout(
    format="vllm", family="eagle3", source="vllm/model_executor/models/llama_eagle3.py",
    names=EAGLE3_NAMES, config_out=_vllm_eagle3_out,
    config_in=lambda c, ctx: eagle3_config_in(c, ctx, _eagle3_ids(c)),
    expected=eagle3_shapes, optional=lambda c: {"embed_tokens.weight": (c["vocab_size"], c["hidden_size"])},
    tensors_out=eagle3_tensors_out, tensors_in=eagle3_tensors_in, layer_convention=VLLM_LAYERS,
    d2t_convention="offset: target_id = draft_id + d2t[draft_id] (llama_eagle3.py compute_logits)"))


# ---- Medusa --------------------------------------------------------------------------------------
# vllm/model_executor/models/medusa.py (Medusa) with vllm/transformers_utils/configs/medusa.py:
#   blocks.{i}.layers.{j} = Linear(H, H, bias=medusa_fc_bias), x + SiLU(layer(x));
#   lm_heads.{i}.weight (V, H) per head, or with original_lm_head=true one lm_head read from
#   `lm_heads.0.weight`; token_map only with truncated_vocab_size < vocab_size (draftkit: never).
def _medusa_names(n: dict) -> tuple:
    L = n["num_layers"]
    return (("medusa_head.{i}." + f"{L}.", "lm_heads.{i}."), ("medusa_head.{i}.{j}.linear.", "blocks.{i}.layers.{j}."))


def medusa_shapes(c: dict) -> Shapes:
    H, V, K = c["hidden_size"], c["vocab_size"], c["num_heads"]
    if c.get("truncated_vocab_size", V) != V:
        raise ExportError("config.json: truncated_vocab_size < vocab_size (a token_map); draftkit's Medusa "
                          "drafts over the full vocabulary")
    s: Shapes = {}
    for i in range(K):
        for j in range(c["num_hidden_layers"]):
            s[f"blocks.{i}.layers.{j}.weight"] = (H, H)
            if c.get("medusa_fc_bias", False):
                s[f"blocks.{i}.layers.{j}.bias"] = (H,)
        if not c.get("original_lm_head", False) or i == 0:
            s[f"lm_heads.{i}.weight"] = (V, H)
    return s


def _medusa_out(n: dict, ctx: Context) -> dict:
    return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": n["hidden_size"],
            "vocab_size": n["vocab_size"], "num_heads": n["num_heads"], "num_hidden_layers": n["num_layers"],
            "truncated_vocab_size": n["vocab_size"], "medusa_fc_bias": True,
            "original_lm_head": bool(n["share_lm_head"])}


def _medusa_in(c: dict, ctx: Context) -> dict:
    if not c.get("medusa_fc_bias", False):
        raise ExportError("config.json: medusa_fc_bias=false; draftkit's Medusa blocks have a bias")
    return {"hidden_size": c["hidden_size"], "vocab_size": c["vocab_size"], "num_heads": c["num_heads"],
            "num_layers": c["num_hidden_layers"], "share_lm_head": bool(c.get("original_lm_head", False))}


def _medusa_tensors_out(state: dict, ctx: Context) -> dict:
    n = ctx.native
    if n["share_lm_head"]:  # vLLM reads the shared lm_head from the file: store the target's
        t = ctx.need_target("this Medusa head shares the target's lm_head, which vLLM loads from the file")
        state[f"medusa_head.0.{n['num_layers']}.weight"] = t.lm_head.weight.detach().cpu().to(
            next(iter(state.values())).dtype)
    return state


def _medusa_tensors_in(state: dict, ctx: Context) -> dict:
    n = ctx.native
    if n["share_lm_head"]:
        name = f"medusa_head.0.{n['num_layers']}.weight"
        stored = state.pop(name)
        if ctx.target is not None and not torch.equal(stored, ctx.target.lm_head.weight.detach().cpu().to(stored.dtype)):
            raise ExportError(f"lm_heads.0.weight differs from target {ctx.target.name}'s lm_head, but the "
                              "head shares it (original_lm_head=true)")
    return state


register(Layout(
    format="vllm", family="medusa", source="vllm/model_executor/models/medusa.py",
    names=_medusa_names, config_out=_medusa_out, config_in=_medusa_in, expected=medusa_shapes,
    tensors_out=_medusa_tensors_out, tensors_in=_medusa_tensors_in,
    layer_convention="Medusa reads the target's final-norm output (what vLLM passes its Medusa drafter)"))


# ---- MTP -----------------------------------------------------------------------------------------
# vLLM's MTP drafters (deepseek_mtp.py, mimo_mtp.py, glm4_moe_mtp.py, qwen3_next_mtp.py, ...) build
# mtp_block from the TARGET's own decoder-layer class; none of them is a plain llama layer, which is
# what draftkit's MTP depth is. A layout is added here when one fits a target family.
MTP_REFUSAL = ("vLLM's MTP drafters (deepseek_mtp.py, mimo_mtp.py, glm4_moe_mtp.py, qwen3_next_mtp.py) "
               "use the target family's own decoder layer (MLA/MoE, qkv-bias, ...), and draftkit's MTP depth "
               "is a llama layer: no faithful vLLM layout")
refuse("vllm", "mtp", MTP_REFUSAL)

# ---- targets the llama drafts cannot serve -------------------------------------------------------
# Gemma targets multiply the token embedding by sqrt(hidden_size) inside the model (HF
# Gemma3TextScaledWordEmbedding; vLLM gemma3.py get_input_embeddings applies its `normalizer`), and
# draftkit's heads are trained on that scaled embedding. vLLM's llama_eagle.py / llama_eagle3.py
# call the shared embed_tokens directly, unscaled; vLLM's gemma3.py Gemma3ForCausalLM does not
# implement SupportsEagle3 either, so it cannot hand EAGLE-3 its aux hidden states.
refuse_target("vllm", ("eagle", "eagle3"), GEMMA_TYPES,
              GEMMA_EMBEDDING.format(src="vllm/model_executor/models/llama_eagle*.py")
              + " (and vLLM's gemma3.py implements no SupportsEagle3)")


# ---- what vLLM does with a served drafter beyond its file ----------------------------------------

def draft_window(target_config) -> int | None:
    """The sliding window vLLM applies to a drafter's attention on this target, or None (full attention).

    vLLM 0.32 sets CacheConfig.sliding_window to the target's `sliding_window` when the target has no
    `layer_types` or only sliding ones (vllm/engine/arg_utils.py, create_engine_config; interleaved
    models such as Gemma 3 get None so their global layers stay global), and an attention layer built
    without a per-layer window takes that model-level one (vllm/model_executor/layers/attention/
    attention.py, Attention.__init__). The drafters (llama_eagle.py, llama_eagle3.py, qwen3_dflash.py)
    build theirs with the target's cache_config and no per-layer window, so they attend to the last
    `window` positions only (keys fewer than `window` positions behind the query), while draftkit's
    heads are trained on, and by default draft with, the whole context. The engine loop
    (engines/vllm_eval.py: loop_decoder) sets head.attention_window to it, and then vLLM's counts equal
    our loop's past the window too (tests/test_engine_vllm_archs.py: EAGLE, EAGLE-3 and DFlash on a
    Mistral target whose window every answer crosses)."""
    window = getattr(target_config, "sliding_window", None)
    if not window or getattr(target_config, "use_sliding_window", True) is False:
        return None
    types = getattr(target_config, "layer_types", None)
    return int(window) if types is None or all(t == "sliding_attention" for t in types) else None


def window_note(target, family: str, longest: int | None = None) -> str | None:
    """The note for a `family` head (Medusa's heads have no attention) on a target whose window vLLM
    puts on the drafter (draft_window), or None; `longest`: the longest context a run will see."""
    window = draft_window(getattr(target, "config", None))
    if window is None or family == "medusa":
        return None
    crossed = ("" if longest is None else
               f"; this run's longest context is {longest} tokens, so it is {'' if longest > window else 'not '}crossed")
    return (f"the target {getattr(target, 'name', '')} has a sliding window of {window} tokens on every layer, and "
            f"vLLM puts it on the drafter's attention too, where the head was trained on the whole context: past "
            f"{window} tokens of context the served head accepts as draftkit's loop under vLLM's rule does "
            f"(`eval --engine vllm` applies the window), not as draftkit's own drafting modes measure{crossed}")

