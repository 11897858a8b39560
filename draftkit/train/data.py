"""What the trainer feeds the head: a deterministic sample order, padded batches, cached features.

The order is a pure function of (seed, step), so a resumed run reads exactly the batches the
uninterrupted run would have read, and every rank reads its own disjoint shard.
Target features are computed once per sample and stored on disk (keyed by content), so epochs
after the first, and resumed runs, never run the target again for the same sample.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from draftkit.target import FINAL, Target, TargetFeatures


class SampleOrder:
    """Global sample sequence: epoch e visits all samples in a permutation seeded by (seed, e)."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples == 0:
            raise ValueError("no training samples")
        self.n, self.seed = num_samples, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def indices(self, step: int, micro: int, micro_batch: int, accum: int, world: int, rank: int) -> list[int]:
        start = ((step * accum + micro) * world + rank) * micro_batch  # position in the global stream
        return [self._perm(c // self.n)[c % self.n] for c in range(start, start + micro_batch)]


def collate(samples: list[dict], pad_id: int) -> dict[str, Tensor]:
    T = max(len(s["input_ids"]) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(samples):  # right padding: real tokens keep positions 0..L-1
        L = len(s["input_ids"])
        ids[b, :L] = torch.tensor(s["input_ids"])
        attn[b, :L] = 1
        loss[b, :L] = torch.tensor(s["loss_mask"])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def sample_key(sample: dict) -> str:
    return hashlib.sha256(str(sample["input_ids"]).encode()).hexdigest()[:24]


class FeatureStore:
    """Target features per sample: computed on first use, then read from `directory`."""

    def __init__(self, target: Target, layers: tuple[int, ...], directory: Path | None):
        self.target, self.layers = target, tuple(layers)
        self.same = self.layers == (FINAL,)  # feature == final hidden: store it once
        self.dir = None
        if directory is not None:
            tag = f"{target.fingerprint}-{target.dtype}-{'_'.join(map(str, self.layers))}".replace("torch.", "")
            self.dir = Path(directory) / tag
            self.dir.mkdir(parents=True, exist_ok=True)
        self.computed = 0  # samples whose features this process computed (the rest came from disk)

    def batch(self, samples: list[dict], pad_id: int) -> TargetFeatures:
        b = collate(samples, pad_id)
        dev = self.target.device
        if self.dir is None:  # online: recompute every time
            self.computed += len(samples)
            return self.target.features(b["input_ids"].to(dev), b["attention_mask"].to(dev), self.layers,
                                        b["loss_mask"].to(dev))
        paths = [self.dir / f"{sample_key(s)}.safetensors" for s in samples]
        missing = [i for i, p in enumerate(paths) if not p.is_file()]
        if missing:
            self._compute([samples[i] for i in missing], [paths[i] for i in missing], pad_id)
        hidden, final, top1 = self._load(paths, b["input_ids"].shape[1])
        return TargetFeatures(b["input_ids"].to(dev), b["attention_mask"].to(dev), hidden.to(dev),
                              final.to(dev), b["loss_mask"].to(dev), top1.long().to(dev))

    def _compute(self, samples: list[dict], paths: list[Path], pad_id: int) -> None:
        b = collate(samples, pad_id)
        dev = self.target.device
        f = self.target.features(b["input_ids"].to(dev), b["attention_mask"].to(dev), self.layers, top1=True)
        for i, (s, path) in enumerate(zip(samples, paths)):
            L = len(s["input_ids"])
            tensors = {"final": f.final_hidden[i, :L].contiguous().cpu(),
                       "top1": f.top1[i, :L].to(torch.int32).contiguous().cpu()}
            if not self.same:
                tensors["hidden"] = f.hidden[i, :L].contiguous().cpu()
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(tensors, tmp)
            os.replace(tmp, path)  # atomic: a killed run never leaves a half-written feature file
        self.computed += len(samples)

    def _load(self, paths: list[Path], T: int) -> tuple[Tensor, Tensor, Tensor]:
        rows = [load_file(p) for p in paths]
        def pad(key: str) -> Tensor:
            first = rows[0][key]
            out = torch.zeros(len(rows), T, *first.shape[1:], dtype=first.dtype)
            for i, r in enumerate(rows):
                out[i, : r[key].shape[0]] = r[key]
            return out
        final = pad("final")
        return (final if self.same else pad("hidden")), final, pad("top1")
