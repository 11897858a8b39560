"""Checkpoints through DeepSpeed, plus what DeepSpeed does not keep: data position and RNG states.

Layout: <output_dir>/checkpoints/step<N>/ (DeepSpeed's files + rng_rank<r>.pt) and
<output_dir>/checkpoints/LATEST naming the newest *complete* one. LATEST is replaced atomically
only after every rank has finished writing, so a crash mid-save leaves the previous checkpoint
as the one `resume: auto` picks up. Resuming needs every file, the RNG states included (a step
that draws random numbers, e.g. head.feature_noise, would otherwise continue differently).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from draftkit.train.distributed import barrier

LATEST = "LATEST"
FAULT_KILL_DURING_SAVE = "DRAFTKIT_FAULT_KILL_DURING_SAVE"  # SIGKILL halfway through saving that step (tests only)


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run (another recipe, missing files)."""


def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # Plain tensors and numbers only, so torch.load(weights_only=True) reads it back.
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def rng_unchanged():
    """Run the block without moving the caller's RNG streams (torch, CUDA, Python, numpy). Stage 1
    reseeds the global generators (regenerate, synthesize) and runs only for what its caches lack,
    so without this a run's random numbers would depend on whether the caches were warm."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def save(engine, root: Path, step: int, client_state: dict, rank: int, keep: int) -> Path:
    tag = f"step{step}"
    (root / tag).mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), root / tag / f"rng_rank{rank}.pt")
    if rank == 0:
        (root / tag / "draftkit_state.json").write_text(json.dumps(client_state))
    if os.environ.get(FAULT_KILL_DURING_SAVE) == str(step):  # the kill-during-save test: DeepSpeed's files unwritten
        os.kill(os.getpid(), signal.SIGKILL)
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    barrier()  # every rank's shards are on disk before LATEST moves
    if rank == 0:
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / LATEST)
        for old in sorted(_tags(root), key=_step_of)[:-keep] if keep > 0 else []:
            shutil.rmtree(root / old, ignore_errors=True)
    barrier()
    return root / tag


def _tags(root: Path) -> list[str]:
    return [p.name for p in root.glob("step*") if p.is_dir()]


def _step_of(tag: str) -> int:
    return int(tag.removeprefix("step"))


def latest(root: Path) -> str | None:
    marker = root / LATEST
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    return tag if (root / tag).is_dir() else None


def load(engine, root: Path, tag: str, rank: int, recipe_hash: str) -> dict:
    """Restore weights, optimizer, scheduler and RNG; return the client state (step, ...)."""
    state_file = root / tag / "draftkit_state.json"
    if not state_file.is_file():
        raise ResumeError(f"{state_file}: missing; {root / tag} is not a draftkit checkpoint")
    saved = json.loads(state_file.read_text()).get("recipe_hash")
    if saved != recipe_hash:  # checked before DeepSpeed reads any tensor: a clear error, not a shape mismatch
        raise ResumeError(
            f"{root / tag}: written by another recipe (hash {saved}, this run {recipe_hash}); "
            "use a new output_dir or train.resume=none")
    rng_file = root / tag / f"rng_rank{rank}.pt"
    if not rng_file.is_file():  # without it the run would continue with other random numbers
        raise ResumeError(f"{rng_file}: missing; {root / tag} lacks rank {rank}'s RNG state and cannot continue "
                          "this run exactly (use another checkpoint, a new output_dir or train.resume=none)")
    path, client = engine.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise ResumeError(f"{root / tag}: DeepSpeed could not load this checkpoint")
    set_rng_state(torch.load(rng_file, weights_only=True))
    return client
