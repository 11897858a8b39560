"""Process group setup that works under `deepspeed`, `torchrun` and plain `python`."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arch_list_for_deepspeed(arch: str) -> str:
    """`TORCH_CUDA_ARCH_LIST` with each entry's letter suffix dropped ("9.0a" -> "9.0"; "+PTX" and the
    separators kept).

    DeepSpeed 0.19's JIT op builder parses every entry as `int.int`, so an image that sets "9.0a" (NVIDIA's
    Hopper images do) fails fused Adam's build with `int('0a')`. The "a" variant only adds
    architecture-specific instructions that fused Adam does not use."""
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", arch)


def init_distributed() -> Dist:
    """Join (or, for plain `python`, create) the process group; gloo on CPU, nccl on CUDA.

    A port this function picks itself is removed from the environment once the group holds it, so a
    process started from this one (a `python run.py` from a notebook or a test) picks its own instead of
    inheriting a port that is already bound (EADDRINUSE)."""
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    own_port = "MASTER_PORT" not in os.environ
    if own_port:
        os.environ["MASTER_PORT"] = str(free_port())
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch and arch_list_for_deepspeed(arch) != arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list_for_deepspeed(arch)
        print(f"[draftkit] TORCH_CUDA_ARCH_LIST {arch!r} -> {os.environ['TORCH_CUDA_ARCH_LIST']!r}: "
              "DeepSpeed's JIT builder reads each entry as int.int", flush=True)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo")
    if own_port:  # the port is held by this process's store from here on: a child must not inherit it
        del os.environ["MASTER_PORT"]
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if on_cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if on_cuda else torch.device("cpu")
    return Dist(rank, world, local, device)


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def any_true(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any rank (a NaN on one rank stops all)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def mean_across(values: dict[str, float], device: torch.device) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
        t /= torch.distributed.get_world_size()
    return dict(zip(keys, t.tolist()))


def sum_across(t: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of `t` over all ranks (a copy; `t` itself when not distributed)."""
    if torch.distributed.is_initialized():
        t = t.clone()
        torch.distributed.all_reduce(t)
    return t
