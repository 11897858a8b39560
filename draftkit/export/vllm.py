"""vLLM layouts: what vLLM's draft-model loaders read, family by family.

Each table cites the vLLM file it follows. vLLM prefixes non-lm_head names with `model.` itself and
stacks q/k/v and gate/up while loading, so checkpoints keep transformers' per-projection names.
"""
from __future__ import annotations

import torch

from draftkit.export.formats import (
    Context, ExportError, Layout, Shapes, check_shared, llama_config_in, llama_config_out, llama_layer_shapes, refuse,
    refuse_target, register,
    zero_bias_dropped)

# ---- EAGLE-1 ---------------------------------------------------------------------------------------
# vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM / LlamaModel):
#   fc = Linear(2H, H, bias=False); layers.{i} = LlamaDecoderLayer with layer 0's input_layernorm
#   replaced by Identity; output = hidden + residual (no final norm); embed_tokens and lm_head are
#   shared from the target (embed_tokens.* is skipped when PP == 1; there is no lm_head param).
EAGLE_NAMES = (("fc.", "fc."), ("layers.{i}.", "layers.{i}."))


def eagle_shapes(c: dict, fc_bias: bool = False) -> Shapes:
    H = c["hidden_size"]
    s: Shapes = {"fc.weight": (H, 2 * H)}
    if fc_bias:
        s["fc.bias"] = (H,)
    for i in range(c["num_hidden_layers"]):
        s.update(llama_layer_shapes(f"layers.{i}.", c, input_norm=i > 0))
    return s


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
# Aux layer ids: vllm/v1/worker/gpu_model_runner.py (_get_eagle3_aux_layers_from_config) reads
#   config.eagle_aux_hidden_state_layer_ids (or eagle_config[...]) as is, and
#   vllm/model_executor/models/llama.py captures `hidden_states + residual` BEFORE layer idx:
#   draftkit's convention. Before layer 0 residual is still None, so 0 cannot be captured there.
EAGLE3_NAMES = (("fc.", "fc."), ("midlayer.", "midlayer."), ("norm.", "norm."), ("lm_head.", "lm_head."),
                ("d2t", "d2t"), ("t2d", "t2d"))
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
GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")
GEMMA_EMBEDDING = ("the target scales its token embedding by sqrt(hidden_size) inside the model and the head "
                   "was trained on that, but {src} embeds draft tokens with the target's embed_tokens unscaled")
refuse_target("vllm", ("eagle", "eagle3"), GEMMA_TYPES,
              GEMMA_EMBEDDING.format(src="vllm/model_executor/models/llama_eagle*.py")
              + " (and vLLM's gemma3.py implements no SupportsEagle3)")
