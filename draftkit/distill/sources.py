"""Prompt sources: JSON/JSONL files, `save_to_disk` directories, hub datasets or raw text -> `Prompt`s.

Every dataset source goes through `datasets`, imported only when a source is read (so
`draftkit.distill` imports without it). A record's shape is recognised from its columns, and turned
into chat messages, by `draftkit.prompts` (the table of shapes is there), which `draftkit eval`
shares. Raw-text files (.txt, .md, code) and directories of them are read by
`draftkit.prompts.read_text_prompts`: prompts for completion mode (`data.format: text`).
A `streaming` source is read lazily (larger than memory): only as many records as the run needs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from draftkit.config import PromptSource
from draftkit.prompts import detect_shape, read_text_prompts, record_id, to_messages, to_reply

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    # Chat messages ({"role", "content"}) up to and including the user turn the target answers.
    messages: list[dict]
    # The dataset's category label (MT-bench / Spec-Bench style), None when it has none.
    category: str | None
    # Stable id, "<source label>:<record id or index>".
    id: str
    # Passages inside `messages` that are the target's own text (a grounded task's passage is the
    # target's answer to another prompt): trained on with data.loss_on: target_text.
    target_text: tuple[str, ...] = ()
    # The source's own reply to the last user turn (ShareGPT / OpenAI messages with an assistant
    # turn after it), None when it has none: the response trained on with data.responses.mode: keep.
    reply: str | None = None

    def key(self) -> str:
        """sha256 of the messages: identical prompts have identical keys, whatever their id."""
        return hashlib.sha256(json.dumps(self.messages, sort_keys=True).encode()).hexdigest()


def load_prompts(sources: list[PromptSource], limit: int | None, seed: int) -> list[Prompt]:
    """Load, convert, dedupe and mix prompts from `sources`, shuffled with `seed`.

    Without `limit` every prompt of every source is returned. With one, each source gets a quota
    proportional to its weight (largest remainder rounding), sampled without replacement; a source
    short of its quota gives all it has and the others fill the gap in proportion to their weight.
    """
    if not sources:
        raise ValueError("load_prompts: no prompt sources given")
    rng = random.Random(seed)
    pools, seen = [], set()
    for src in sources:
        pool = []
        for p in _load_source(src, limit, seed):
            if p.key() not in seen:  # the same prompt twice (in one source or across) is kept once
                seen.add(p.key())
                pool.append(p)
        rng.shuffle(pool)
        pools.append(pool)
    if sum(map(len, pools)) == 0:
        names = ", ".join(s.path for s in sources)
        raise ValueError(f"no usable prompts in sources: {names} (all records empty or filtered)")
    if limit is None:
        chosen = [p for pool in pools for p in pool]
    else:
        quotas = _quotas([len(p) for p in pools], [s.weight for s in sources], limit)
        chosen = [p for pool, q in zip(pools, quotas) for p in pool[:q]]
        if len(chosen) < limit:
            log.warning("asked for %d prompts, the sources hold only %d", limit, len(chosen))
    rng.shuffle(chosen)
    return chosen


def _quotas(sizes: list[int], weights: list[float], limit: int) -> list[int]:
    """Split `limit` over sources by weight, capped by each size; refill from the uncapped ones."""
    quotas = [0] * len(sizes)
    open_ = [i for i, (n, w) in enumerate(zip(sizes, weights)) if n > 0 and w > 0]
    left = limit
    while left > 0 and open_:
        total_w = sum(weights[i] for i in open_)
        shares = {i: left * weights[i] / total_w for i in open_}
        give = {i: int(shares[i]) for i in open_}
        # largest remainder: hand out the rounding leftovers to the biggest fractions
        for i in sorted(open_, key=lambda i: shares[i] - give[i], reverse=True)[: left - sum(give.values())]:
            give[i] += 1
        for i in open_:
            take = min(give[i], sizes[i] - quotas[i])
            quotas[i] += take
            left -= take
        open_ = [i for i in open_ if quotas[i] < sizes[i]]
    return quotas


def _load_source(src: PromptSource, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    if is_raw_text(Path(src.path)):
        prompts = [Prompt([{"role": "user", "content": text}], None, i) for i, text in read_text_prompts(src.path)]
        log.info("%s: %d raw-text prompts", src.path, len(prompts))
        return prompts
    if src.streaming and limit is None:
        raise ValueError(f"{src.path}: a streaming source needs a prompt count to stop at (data.num_prompts, "
                         "or train.max_steps sizes it)")
    ds = _open_dataset(src)
    if src.streaming:  # IterableDataset: no length, columns may only be known from a record
        ds = ds.shuffle(seed=seed, buffer_size=src.shuffle_buffer)
        first = next(iter(ds), None)
        columns = ds.column_names or (list(first) if first else [])
    else:
        columns = ds.column_names
    shape = detect_shape(columns, src.path)
    label = Path(src.path).stem if Path(src.path).exists() else src.path
    prompts, dropped = [], 0
    for i, record in enumerate(ds):
        messages = to_messages(shape, record)
        if not messages:
            dropped += 1
            continue
        prompts.append(Prompt(messages, record.get("category") or None, f"{label}:{record_id(record, i)}",
                              reply=to_reply(shape, record)))
        if src.streaming and len(prompts) >= limit:  # no source can give more than the whole run
            break
    log.info("%s: %d prompts (%s), %d records dropped", src.path, len(prompts), shape, dropped)
    return prompts


DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


def is_raw_text(path: Path) -> bool:
    """A local text file that is not JSON/data, or a directory that holds no data files and is not a
    saved dataset: raw-text prompts (draftkit.prompts.read_text_prompts)."""
    if path.is_file():
        return path.suffix not in DATA_SUFFIXES
    if path.is_dir():
        saved = (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
        return not saved and not any(f.suffix in DATA_SUFFIXES for f in path.rglob("*") if f.is_file())
    return False


def _open_dataset(src: PromptSource) -> datasets.Dataset:
    import datasets  # here, not at the top: draftkit.distill imports without the trainer's stack

    path = Path(src.path)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
        ds = ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
        return ds.to_iterable_dataset() if src.streaming else ds
    if path.is_file():
        if path.suffix not in (".json", ".jsonl"):
            raise ValueError(f"{path}: data files given as a prompt file must be .json or .jsonl "
                             "(a directory of parquet/csv files is read by `datasets`)")
        return datasets.load_dataset("json", data_files=str(path), split="train", streaming=src.streaming)
    if path.suffix in (".json", ".jsonl"):
        raise FileNotFoundError(f"prompt file not found: {path}")
    # a hub dataset id, or a local directory of data files
    return datasets.load_dataset(src.path, src.name, split=src.split, streaming=src.streaming)
