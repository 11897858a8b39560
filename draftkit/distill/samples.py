"""Token samples with a loss mask, and `prepare_samples`: the one call the trainer makes.

A sample is the whole conversation rendered by the tokenizer's chat template. `loss_mask` is 1
exactly on the tokens the target generated: the assistant response plus the end-of-turn token
that closes it, never the template's role header, the prompt or earlier (dataset) replies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .grounded import GroundedSettings, grounded_prompts
from .regenerate import Conversation, GenerationSettings, chat_ids, end_of_turn_ids, regenerate
from .sources import Prompt, PromptSource, load_prompts
from .synthesize import SynthesisSettings, synthesize_cached
from .text import tokenize_completion

log = logging.getLogger(__name__)


def build_samples(
    tokenizer, conversations: list[Conversation], max_length: int, overlong: str = "truncate",
    fmt: str = "chat",
) -> tuple[list[dict], dict]:
    """Tokenize conversations into {input_ids, loss_mask}; `overlong` is "truncate" or "drop";
    fmt "text": raw-text prompt + continuation (distill/text.py), else the chat template.

    Truncation cuts from the right. A sample left without any assistant token is dropped.
    Returns (samples, stats) with stats: kept, truncated, dropped_overlong, dropped_no_assistant,
    dropped_template, tokens, assistant_tokens.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    stats = dict(kept=0, truncated=0, dropped_overlong=0, dropped_no_assistant=0,
                 dropped_template=0, tokens=0, assistant_tokens=0)
    samples = []
    for conv in conversations:
        sample = tokenize_completion(tokenizer, conv) if fmt == "text" else tokenize_conversation(tokenizer, conv)
        if sample is None:
            stats["dropped_template"] += 1
            continue
        if len(sample["input_ids"]) > max_length:
            if overlong == "drop":
                stats["dropped_overlong"] += 1
                continue
            sample = {k: v[:max_length] for k, v in sample.items()}
            stats["truncated"] += 1
        if not any(sample["loss_mask"]):
            stats["dropped_no_assistant"] += 1
            continue
        samples.append(sample)
        stats["kept"] += 1
        stats["tokens"] += len(sample["input_ids"])
        stats["assistant_tokens"] += sum(sample["loss_mask"])
    return samples, stats


def tokenize_conversation(tokenizer, conv: Conversation) -> dict | None:
    """{input_ids, loss_mask} of one conversation, or None when the template defeats the mask.

    The prompt rendered with add_generation_prompt=True must be a token prefix of the full
    conversation; the response then runs from there to the first end-of-turn token (included).
    Whatever the template adds after that token (a newline, say) stays out of the loss. A
    truncated response never produced an end-of-turn token, so its closing token is masked out.
    """
    prompt = chat_ids(tokenizer, conv.prompt.messages, add_generation_prompt=True)
    full = chat_ids(tokenizer, conv.messages, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        log.warning("prompt %s: chat template prompt is not a token prefix of the conversation",
                    conv.prompt.id)
        return None
    eot = end_of_turn_ids(tokenizer)
    end = next((j for j in range(len(prompt), len(full)) if full[j] in eot), None)
    if end is None:  # a template that closes the turn with no special token: mask to the end
        end = len(full) - 1
    stop = end if conv.truncated else end + 1
    mask = [0] * len(prompt) + [1] * (stop - len(prompt)) + [0] * (len(full) - stop)
    return {"input_ids": full, "loss_mask": mask}


def prepare_samples(
    model, tokenizer, *,
    sources: list[PromptSource] | None,
    num_samples: int,
    num_holdout: int,
    max_length: int,
    overlong: str = "truncate",
    generation: GenerationSettings | None = None,
    synthesis: SynthesisSettings | None = None,
    grounded: GroundedSettings | None = None,
    cache_dir: Path,
    target_id: str,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    progress: bool = True,
    fmt: str = "chat",
) -> tuple[list[dict], list[Prompt], dict]:
    """Prompts -> target responses -> token samples, sized to the run.

    num_plain + num_holdout prompts are loaded from `sources` (or synthesized from the target,
    Magpie-style, when `sources` is None), num_plain = num_samples minus the grounded share. The
    first num_holdout are held aside for evaluation and never trained on; the target answers the
    others, and then the grounded prompts built from those answers (distill/grounded.py).
    fmt "text" (completion mode, distill/text.py) needs `sources`: Magpie synthesis needs a chat template.
    Returns (train_samples, holdout_prompts, stats).
    """
    if fmt == "text" and not sources:
        raise ValueError(
            "data.sources is empty, so prompts would be synthesized Magpie-style, which needs a chat template, "
            "and this run is in completion mode (data.format: text: a base model, or a target without a chat "
            "template). Give raw-text prompts: data.sources: [{path: corpus.txt}] (.txt/.md paragraphs, code "
            "files or a directory of them, JSONL records with a `text` field, a dataset with a `text` column)")
    generation = generation or GenerationSettings()
    grounded = grounded or GroundedSettings()
    num_grounded = round(num_samples * grounded.fraction)
    if fmt == "text" and num_grounded:  # its tasks are chat instructions ("Summarize ..."): no use to a base model
        log.warning("data.grounded.fraction %s ignored in completion mode (data.format: text)", grounded.fraction)
        num_grounded = 0
    need = num_samples - num_grounded + num_holdout
    if sources:
        prompts = load_prompts(sources, limit=need, seed=seed)
    else:
        prompts = synthesize_cached(model, tokenizer, need, synthesis or SynthesisSettings(),
                                    Path(cache_dir), target_id=target_id, seed=seed, rank=rank,
                                    world_size=world_size, barrier=barrier, progress=progress)
    holdout, train = prompts[:num_holdout], prompts[num_holdout:]
    common = dict(target_id=target_id, rank=rank, world_size=world_size, barrier=barrier, progress=progress, fmt=fmt)
    convs = regenerate(model, tokenizer, train, generation, Path(cache_dir), **common)
    if num_grounded:
        tasks = grounded_prompts(convs, num_grounded, grounded, seed=seed)
        convs = convs + regenerate(model, tokenizer, tasks, generation, Path(cache_dir), **common)
    samples, stats = build_samples(tokenizer, convs, max_length, overlong, fmt)
    stats.update(prompts=len(prompts) + num_grounded, holdout=len(holdout), grounded=num_grounded,
                 responses_truncated=sum(c.truncated for c in convs),
                 response_tokens=sum(c.num_tokens for c in convs),
                 source="synthesized" if not sources else [asdict(s) for s in sources])
    if stats["kept"] < num_samples:
        log.warning("prepared %d training samples of the %d asked for", stats["kept"], num_samples)
    return samples, holdout, stats
