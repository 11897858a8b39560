"""Magpie-style prompt synthesis: let the target write the user turn itself.

Feed an aligned chat model its template up to the user header ("<|im_start|>user\\n") and it
samples a plausible user request, ending it with the end-of-turn token (Xu et al. 2024, Magpie).
No dataset needed, and the prompts come from the target's own idea of what users ask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from draftkit.config import SynthesisSettings

from .context import DataContext
from .regenerate import end_of_turn_ids
from .sources import Prompt

log = logging.getLogger(__name__)

_MARKER = "XXXX_MAGPIE_USER_XXXX"


def magpie_prefix(tokenizer) -> str:
    """The chat template rendered up to where the first user message's content would start."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Magpie prompt synthesis needs a chat template and this tokenizer has none (a base "
                         "model?): give raw-text prompts instead (training: data.sources with data.format: text; "
                         "draftkit eval: --prompts FILE.txt)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in text:
        raise ValueError("chat template does not render the user message; cannot build a Magpie prefix")
    return text[: text.index(_MARKER)]


def synthesize_prompts(model, tokenizer, n: int, settings: SynthesisSettings | None = None, *, seed: int = 0,
                       max_attempts: int | None = None, progress: bool = True) -> list[Prompt]:
    """Sample up to `n` distinct user prompts from the target (nothing cached).

    Kept: turns that end with an end-of-turn token, are settings.min_chars..max_chars long and not
    a duplicate (case and whitespace folded). Stops after max_attempts samples (default 4n +
    batch_size) and warns with the count when fewer than n survive. Counts are logged.
    """
    prompts, counts = _synthesize(model, tokenizer, n, settings or SynthesisSettings(), seed,
                                  max_attempts=max_attempts, progress=progress)
    log.info("magpie: generated %(generated)d, unfinished %(unfinished)d, duplicates "
             "%(duplicates)d, length-filtered %(filtered)d, kept %(kept)d", counts)
    return prompts


def _synthesize(model, tokenizer, n: int, settings: SynthesisSettings, seed: int, *, max_attempts: int | None,
                progress: bool, batch_dir: Path | None = None, vllm: dict | None = None) -> tuple[list[Prompt], dict]:
    """batch_dir: where each sampled batch is kept, so an interrupted synthesis continues.
    vllm {model_dir, dtype, llm_kwargs}: the samples come from vLLM (one engine for all batches,
    stopped once n prompts are kept), else from `model.generate`."""
    prefix = tokenizer(magpie_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    stops = sorted(end_of_turn_ids(tokenizer))
    max_attempts = max_attempts or 4 * n + settings.batch_size
    counts = dict(generated=0, unfinished=0, duplicates=0, filtered=0, kept=0)
    seen, prompts = set(), []
    bar = tqdm(total=n, desc="magpie", unit="prompt", disable=not progress)
    batches = (_vllm_batches(prefix, stops, settings, seed, max_attempts, batch_dir, **vllm) if vllm else
               _hf_batches(model, tokenizer, prefix, stops, settings, seed, max_attempts, batch_dir))
    for rows in batches:
        counts["generated"] += len(rows)
        for row in rows:
            end = next((j for j, t in enumerate(row) if t in stops), None)
            if end is None:
                counts["unfinished"] += 1
                continue
            text = tokenizer.decode(row[:end], skip_special_tokens=True).strip()
            norm = re.sub(r"\s+", " ", text.lower())
            if not settings.min_chars <= len(text) <= settings.max_chars:
                counts["filtered"] += 1
            elif norm in seen:
                counts["duplicates"] += 1
            elif len(prompts) < n:
                seen.add(norm)
                digest = hashlib.sha256(text.encode()).hexdigest()[:12]
                prompts.append(Prompt([{"role": "user", "content": text}], "synthesized", f"magpie:{digest}"))
                bar.update(1)
        if len(prompts) >= n:
            break
    batches.close()  # vLLM: stops the engine
    bar.close()
    counts["kept"] = len(prompts)
    if len(prompts) < n:
        log.warning("magpie: only %d of %d prompts after %d samples (%s)", len(prompts), n,
                    counts["generated"], counts)
    return prompts, counts


def _batch_file(batch_dir: Path | None, start: int, size: int) -> Path | None:
    return batch_dir / f"batch-{start}-{size}.json" if batch_dir else None


def _keep_batch(path: Path | None, rows: list[list[int]]) -> None:
    if path is not None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, path)


