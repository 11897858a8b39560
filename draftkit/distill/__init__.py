"""Distillation data: prompts (files, datasets or Magpie synthesis) -> target responses -> samples.

    prompts = load_prompts([PromptSource("data.jsonl")], limit=1000, seed=0)
    ctx = DataContext(model, tokenizer, cache_dir, target_id=...)
    convs = regenerate(ctx, prompts, GenerationSettings())
    samples, stats = build_samples(tokenizer, convs, max_length=2048)

or all of it, sized to the run, with `prepare_samples(DataContext(..., data=recipe.data), num_samples)`;
as a resumable stage on disk (parquet shards + manifest, what the trainer reads) with
`draftkit prepare` (distill/prepare.py). The settings classes are the recipe's (draftkit/config.py).
"""

from draftkit.config import GenerationSettings, GroundedSettings, PromptSource, SynthesisSettings

from .context import DataContext
from .grounded import grounded_prompts
from .regenerate import Conversation, read_cached, regenerate
from .samples import build_samples, prepare_samples, tokenize_conversation
from .sources import Prompt, load_prompts
from .synthesize import magpie_prefix, synthesize_cached, synthesize_prompts

__all__ = [
    "Conversation", "DataContext", "GenerationSettings", "GroundedSettings", "Prompt", "PromptSource",
    "SynthesisSettings",
    "build_samples", "grounded_prompts", "load_prompts", "magpie_prefix", "prepare_samples", "read_cached",
    "regenerate", "synthesize_cached", "synthesize_prompts", "tokenize_conversation",
]
