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
the same values). vLLM feeds the mask slots as the input id dflash_config.mask_token_id and replaces
EVERY input equal to it, the anchor (the newest confirmed token) included: the id should be one the
text never holds (heads/dflash.py, mask_token_id). Serving: vLLM's DFlash proposer runs 1 +
num_speculative_tokens query slots, so num_speculative_tokens = block_size - 1 serves the trained
block; a smaller k serves a shorter one (DFlashHead.engine_block drafts the same way in our loop). Import also reads published z-lab drafts (no mask_embedding, no contract): their
mask slots carry the target's embedding row of mask_token_id, which becomes our mask_embedding.
"""
from __future__ import annotations

import io

import torch

from draftkit.export.layout import Context, ExportError, Layout, Shapes, refuse_target, register
from draftkit.export.llama_drafts import (GEMMA_EMBEDDING, GEMMA_TYPES, d2t_to_t2d, llama_config_in,
                                          llama_config_out, llama_layer_shapes)
from draftkit.export.speculators import layer_config, speculators_config

NAMES = (("fc.", "fc."), ("hidden_norm.", "hidden_norm."), ("layers.{i}.", "layers.{i}."), ("norm.", "norm."),
         ("lm_head.", "lm_head."), ("d2t", "d2t"), ("mask_embedding", "mask_embedding"))
MASK_FILE = "mask_embedding.pt"
MASK_IN_WEIGHTS = "draftkit_mask_embedding_in_weights"  # config key (vLLM keeps unknown keys, reads none)
LAYERS = ("vLLM DFlash: dflash_config.target_layer_ids = the target layer whose output is read "
          "(= draftkit's id - 1); vLLM adds 1 (eagle3_utils.get_eagle3_aux_layers_from_config)")


# z-lab's published drafts (z-lab/dflash dflash/model.py, DFlashDraftModel and its `_draft_value`):
# block_size, mask_token_id and target_layer_ids are read from dflash_config first, then from the top
# level (Qwen3-8B-DFlash-b16 has block_size at the top and the other two in dflash_config; the
# DFlash2 checkpoints, z-lab/dflash tests/fixtures/dflash2-config.json, carry block_size inside
# dflash_config). z-lab's id i reads hidden_states[i + 1] (extract_context_feature): draftkit's i + 1.
# Logit or input scalings z-lab's code applies (output_multiplier, final_logit_softcapping,
# input_embedding_scale) are not draftkit's DFlash: refused unless neutral.
ZLAB_NEUTRAL = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}


def dflash_field(c: dict, name: str):
    """A DFlash field as z-lab's loader finds it: dflash_config.<name>, else the top-level <name>."""
    dc = c.get("dflash_config") or {}
    return dc[name] if dc.get(name) is not None else c.get(name)


