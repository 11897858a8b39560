"""vLLM's DFlash layout (vllm/model_executor/models/qwen3_dflash.py, DFlashQwen3ForCausalLM, 0.32).

config.json: a Qwen3 config of the draft (num_hidden_layers = the head's layers, the target's widths,
rope of the target: vLLM would otherwise default rope_theta to 1e6) with `architectures:
["DFlashDraftModel"]` (registry.py), `block_size`, and `dflash_config = {mask_token_id,
target_layer_ids}`; target_layer_ids name the target layer whose OUTPUT is read, ours minus 1
(get_eagle3_aux_layers_from_config adds the 1 back). No layer_types / is_causal: every layer full
and non-causal, DFlash's block attention.
Tensors (load_weights prefixes `model.`, stacks q/k/v and gate/up): fc.weight (H, G*H),
hidden_norm.weight, norm.weight, layers.{i}.* of a Qwen3 layer (q_norm / k_norm of head_dim).
embed_tokens and lm_head are the target's (_maybe_share_lm_head, embed sharing), unless the head
drafts over a reduced vocabulary: then lm_head.weight (N, H) holds the target's rows of the draft
tokens and d2t (N,) the offsets (compute_logits: target id = draft id + d2t), draft_vocab_size N.
The trained mask embedding goes to mask_embedding.pt ({"mask_token_id", "embedding"}, torch.save:
_read_mask_embedding loads it with weights_only and substitutes it where the input id is the mask id),
and, for the import back, into the weights as `mask_embedding` (vLLM loads it as model.mask_embedding,
the same values). Import also reads published z-lab drafts (no mask_embedding, no contract): their
mask slots carry the target's embedding row of mask_token_id, which becomes our mask_embedding.
"""
from __future__ import annotations

import io

import torch

from draftkit.export.layout import Context, ExportError, Layout, Shapes, register
from draftkit.export.llama_drafts import d2t_to_t2d, llama_config_in, llama_config_out, llama_layer_shapes

NAMES = (("fc.", "fc."), ("hidden_norm.", "hidden_norm."), ("layers.{i}.", "layers.{i}."), ("norm.", "norm."),
         ("lm_head.", "lm_head."), ("d2t", "d2t"), ("mask_embedding", "mask_embedding"))
MASK_FILE = "mask_embedding.pt"
MASK_IN_WEIGHTS = "draftkit_mask_embedding_in_weights"  # config key (vLLM keeps unknown keys, reads none)
LAYERS = ("vLLM DFlash: dflash_config.target_layer_ids = the target layer whose output is read "
          "(= draftkit's id - 1); vLLM adds 1 (eagle3_utils.get_eagle3_aux_layers_from_config)")


