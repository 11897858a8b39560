"""Regenerate responses with the frozen target, cached on disk by content.

A draft head learns to predict what *the target* says, so every training response is the target's
own answer to the prompt (self-distillation), not the dataset's reply, unless the recipe asks for
the dataset's own (data.responses.mode: keep, `kept_replies`).

Cache layout: `cache_dir/responses-<settings fingerprint>/<batch hash>.jsonl`, one file per
generated batch, written atomically (temp file + `os.replace`), one record per prompt keyed by
sha256(prompt messages, target id, generation settings). A rerun reads every file and generates
only the prompts without a record, so an interrupted run continues where it stopped, and ranks
of a multi-process run share one directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from draftkit.prompts import end_of_turn_ids, stop_token_ids  # noqa: F401  (re-exported)

from .sources import Prompt

log = logging.getLogger(__name__)
FAULT_KILL = "DRAFTKIT_FAULT_KILL_AFTER_BATCH"  # SIGKILL after writing that many response batches (tests only)


@dataclass
class GenerationSettings:
    # Longest response in tokens; a response cut here is marked `truncated`.
    max_new_tokens: int = 256
    # Sampling temperature; 0 is greedy. Default 0: EAGLE-style heads are trained and evaluated on
    # the target's greedy continuations (Spec-Bench measures greedy decoding).
    temperature: float = 0.0
    # Nucleus sampling threshold (used when temperature > 0).
    top_p: float = 1.0
    # Prompts per `generate` call (prompts are sorted by length first, so a batch pads little).
    # SmolLM2-135M bf16 on two CPU cores: the recipes' length-sorted batches of 64 ran at ~170
    # response tok/s (grounded prompts, recipes/eagle.yaml's log); benchmarks/generation_throughput.py
    # compares batch sizes and attentions in one run. Raise it on a GPU. Not part of the cache key.
    batch_size: int = 16
    # Seed of the sampler (each batch reseeds with seed + batch index). Part of the cache key.
    seed: int = 0
    # "regenerate": the target answers every prompt (self-distillation). "keep": train on the
    # sources' own replies (ShareGPT / OpenAI messages whose last user turn is answered), features
    # from one prefill and no generation, as the EAGLE paper did; prompts without a reply are
    # skipped, and a run where none has one (prompt-only files, synthesized prompts) is refused.
    # Keep does not combine with data.grounded (its passages must be the target's own text).
    mode: Literal["regenerate", "keep"] = "regenerate"
    # "refill": a row whose response ended takes the next prompt at once (distill/refill.py; greedy
    # gives the same tokens); "batch": `model.generate` per batch of batch_size (a batch runs until its
    # longest response ends). Refill measured 504 vs 325 response tok/s at batch 64 (SmolLM2 bf16, two
    # cores, benchmarks/results/generation_throughput_recipe.json): the recipes set it. Not part of
    # the cache key.
    scheduler: Literal["batch", "refill"] = "batch"

    def fingerprint(self, target_id: str) -> str:
        """Everything that decides a response, except the prompt. batch_size, mode and scheduler are left out."""
        d = dataclasses.asdict(self)
        for key in ("batch_size", "mode", "scheduler"):
            d.pop(key)
        return json.dumps({"target": target_id, **d}, sort_keys=True)


@dataclass
class Conversation:
    # The prompt that was answered.
    prompt: Prompt
    # The target's response text, without the end-of-turn token.
    response: str
    # True when the response hit max_new_tokens before the target ended its turn.
    truncated: bool
    # Tokens the target generated, the end-of-turn token included.
    num_tokens: int

    @property
    def messages(self) -> list[dict]:
        return self.prompt.messages + [{"role": "assistant", "content": self.response}]


def regenerate(
    model, tokenizer, prompts: list[Prompt], settings: GenerationSettings, cache_dir: Path, *,
    target_id: str, rank: int = 0, world_size: int = 1, barrier: Callable[[], None] | None = None,
    progress: bool = True, fmt: str = "chat",
) -> list[Conversation]:
    """Answer every prompt with the target (or read the answer from the cache), in prompt order.

    fmt "chat" renders prompts with the chat template, "text" feeds their raw text (distill/text.py).

    With world_size > 1 rank r generates the uncached prompts i with i % world_size == r, then
    `barrier()` is called and every rank reads all results from the shared `cache_dir`.
    """
    cache = _cache_dir(cache_dir, settings, target_id)
    keys = [response_key(p, settings, target_id, fmt) for p in prompts]
    done = read_cached(cache)
    todo = [i for i, k in enumerate(keys) if k not in done and i % world_size == rank]
    if todo:
        _generate_into_cache(model, tokenizer, [prompts[i] for i in todo], [keys[i] for i in todo],
                             settings, cache, progress=progress and rank == 0, fmt=fmt)
    if world_size > 1:
        if barrier is None:
            raise ValueError("regenerate: world_size > 1 needs a barrier to share results")
        barrier()
    done = read_cached(cache)
    missing = [p.id for p, k in zip(prompts, keys) if k not in done]
    if missing:
        raise RuntimeError(f"regenerate: {len(missing)} responses missing from {cache}, e.g. {missing[:3]}")
    return [Conversation(p, done[k]["response"], done[k]["truncated"], done[k]["num_tokens"])
            for p, k in zip(prompts, keys)]


def responses(model, tokenizer, prompts: list[Prompt], settings: GenerationSettings, cache_dir: Path,
              **kw) -> list[Conversation]:
    """The response to train on for every prompt: regenerated by the target, or (mode keep) the
    source's own reply. kw: those of `regenerate`."""
    if settings.mode == "regenerate":
        return regenerate(model, tokenizer, prompts, settings, cache_dir, **kw)
    return kept_replies(tokenizer, prompts)