@torch.inference_mode()
def _hf_batches(model, tokenizer, prefix: list[int], stops: list[int], settings: SynthesisSettings, seed: int,
                max_attempts: int, batch_dir: Path | None) -> Iterator[list[list[int]]]:
    """Sampled rows, batch_size at a time (batch b reseeds with seed + its first row's index), each
    read from batch_dir when an earlier run kept it."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    start = 0
    while start < max_attempts:
        bs = min(settings.batch_size, max_attempts - start)
        path = _batch_file(batch_dir, start, bs)
        if path is not None and path.is_file():  # finished before an interruption
            rows = json.loads(path.read_text())
        else:
            torch.manual_seed(seed + start)
            input_ids = torch.tensor([prefix] * bs, device=model.device)  # (B, T_prefix), no padding
            rows = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=settings.max_new_tokens, do_sample=True, temperature=settings.temperature,
                top_p=settings.top_p, top_k=0, eos_token_id=stops, pad_token_id=pad,
            )[:, len(prefix):].tolist()  # (B, T_new)
            _keep_batch(path, rows)
        yield rows
        start += bs


def _vllm_batches(prefix: list[int], stops: list[int], settings: SynthesisSettings, seed: int, max_attempts: int,
                  batch_dir: Path | None, model_dir: str, dtype: str,
                  llm_kwargs: dict) -> Iterator[list[list[int]]]:
    """The same batches sampled by vLLM (row i seeded with seed + i): the kept ones first, then one
    engine for all the rest, each chunk of batch_size kept as it finishes."""
    from draftkit.engines.vllm_data import DataSampling, generate_responses

    start = 0
    while start < max_attempts:
        path = _batch_file(batch_dir, start, min(settings.batch_size, max_attempts - start))
        if path is None or not path.is_file():
            break
        rows = json.loads(path.read_text())
        yield rows
        start += len(rows)
    if start >= max_attempts:
        return
    sampling = DataSampling(settings.temperature, settings.top_p, settings.max_new_tokens, stops)
    chunks = generate_responses(model_dir, dtype, [prefix] * (max_attempts - start),
                                [seed + i for i in range(start, max_attempts)], sampling,
                                chunk_size=settings.batch_size, llm_kwargs=llm_kwargs)
    try:
        for _, rows in chunks:
            _keep_batch(_batch_file(batch_dir, start, len(rows)), rows)
            yield rows
            start += len(rows)
    finally:
        chunks.close()


def synthesize_cached(ctx: DataContext, n: int, settings: SynthesisSettings) -> list[Prompt]:
    """`synthesize_prompts` once per (target, settings, seed, n) of ctx: rank 0 writes, all ranks read.

    Other ranks wait in `ctx.barrier()` while rank 0 synthesizes.
    """
    vllm = _vllm_settings(ctx)
    engine = {} if vllm is None else {"engine": "vllm", "dtype": vllm["dtype"]}  # hf keys stay as they were
    how = {k: v for k, v in asdict(settings).items() if k != "fraction"}  # how many is n's business, not the key's
    key = json.dumps({"target": ctx.target_id, "seed": ctx.seed, "n": n, **how, **engine}, sort_keys=True)
    path = ctx.cache_dir / f"prompts-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"
    # Raw sampled batches do not depend on n: a larger n reuses them, an interrupted run continues.
    batch_key = json.dumps({"target": ctx.target_id, "seed": ctx.seed, **how, **engine}, sort_keys=True)
    batch_dir = ctx.cache_dir / f"magpie-{hashlib.sha256(batch_key.encode()).hexdigest()[:16]}"
    if ctx.rank == 0 and not path.exists():
        batch_dir.mkdir(parents=True, exist_ok=True)
        prompts, counts = _synthesize(ctx.model, ctx.tokenizer, n, settings, ctx.seed, max_attempts=None,
                                      progress=ctx.progress, batch_dir=batch_dir, vllm=vllm)
        log.info("magpie: %s", counts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))
        os.replace(tmp, path)
    ctx.wait_for_ranks("synthesize_cached")
    lines = path.read_text().splitlines()[:n]
    return [Prompt(**json.loads(line)) for line in lines]


def _vllm_settings(ctx: DataContext) -> dict | None:
    """{model_dir, dtype, llm_kwargs} when ctx's responses engine is vLLM (synthesis goes through it
    too, so stage 1 needs no HF decoder), else None."""
    from .regenerate import engine_of, model_dtype

    if engine_of(ctx.data.responses, getattr(ctx.model, "config", None)) != "vllm":
        return None
    if not ctx.model_dir:
        raise ValueError("data.responses.engine: vllm synthesizes prompts with vLLM, which needs the target as a "
                         "model directory (target.path); this run has none")
    return {"model_dir": ctx.model_dir, "dtype": model_dtype(ctx.model), "llm_kwargs": dict(ctx.data.responses.vllm)}
