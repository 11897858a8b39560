"""The vllm-project/speculators format: a speculators config.json + model.safetensors.

Config classes: speculators src/speculators/config.py (SpeculatorModelConfig, SpeculatorsConfig,
VerifierConfig) and src/speculators/models/<algo>/config.py; vLLM reads the same files through
vllm/transformers_utils/configs/speculators/{base,algos}.py.
"""
from __future__ import annotations

from draftkit.export.layout import Context, ExportError, Layout, Shapes, refuse, refuse_target, register
from draftkit.export.llama_drafts import (GEMMA_EMBEDDING, GEMMA_TYPES, VLLM_LAYERS, eagle3_config_in,
                                          eagle3_config_out, eagle3_shapes, eagle3_tensors_in, eagle3_tensors_out)

# speculators ships model classes for eagle3, mtp, dflash, dspark and peagle (src/speculators/models/);
# EAGLE-1 and Medusa have none there, and vLLM's speculators algos.py registers no updater for them.
refuse("speculators", "eagle", "the speculators package has no EAGLE-1 model class "
       "(src/speculators/models has eagle3, mtp, dflash, peagle); export --format vllm or sglang")
refuse("speculators", "medusa", "the speculators package has no Medusa model class; export --format vllm")
refuse("speculators", "mtp", "speculators' MTP model classes are built for qwen3-family layers "
       "(src/speculators/models/mtp/model_definitions.py) and draftkit's MTP depth is a llama layer")

# ---- EAGLE-3 -------------------------------------------------------------------------------------
# speculators src/speculators/models/eagle3/config.py (Eagle3SpeculatorConfig) and core.py
# (Eagle3DraftModel): fc, layers.0 (LlamaDecoderEagle3FirstLayer: q/k/v over 2H, hidden_norm),
# norm, lm_head (draft_vocab_size rows), d2t / t2d buffers; embed_tokens and verifier_* are not
# saved (taken from the verifier). vLLM serves it through vllm/transformers_utils/configs/
# speculators/algos.py (update_eagle3), which defaults norm_before_residual to TRUE when absent and
# passes eagle_aux_hidden_state_layer_ids through unchanged to llama_eagle3.py (vLLM's convention,
# the same as draftkit's).
SPECULATIVE_TOKENS = 3  # proposal_methods[0].speculative_tokens: vLLM's default num_speculative_tokens
SPEC_NAMES = (("fc.", "fc."), ("midlayer.", "layers.0."), ("norm.", "norm."), ("lm_head.", "lm_head."),
              ("d2t", "d2t"), ("t2d", "t2d"))


def layer_config(c: dict) -> dict:
    """The draft's transformer_layer_config (every speculators algorithm nests the draft's layer config there)."""
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ExportError("config.json: speculators config without a transformer_layer_config mapping")
    return tl


def speculators_config(algorithm: str, speculative_tokens: int, n: dict, ctx: Context) -> dict:
    """The `speculators_config` block of every speculators algorithm: one greedy proposal method of
    `speculative_tokens` drafts, and the verifier, the exact model the head was trained against as
    an engine resolves it (export/verifier.py; else the target's recorded name)."""
    t = n.get("target") or {}
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": (ctx.verifier or {}).get("name_or_path") or t.get("name"),
                     "architectures": [t["architecture"]] if t.get("architecture") else []},
    }


def _eagle3_shapes(c: dict) -> Shapes:
    tl = layer_config(c)
    flat = {**tl, "draft_vocab_size": c.get("draft_vocab_size"), "num_hidden_layers": tl.get("num_hidden_layers", 1)}
    if c.get("target_hidden_size"):
        flat["target_hidden_size"] = c["target_hidden_size"]
    shapes = eagle3_shapes(flat)
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in shapes.items()}


def _eagle3_out(n: dict, ctx: Context) -> dict:
    flat = eagle3_config_out(n, "LlamaForCausalLMEagle3")
    layer = {k: v for k, v in flat.items() if k not in ("architectures", "draft_vocab_size", "norm_before_residual",
                                                         "eagle_aux_hidden_state_layer_ids", "rope_scaling")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": speculators_config("eagle3", SPECULATIVE_TOKENS, n, ctx),
        "transformer_layer_config": layer,
        "draft_vocab_size": n["draft_vocab_size"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(n["feature_layers"]),
    }


def _eagle3_in(c: dict, ctx: Context) -> dict:
    if c.get("speculators_model_type") != "eagle3":
        raise ExportError(f"config.json: speculators_model_type {c.get('speculators_model_type')!r} is not 'eagle3'")
    if c.get("target_hidden_size") not in (None, layer_config(c)["hidden_size"]):
        raise ExportError("config.json: target_hidden_size differs from the draft's hidden size; draftkit's "
                          "EAGLE-3 head has the target's width")
    flat = {**layer_config(c), "draft_vocab_size": c.get("draft_vocab_size"),
            "norm_before_residual": c.get("norm_before_residual", True)}
    return eagle3_config_in(flat, ctx, c.get("eagle_aux_hidden_state_layer_ids"))


register(Layout(
    format="speculators", family="eagle3", source="speculators src/speculators/models/eagle3/{config,core}.py",
    names=SPEC_NAMES, config_out=_eagle3_out, config_in=_eagle3_in, expected=_eagle3_shapes,
    optional=lambda c: {"embed_tokens.weight": (layer_config(c)["vocab_size"], layer_config(c)["hidden_size"])},
    tensors_out=eagle3_tensors_out, tensors_in=eagle3_tensors_in, layer_convention=VLLM_LAYERS,
    d2t_convention="offset: target_id = draft_id + d2t[draft_id] (speculators DraftVocabMixin, vLLM llama_eagle3.py)"))
refuse_target("speculators", ("eagle3",), GEMMA_TYPES,
              GEMMA_EMBEDDING.format(src="speculators' Eagle3 draft (and vLLM's llama_eagle3.py serving it)")
              + "; vLLM's gemma3.py implements no SupportsEagle3")
