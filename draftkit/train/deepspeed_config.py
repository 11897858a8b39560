"""DeepSpeed config: the user's own JSON, completed from the recipe where it is silent.

The user's DeepSpeed section wins for everything it names (ZeRO stage, offload, precision, batch
sizes, clipping, optimizer). The recipe fills what is missing, so a plain recipe needs no DeepSpeed
knowledge and an existing DeepSpeed JSON works unchanged.
"""
from __future__ import annotations

import copy
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from draftkit.config import ConfigError, Recipe, TrainConfig
from draftkit.target import native_bf16  # the one dtype rule (target.dtype: auto uses it too)


def build_deepspeed_config(recipe: Recipe, world_size: int, on_cuda: bool) -> dict:
    ds = copy.deepcopy(recipe.deepspeed) if isinstance(recipe.deepspeed, dict) else {}
    t = recipe.train
    micro = ds.setdefault("train_micro_batch_size_per_gpu", t.micro_batch_size)
    accum = ds.setdefault("gradient_accumulation_steps", t.grad_accum)
    want = micro * accum * world_size
    if ds.setdefault("train_batch_size", want) != want:
        raise ConfigError(f"deepspeed.train_batch_size={ds['train_batch_size']} != micro batch {micro} x "
                          f"accumulation {accum} x {world_size} processes = {want}")
    if t.grad_clip > 0:
        ds.setdefault("gradient_clipping", t.grad_clip)
    ds.setdefault("optimizer", {"type": "AdamW", "params": {
        "lr": t.lr, "betas": list(t.betas), "weight_decay": t.weight_decay,
        # torch's AdamW: no fused-Adam build on CPU; on CUDA DeepSpeed's fused kernel is faster.
        "torch_adam": not on_cuda}})
    if not on_cuda:
        for key in ("bf16", "fp16"):  # mixed precision engines need an accelerator
            if ds.get(key, {}).get("enabled"):
                raise ConfigError(f"deepspeed.{key}.enabled: needs a GPU; on CPU set train.autocast: bfloat16 "
                                  "(fp32 weights, bf16 matmuls) or leave the head in fp32")
    ds.setdefault("steps_per_print", 10 ** 9)  # our progress bar reports; keep DeepSpeed quiet
    ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def lr_lambda(t: TrainConfig):
    """Warmup (linear from 0) then cosine / linear decay to min_lr_ratio at max_steps, or constant."""
    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape
    return f


def make_scheduler(t: TrainConfig):
    """A callable DeepSpeed calls with its optimizer; its state is saved in DeepSpeed checkpoints."""
    return lambda optimizer: LambdaLR(optimizer, lr_lambda(t))


def head_autocast(t: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The dtype the head's forward/backward runs under torch.autocast, or None for plain fp32
    ("auto": draftkit.target.native_bf16, the rule target.dtype: auto follows)."""
    if t.autocast == "bfloat16" or (t.autocast == "auto" and native_bf16(device)):
        return torch.bfloat16
    return None
