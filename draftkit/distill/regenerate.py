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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from draftkit.config import GenerationSettings
from draftkit.prompts import end_of_turn_ids, stop_token_ids  # noqa: F401  (re-exported)

from .context import DataContext
from .sources import Prompt
from .text import completion_ids

log = logging.getLogger(__name__)
FAULT_KILL = "DRAFTKIT_FAULT_KILL_AFTER_BATCH"  # SIGKILL after writing that many response batches (tests only)


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


def regenerate(ctx: DataContext, prompts: list[Prompt], settings: GenerationSettings) -> list[Conversation]:
    """Answer every prompt with the target (or read the answer from the cache), in prompt order.

    ctx.fmt "chat" renders prompts with the chat template, "text" feeds their raw text (distill/text.py).

    With ctx.world_size > 1 rank r generates the uncached prompts i with i % world_size == r, then
    waits in ctx.barrier() and every rank reads all results from the shared ctx.cache_dir.
    """
    settings = resolved(settings, getattr(ctx.model, "config", None))
    dtype = model_dtype(ctx.model)
    cache = _cache_dir(ctx.cache_dir, settings, ctx.target_id, dtype)
    keys = [response_key(p, settings, ctx.target_id, ctx.fmt, dtype) for p in prompts]
    done = read_cached(cache)
    todo = [i for i, k in enumerate(keys) if k not in done and i % ctx.world_size == ctx.rank]
    if todo and settings.engine == "vllm":
        _vllm_into_cache(ctx, [prompts[i] for i in todo], [keys[i] for i in todo], todo, settings, cache, dtype)
    elif todo:
        _generate_into_cache(ctx.model, ctx.tokenizer, [prompts[i] for i in todo], [keys[i] for i in todo],
                             settings, cache, progress=ctx.progress and ctx.rank == 0, fmt=ctx.fmt)
    ctx.wait_for_ranks("regenerate")
    done = read_cached(cache)
    missing = [p.id for p, k in zip(prompts, keys) if k not in done]
    if missing:
        raise RuntimeError(f"regenerate: {len(missing)} responses missing from {cache}, e.g. {missing[:3]}")
    return [Conversation(p, done[k]["response"], done[k]["truncated"], done[k]["num_tokens"])
            for p, k in zip(prompts, keys)]


_ENGINES: dict[tuple, str] = {}  # (engine, the vLLM environment variables, refusal) -> the engine used


def engine_of(settings: GenerationSettings, config=None) -> str:
    """The engine that answers: settings.engine, "auto" resolved (engines/vllm_data.resolve_engine)
    once per process, vLLM environment and verdict on the target, the choice and its reason logged
    that once. `config`: the target's HF config, judged by vllm_data.cpu_refusal when it regenerates:
    auto then answers with hf for a target vLLM's CPU attention cannot serve, and vllm asked for
    one is refused (ValueError). Without a config (or mode keep, which generates nothing) the
    target is not judged."""
    if settings.engine == "hf":
        return "hf"
    from draftkit.engines.vllm import PYTHON_ENV
    from draftkit.engines.vllm_data import ENGINE_ENV, cpu_refusal, resolve_engine

    refusal = cpu_refusal(config) if settings.mode == "regenerate" else None
    where = (settings.engine, *(os.environ.get(k) for k in (ENGINE_ENV, PYTHON_ENV, "DRAFTKIT_CACHE")), refusal)
    if where not in _ENGINES:
        _ENGINES[where], why = resolve_engine(settings.engine, refusal=refusal)
        if settings.engine == "auto":
            log.info(why)
    return _ENGINES[where]


def resolved(settings: GenerationSettings, config=None) -> GenerationSettings:
    """settings with engine auto replaced by the engine used (engine_of, judging `config`): what
    cache keys and fingerprints record."""
    engine = engine_of(settings, config)
    return settings if engine == settings.engine else dataclasses.replace(settings, engine=engine)


def responses(ctx: DataContext, prompts: list[Prompt], settings: GenerationSettings) -> list[Conversation]:
    """The response to train on for every prompt: regenerated by the target, or (mode keep) the
    source's own reply."""
    if settings.mode == "regenerate":
        return regenerate(ctx, prompts, settings)
    return kept_replies(ctx.tokenizer, prompts)


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


def model_dtype(model) -> str | None:
    """"float32", "bfloat16", ... of the model that answers (None without one): part of the cache key."""
    p = next(model.parameters(), None) if model is not None else None
    return None if p is None else str(p.dtype).removeprefix("torch.")


def response_key(prompt: Prompt, settings: GenerationSettings, target_id: str, fmt: str = "chat",
                 dtype: str | None = None) -> str:
    """sha256 of the prompt and everything that decides its response (settings.fingerprint: the
    target, its dtype, the engine, the sampling)."""
    payload = {"messages": prompt.messages, "settings": settings.fingerprint(target_id, dtype)}
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


def _cache_dir(cache_dir: Path, settings: GenerationSettings, target_id: str, dtype: str | None = None) -> Path:
    tag = hashlib.sha256(settings.fingerprint(target_id, dtype).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"responses-{tag}"


def _generate_into_cache(model, tokenizer, prompts, keys, settings, cache: Path, progress: bool, fmt: str = "chat"):
    cache.mkdir(parents=True, exist_ok=True)
    ids = prompt_ids(tokenizer, prompts, fmt)
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


def prompt_ids(tokenizer, prompts: list[Prompt], fmt: str = "chat") -> list[list[int]]:
    """The token ids the target continues: the chat template with its generation prompt, or (fmt
    "text") the raw text. Both engines are fed these."""
    return [completion_ids(tokenizer, p.messages) if fmt == "text" else
            chat_ids(tokenizer, p.messages, add_generation_prompt=True) for p in prompts]


def _vllm_into_cache(ctx: DataContext, prompts, keys, positions: list[int], settings, cache: Path, dtype: str):
    """engine vllm: this rank's prompts answered by vLLM (vLLM serves the whole share, continuous
    batching), each finished chunk of batch_size cached at once. Prompt positions[j] (its index in
    the prompt list, the same on every rank and rerun) samples with seed + positions[j]."""
    from draftkit.engines.vllm_data import DataSampling, generate_responses

    from .refill import _result

    if not ctx.model_dir:
        raise ValueError("data.responses.engine: vllm needs the target as a model directory vLLM loads "
                         "(target.path: a safetensors directory, a GGUF or a hub id); this run has none")
    cache.mkdir(parents=True, exist_ok=True)
    stops = stop_token_ids(ctx.model, ctx.tokenizer)
    sampling = DataSampling(settings.temperature, settings.top_p, settings.max_new_tokens, list(stops))
    chunks = generate_responses(ctx.model_dir, dtype, prompt_ids(ctx.tokenizer, prompts, ctx.fmt),
                                [settings.seed + i for i in positions], sampling, chunk_size=settings.batch_size,
                                llm_kwargs=settings.vllm)
    bar = tqdm(total=len(prompts), desc="regenerate (vllm)", unit="prompt", disable=not (ctx.progress and ctx.rank == 0))
    for n, (idx, outputs) in enumerate(chunks, start=1):
        _write_atomic(cache, [{"key": keys[j], "id": prompts[j].id, **_result(ctx.tokenizer, out, set(stops))}
                              for j, out in zip(idx, outputs)])
        if os.environ.get(FAULT_KILL) == str(n):  # the kill-and-rerun tests
            os.kill(os.getpid(), signal.SIGKILL)
        bar.update(len(idx))
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