def dflash_shapes(c: dict) -> Shapes:
    """The draft checkpoint tensors DFlashQwen3ForCausalLM builds and loads from a config.json."""
    H, V = c["hidden_size"], c["vocab_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    G = len((c.get("dflash_config") or {}).get("target_layer_ids") or ())
    if not G:
        raise ExportError("config.json: dflash_config.target_layer_ids is empty (vLLM then reads every layer)")
    s: Shapes = {"fc.weight": (H, G * c.get("target_hidden_size", H)), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        s.update(llama_layer_shapes(f"layers.{i}.", c))
        s[f"layers.{i}.self_attn.q_norm.weight"] = (hd,)
        s[f"layers.{i}.self_attn.k_norm.weight"] = (hd,)
    N = c.get("draft_vocab_size") or V
    if N != V:
        s.update({"lm_head.weight": (N, H), "d2t": (N,)})
    if c.get(MASK_IN_WEIGHTS):  # ours: the trained mask vector, also in the weights (vLLM loads it
        s["mask_embedding"] = (H,)  # as model.mask_embedding, the same values as mask_embedding.pt)
    return s


def config_out(n: dict, ctx: Context) -> dict:
    layers = list(n["feature_layers"])
    if min(layers) < 1:
        raise ExportError(f"feature_layers {layers}: vLLM's DFlash ids name a layer's output (ours - 1), so "
                          "0 (the embeddings) and -1 (the final norm) have no vLLM id")
    c = {**llama_config_out(n, n["num_layers"]), "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
         "block_size": n["block_size"],
         "dflash_config": {"mask_token_id": n["mask_token_id"], "target_layer_ids": [i - 1 for i in layers]},
         "num_target_layers": (n.get("target") or {}).get("num_layers"), MASK_IN_WEIGHTS: True}
    if n.get("draft_vocab_size"):
        c["draft_vocab_size"] = n["draft_vocab_size"]
    return c


def tensors_out(state: dict, ctx: Context) -> dict:
    """Drop t2d (vLLM skips it) and, over the full vocabulary, d2t (the identity); with a draft
    vocabulary store the target's lm_head rows vLLM reads. mask_embedding stays (see dflash_shapes)."""
    state = {k: v for k, v in state.items() if k != "t2d"}
    if not ctx.native.get("draft_vocab_size"):
        state.pop("d2t")
        return state
    t = ctx.need_target("this head drafts over a reduced vocabulary: vLLM reads the target's lm_head rows from the file")
    ids = torch.arange(state["d2t"].shape[0]) + state["d2t"].long()
    state["lm_head.weight"] = t.lm_head.weight.detach().cpu()[ids].to(state["fc.weight"].dtype)
    return state


def files_out(state: dict, ctx: Context) -> dict[str, bytes]:
    buf = io.BytesIO()
    torch.save({"mask_token_id": ctx.native["mask_token_id"], "embedding": state["mask_embedding"].detach().cpu()}, buf)
    return {MASK_FILE: buf.getvalue()}


def config_in(c: dict, ctx: Context) -> dict:
    """Native fields of a vLLM-layout DFlash draft (ours, or a published z-lab one)."""
    dc = c.get("dflash_config") or {}
    causal = c.get("is_causal", dc.get("causal"))
    if causal or dc.get("use_swa") or "sliding_attention" in (c.get("layer_types") or ()):
        raise ExportError("config.json: causal or sliding-window draft layers; draftkit's DFlash layers are "
                          "full and non-causal (bidirectional within the block)")
    if c.get("target_hidden_size", c["hidden_size"]) != c["hidden_size"] or dc.get("attention_sink_bias"):
        raise ExportError("config.json: target_hidden_size differs from hidden_size, or attention sinks: not "
                          "draftkit's DFlash")
    for key in ("mask_token_id", "target_layer_ids"):
        if dc.get(key) is None:
            raise ExportError(f"config.json: dflash_config.{key} is missing")
    V, N = c["vocab_size"], c.get("draft_vocab_size") or c["vocab_size"]
    return {**llama_config_in(c), "num_layers": c["num_hidden_layers"], "block_size": c.get("block_size", 16),
            "mask_token_id": dc["mask_token_id"], "feature_layers": [i + 1 for i in dc["target_layer_ids"]],
            "draft_vocab_size": N if N != V else None}


def tensors_in(state: dict, ctx: Context) -> dict:
    """Back to the native tensors: t2d from d2t (or the identity), lm_head rows checked against the
    target's and dropped, and for a published draft (no mask_embedding) the target's embedding row."""
    n, V = ctx.native, ctx.native["vocab_size"]
    if "d2t" in state:
        lm = state.pop("lm_head.weight")
        t = ctx.need_target("checking the stored lm_head rows (draftkit's DFlash reads the target's)")
        ids = torch.arange(state["d2t"].shape[0]) + state["d2t"].long()
        if not torch.equal(lm, t.lm_head.weight.detach().cpu()[ids].to(lm.dtype)):
            raise ExportError("lm_head.weight: not the target's rows of the draft tokens; draftkit's DFlash "
                              "drafts with the target's frozen lm_head")
        state["d2t"], state["t2d"] = state["d2t"].long(), d2t_to_t2d(state["d2t"], V)
    else:
        state["d2t"], state["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    if "mask_embedding" not in state:  # the z-lab convention: the target's row of mask_token_id
        t = ctx.need_target("the draft embeds its mask slots with the target's embedding row")
        state["mask_embedding"] = t.embed_tokens.weight.detach().cpu()[n["mask_token_id"]].to(state["fc.weight"].dtype)
    return state


register(Layout(
    format="vllm", family="dflash", source="vllm/model_executor/models/qwen3_dflash.py",
    names=NAMES, config_out=config_out, config_in=config_in, expected=dflash_shapes,
    optional=lambda c: {"mask_embedding": (c["hidden_size"],)},
    tensors_out=tensors_out, tensors_in=tensors_in, files_out=files_out,
    layer_ids_out=lambda ids: [i - 1 for i in ids], layer_ids_in=lambda ids: [i + 1 for i in ids],
    layer_convention=LAYERS,
    d2t_convention="offset: target_id = draft_id + d2t[draft_id] (qwen3_dflash.py compute_logits)"))