def dflash_shapes(c: dict) -> Shapes:
    """The draft checkpoint tensors DFlashQwen3ForCausalLM builds and loads from a config.json."""
    H, V = c["hidden_size"], c["vocab_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    G = len(dflash_field(c, "target_layer_ids") or ())
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
    for key, neutral in ZLAB_NEUTRAL.items():
        if dflash_field(c, key) not in (None, neutral):
            raise ExportError(f"config.json: {key} = {dflash_field(c, key)!r} (z-lab scales the draft's inputs or "
                              "logits by it); draftkit's DFlash has no such scaling")
    for key in ("block_size", "mask_token_id", "target_layer_ids"):
        if dflash_field(c, key) is None:
            raise ExportError(f"config.json: {key} is missing (looked for dflash_config.{key} and a top-level "
                              f"{key}, where z-lab's DFlashDraftModel reads it)")
    n_target = c.get("num_target_layers")
    if n_target is not None and ctx.target is not None and n_target != ctx.target.num_layers:
        raise ExportError(f"config.json: num_target_layers = {n_target}, but target {ctx.target.name} has "
                          f"{ctx.target.num_layers} layers (the draft was trained on another target)")
    return native_fields(c, int(dflash_field(c, "block_size")), dflash_field(c, "mask_token_id"),
                         [i + 1 for i in dflash_field(c, "target_layer_ids")], c.get("draft_vocab_size"))


def native_fields(layer: dict, block_size: int, mask_token_id: int, feature_layers: list[int],
                  draft_vocab_size: int | None) -> dict:
    """The native DFlash config of a draft, from its Qwen3 layer config and the DFlash fields (ids in
    draftkit's convention): both layouts' config_in. draft_vocab_size equal to the vocabulary = none."""
    V = layer["vocab_size"]
    N = draft_vocab_size or V
    return {**llama_config_in(layer), "num_layers": layer["num_hidden_layers"], "block_size": block_size,
            "mask_token_id": mask_token_id, "feature_layers": list(feature_layers),
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
# The anchor slot embeds the confirmed token with the target's embed_tokens (qwen3_dflash.py
# embed_input_ids), unscaled; and the DFlash proposer reads the target's aux hidden states, which
# vLLM's gemma3.py (no SupportsEagle3) does not hand out.
refuse_target("vllm", ("dflash",), GEMMA_TYPES,
              GEMMA_EMBEDDING.format(src="vllm/model_executor/models/qwen3_dflash.py")
              + " (and vLLM's gemma3.py implements no SupportsEagle3)")


# ---- speculators (src/speculators/models/dflash/{config,core}.py, 0.9) ---------------------------
# DFlashSpeculatorConfig: transformer_layer_config (a Qwen3 config of the draft), draft_vocab_size
# (default 32000: always written), block_size, aux_hidden_state_layer_ids (vLLM's algos.py
# update_dflash makes dflash_config.target_layer_ids = these - 1: draftkit's own convention),
# mask_token_id. DFlashDraftModel holds the tensors of the vLLM layout under the same names (t2d / d2t
# buffers and lm_head only with a draft vocabulary); embed_tokens, verifier_norm and verifier_lm_head
# come from the verifier. It embeds the mask slots with embed_tokens[mask_token_id], the verifier's
# row: there is no separate mask vector, so only a head whose mask_embedding IS that row exports
# (head.train_mask_embedding: false). sliding_window_non_causal: true, because vLLM's update_dflash
# turns its absence (or false) into dflash_config.causal = true for EVERY layer, while speculators'
# full-attention layers (ours) are always bidirectional; no sliding layers, so it changes nothing there.
SPEC_MASK = ("speculators' DFlashDraftModel embeds the mask slots with the verifier's embedding row of "
             "mask_token_id and has no separate mask vector")


def speculators_shapes(c: dict) -> Shapes:
    flat = {**layer_config(c), "draft_vocab_size": c.get("draft_vocab_size"),
            "dflash_config": {"target_layer_ids": c.get("aux_hidden_state_layer_ids")}}
    s = dflash_shapes(flat)
    if "d2t" in s:
        s["t2d"] = (flat["vocab_size"],)
    return s


def speculators_config_out(n: dict, ctx: Context) -> dict:
    flat = config_out(n, ctx)
    keep = ("architectures", "block_size", "dflash_config", "num_target_layers", MASK_IN_WEIGHTS, "draft_vocab_size")
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "speculators_config": speculators_config("dflash", n["block_size"] - 1, n, ctx),
        "transformer_layer_config": {k: v for k, v in flat.items() if k not in keep},
        "draft_vocab_size": n.get("draft_vocab_size") or n["vocab_size"], "block_size": n["block_size"],
        "aux_hidden_state_layer_ids": list(n["feature_layers"]), "mask_token_id": n["mask_token_id"],
        "sliding_window_non_causal": True, "sample_from_anchor": False,
    }


def speculators_config_in(c: dict, ctx: Context) -> dict:
    if c.get("speculators_model_type") != "dflash":
        raise ExportError(f"config.json: speculators_model_type {c.get('speculators_model_type')!r} is not 'dflash'")
    if c.get("sample_from_anchor"):
        raise ExportError("config.json: sample_from_anchor true (the anchor slot drafts too); draftkit's "
                          "DFlash drafts from the mask slots only")
    tl = layer_config(c)
    if c.get("target_hidden_size") not in (None, tl["hidden_size"]) or "sliding_attention" in (tl.get("layer_types") or ()):
        raise ExportError("config.json: target_hidden_size differs from hidden_size, or sliding draft layers: "
                          "not draftkit's DFlash")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id"):
        if c.get(key) is None:
            raise ExportError(f"config.json: {key} is missing")
    return {**native_fields(tl, c.get("block_size", 8), c["mask_token_id"], c["aux_hidden_state_layer_ids"],
                            c.get("draft_vocab_size")), "train_mask_embedding": False}


def speculators_tensors_out(state: dict, ctx: Context) -> dict:
    """The vLLM layout's tensors (the target's lm_head rows with a draft vocabulary) and t2d beside
    d2t (speculators' buffers); the mask vector leaves, after checking it is the target's row."""
    t = ctx.need_target(f"checking the mask embedding against the target's row ({SPEC_MASK})")
    mid, mask = ctx.native["mask_token_id"], state["mask_embedding"]
    if not torch.equal(mask, t.embed_tokens.weight.detach().cpu()[mid].to(mask.dtype)):
        raise ExportError(f"mask_embedding: this head trained its own mask vector, but {SPEC_MASK}; train with "
                          "head.train_mask_embedding: false for the speculators format, or export --format vllm "
                          "(mask_embedding.pt)")
    out = tensors_out({**state}, ctx)
    out.pop("mask_embedding")
    if "d2t" in out:
        out["t2d"] = state["t2d"]
    return out


register(Layout(
    format="speculators", family="dflash", source="speculators src/speculators/models/dflash/{config,core}.py",
    names=NAMES + (("t2d", "t2d"),), config_out=speculators_config_out, config_in=speculators_config_in,
    expected=speculators_shapes, tensors_out=speculators_tensors_out, tensors_in=tensors_in,
    layer_convention="speculators DFlash: aux_hidden_state_layer_ids = draftkit's ids (vLLM's algos.py "
                     "update_dflash subtracts 1 for dflash_config.target_layer_ids)",
    d2t_convention="offset: target_id = draft_id + d2t[draft_id] (speculators DraftVocabMixin)"))
refuse_target("speculators", ("dflash",), GEMMA_TYPES,
              GEMMA_EMBEDDING.format(src="speculators' DFlashDraftModel (and vLLM's qwen3_dflash.py serving it)"))
