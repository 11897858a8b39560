"""Inference: the draft-verify loop, the rejection sampler (torch reference + Triton kernels),
evaluation."""