def kept_replies(tokenizer, prompts: list[Prompt]) -> list[Conversation]:
    """data.responses.mode keep: each prompt's own reply as its response (no generation).

    Prompts without a reply are skipped (logged); ValueError when none has one.
    """
    kept = [p for p in prompts if p.reply is not None]
    if prompts and not kept:
        raise ValueError(f"data.responses.mode: keep needs sources whose records carry a reply to the last "
                         f"user turn (ShareGPT conversations / OpenAI messages ending in an assistant turn); "
                         f"none of the {len(prompts)} prompts (e.g. {prompts[0].id}) has one; "
                         f"use mode: regenerate")
    if len(kept) < len(prompts):
        log.warning("data.responses.mode keep: %d of %d prompts have no reply and are skipped",
                    len(prompts) - len(kept), len(prompts))
    return [Conversation(p, p.reply, False, len(tokenizer(p.reply, add_special_tokens=False)["input_ids"]) + 1)
            for p in kept]


def response_key(prompt: Prompt, settings: GenerationSettings, target_id: str, fmt: str = "chat") -> str:
    payload = {"messages": prompt.messages, "settings": settings.fingerprint(target_id)}
    if fmt != "chat":  # the same prompt as raw text is another input (chat keys stay as they were)
        payload["format"] = fmt
    payload = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def read_cached(cache: Path) -> dict[str, dict]:
    """All records under one settings directory, by key. Unfinished temp files are ignored."""
    out = {}
    for f in sorted(cache.glob("*.jsonl")) if cache.exists() else []:
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            out[rec["key"]] = rec
    return out


def _cache_dir(cache_dir: Path, settings: GenerationSettings, target_id: str) -> Path:
    tag = hashlib.sha256(settings.fingerprint(target_id).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"responses-{tag}"


def _generate_into_cache(model, tokenizer, prompts, keys, settings, cache: Path, progress: bool, fmt: str = "chat"):
    from .text import completion_ids

    cache.mkdir(parents=True, exist_ok=True)
    ids = [completion_ids(tokenizer, p.messages) if fmt == "text" else
           chat_ids(tokenizer, p.messages, add_generation_prompt=True) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))  # similar lengths: less padding
    bar = tqdm(total=len(prompts), desc="regenerate", unit="prompt", disable=not progress)
    n_tokens, t0 = 0, time.perf_counter()
    for n, done in enumerate(_finished(model, tokenizer, ids, order, settings), start=1):
        records = [{"key": keys[i], "id": prompts[i].id, **o} for i, o in done]
        _write_atomic(cache, records)
        if os.environ.get(FAULT_KILL) == str(n):  # the kill-and-rerun tests
            os.kill(os.getpid(), signal.SIGKILL)
        n_tokens += sum(o["num_tokens"] for _, o in done)
        bar.update(len(done))
        bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()


def _finished(model, tokenizer, ids: list[list[int]], order: list[int], settings) -> Iterator[list[tuple[int, dict]]]:
    """Groups of up to batch_size (prompt index, result), as settings.scheduler finishes them."""
    if settings.scheduler == "refill":
        from .refill import generate_refill

        group = []
        for j, result in generate_refill(model, tokenizer, [ids[i] for i in order], settings):
            group.append((order[j], result))
            if len(group) == settings.batch_size:
                yield group
                group = []
        if group:
            yield group
        return
    for b in range(0, len(order), settings.batch_size):
        batch = order[b: b + settings.batch_size]
        torch.manual_seed(settings.seed + b // settings.batch_size)
        yield list(zip(batch, generate_batch(model, tokenizer, [ids[i] for i in batch], settings)))


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False))


@torch.inference_mode()
def generate_batch(model, tokenizer, prompt_ids: list[list[int]], settings: GenerationSettings) -> list[dict]:
    """Left-padded batched `model.generate`; responses end at a stop token or max_new_tokens."""
    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    width = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=model.device)
    sample = settings.temperature > 0
    out = model.generate(  # top_k=0: no top-k cut (HF's default would be 50)
        input_ids=input_ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens,
        do_sample=sample, temperature=settings.temperature if sample else None,
        top_p=settings.top_p if sample else None, top_k=0 if sample else None,
        eos_token_id=stops, pad_token_id=pad,
    )[:, width:]  # (B, T_new)
    results = []
    for row in out.tolist():
        end = next((j for j, t in enumerate(row) if t in stops), None)
        tokens = row if end is None else row[: end + 1]
        results.append({
            "response": tokenizer.decode(tokens[: end] if end is not None else tokens, skip_special_tokens=True),
            "truncated": end is None,
            "num_tokens": len(tokens),
        })
    return results


def _write_atomic(cache: Path, records: list[dict]) -> None:
    name = hashlib.sha256("".join(r["key"] for r in records).encode()).hexdigest()[:20]
    tmp = cache / f".{name}.{os.getpid()}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, cache / f"{name}.jsonl")
