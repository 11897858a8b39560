"""The run around a distillation step: who answers, with which data settings, cached where, by which rank.

    ctx = DataContext(model, tokenizer, cache_dir, target_id="smollm2:ab12", data=recipe.data)
    convs, holdout, stats = prepare_conversations(ctx, num_samples=1000)
    more = regenerate(ctx, prompts, ctx.data.responses)

Every step (distill/samples.py, regenerate.py, synthesize.py) takes one; what a caller varies from
call to call (a count, the prompts, the settings of that step) stays an argument.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftkit.config import DataConfig


@dataclass
class DataContext:
    # The target's transformer (it generates) and its tokenizer.
    model: Any
    tokenizer: Any
    # Where responses and synthesized prompts are cached, keyed by content and shared by every rank.
    cache_dir: Path
    # "<name>:<fingerprint>" of the target: part of every cache key.
    target_id: str
    # The recipe's data section: sources (empty = Magpie synthesis), synthesize, responses,
    # grounded, holdout, max_length, overlong, loss_on (what prepare_conversations/_samples read).
    data: DataConfig = field(default_factory=DataConfig)
    # How prompts reach the target, resolved from data.format: "chat" (its chat template) or
    # "text" (raw text, completion mode: distill/text.py resolve_format).
    fmt: str = "chat"
    # Seed of prompt mixing, Magpie synthesis and grounded tasks (the recipe's train.seed).
    seed: int = 0
    # This process's share: rank r of world_size generates the uncached prompts i with
    # i % world_size == r, then every rank waits in barrier() and reads all from the shared cache.
    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] | None = None
    # Progress bars (a run shows them on rank 0 only).
    progress: bool = True
    # The target as a directory (or hub id) a serving engine loads: data.responses.engine vllm.
    model_dir: str | None = None

    def __post_init__(self):
        self.cache_dir = Path(self.cache_dir)

    def wait_for_ranks(self, who: str) -> None:
        """Every rank's writes to the cache are done when this returns (a no-op on one process)."""
        if self.world_size > 1:
            if self.barrier is None:
                raise ValueError(f"{who}: world_size > 1 needs a barrier to share results")
            self.barrier()
