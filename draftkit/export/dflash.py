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
_read_mask_embedding loads it with weights_only and substitutes it where the input id is the mask id).
"""
from __future__ import annotations

import io

import torch

from draftkit.export.formats import (Context, ExportError, Layout, Shapes, llama_config_out, llama_layer_shapes,
                                     register)

NAMES = (("fc.", "fc."), ("hidden_norm.", "hidden_norm."), ("layers.{i}.", "layers.{i}."), ("norm.", "norm."),
         ("lm_head.", "lm_head."), ("d2t", "d2t"))
MASK_FILE = "mask_embedding.pt"
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
    return s


def config_out(n: dict, ctx: Context) -> dict:
    layers = list(n["feature_layers"])
    if min(layers) < 1:
        raise ExportError(f"feature_layers {layers}: vLLM's DFlash ids name a layer's output (ours - 1), so "
                          "0 (the embeddings) and -1 (the final norm) have no vLLM id")
    c = {**llama_config_out(n, n["num_layers"]), "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
         "block_size": n["block_size"],
         "dflash_config": {"mask_token_id": n["mask_token_id"], "target_layer_ids": [i - 1 for i in layers]},
         "num_target_layers": (n.get("target") or {}).get("num_layers")}
    if n.get("draft_vocab_size"):
        c["draft_vocab_size"] = n["draft_vocab_size"]
    return c


def tensors_out(state: dict, ctx: Context) -> dict:
    """Drop mask_embedding (it goes to mask_embedding.pt) and, over the full vocabulary, d2t / t2d
    (the identity); with a draft vocabulary store the target's lm_head rows vLLM reads."""
    state = {k: v for k, v in state.items() if k not in ("mask_embedding", "t2d")}
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
    raise ExportError("importing vLLM's DFlash layout is not supported yet (the mask embedding, "
                      "mask_embedding.pt, is not read back); keep the native head directory")


register(Layout(
    format="vllm", family="dflash", source="vllm/model_executor/models/qwen3_dflash.py",
    names=NAMES, config_out=config_out, config_in=config_in, expected=dflash_shapes,
    tensors_out=tensors_out, files_out=files_out, layer_ids_out=lambda ids: [i - 1 for i in ids],
    layer_convention=LAYERS,
    d2t_convention="offset: target_id = draft_id + d2t[draft_id] (qwen3_dflash.py compute_logits)"))
