"""Run in vLLM's own venv (tests/test_dflash_head.py starts it): build vLLM's DFlashQwen3ForCausalLM
for TARGET_DIR + DRAFT_DIR (a draftkit `--format vllm` export) exactly as vLLM's config code resolves
it, fill every parameter with NaN, run vLLM's own load_weights over the export's safetensors (and
its mask_embedding.pt), and print one JSON line: the parameters left unset, the sharing flags, and
each vLLM parameter as a flat list (the test compares them with the native head's tensors)."""
import json
import os
import sys

import torch
from safetensors.torch import load_file
from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config


def main(target: str, draft: str, port: str) -> None:
    mc = ModelConfig(model=target, dtype="float32", enforce_eager=True)
    sc = SpeculativeConfig(method="dflash", model=draft, num_speculative_tokens=3, target_model_config=mc,
                           target_parallel_config=ParallelConfig())
    vc = VllmConfig(model_config=mc, speculative_config=sc)
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = DFlashQwen3ForCausalLM(vllm_config=vc)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan")) if p.is_floating_point() else p.fill_(-7)
        model.load_weights(iter(load_file(os.path.join(draft, "model.safetensors")).items()))
    unset = sorted(n for n, p in model.named_parameters()
                   if bool(p.isnan().any() if p.is_floating_point() else (p == -7).any()))
    print(json.dumps({
        "unset": unset, "has_own_lm_head": bool(getattr(model, "has_own_lm_head", False)),
        "has_own_embed_tokens": bool(getattr(model, "has_own_embed_tokens", False)),
        "separate_mask_embedding": bool(model.model.has_separate_mask_embedding),
        "mask_token_id": model.model.mask_token_id, "causal": model.get_draft_attn_causal(),
        "aux_layers": list(get_eagle3_aux_layers_from_config(sc) or []),  # the target layers vLLM captures
        "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if n not in unset},
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
