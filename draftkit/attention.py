"""Grouped-query attention without copying the KV cache, for targets run on CPU.

transformers' "sdpa" attention expands every key/value head to the query heads (`repeat_kv`,
a full copy of the cache) whenever an attention mask is passed, because CUDA's fused kernels
cannot take a mask and GQA together. Padded batches (response regeneration) and the verify
loop's ragged caches always pass a mask, so on CPU that copy is the largest single cost of a
decode step (benchmarks/generation_throughput.py, SmolLM2-135M bf16, both in one run: 2.6x the
response tokens/s at batch 64, 1.09x at 16; logits bit-identical, tests/test_attention.py).
PyTorch's CPU kernel takes the mask and `enable_gqa=True` together, so on CPU we register the
same attention with the grouping left to the kernel: transformers' own `AttentionInterface` and
`AttentionMaskInterface` (the sdpa mask), nothing patched.
"""
from __future__ import annotations

import torch

NAME = "draftkit_sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, **kwargs):
    """query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D); returns (B, Tq, Hq, D), None."""
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal) and query.shape[2] > 1 and attention_mask is None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
        scale=scaling, is_causal=is_causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_gqa_attention(model) -> bool:
    """Switch a CPU model using sdpa with grouped KV heads to NAME; True when switched."""
    cfg = model.config
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if (model.device.type != "cpu" or getattr(cfg, "_attn_implementation", None) != "sdpa"
            or not heads or not kv or heads == kv or getattr(cfg, "attn_logit_softcapping", None)):
        return False
    model.set_attn_implementation(register())
    return True
