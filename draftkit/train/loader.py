"""Micro-batches through a torch DataLoader: workers read offline features while the head trains.

The dataset is indexed by global micro-batch number k = step * accum + micro and is a pure function
of k (SampleOrder), so it starts at any step (resume) and workers read exactly what the main process
would. A worker reads only files (train/data.py read_stored): features not on disk yet, and online
features, are computed by the target in the main process (Trainer.micro_batch).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import DataLoader, Dataset

from draftkit.target import TargetFeatures
from draftkit.train.data import FeatureStore, SampleOrder, read_stored


class MicroBatches(Dataset):
    """Item k: this rank's micro-batch `micro` of optimizer step `step` (divmod(k, accum)):
    {"step", "micro", "indices": sample indices, "features": TargetFeatures on the CPU, or None
    when the main process must compute them (read=False, or not on disk yet)}."""

    def __init__(self, order: SampleOrder, samples: list[dict], store: FeatureStore, pad_id: int, micro: int,
                 accum: int, world: int, rank: int, read: bool):
        self.order, self.samples, self.store, self.pad_id = order, samples, store, pad_id
        self.micro, self.accum, self.world, self.rank, self.read = micro, accum, world, rank, read

    def __getitem__(self, k: int) -> dict:
        step, micro = divmod(k, self.accum)
        idx = self.order.indices(step, micro, self.micro, self.accum, self.world, self.rank)
        feats = read_stored(self.store, [self.samples[i] for i in idx], self.pad_id) if self.read else None
        return {"step": step, "micro": micro, "indices": idx, "features": feats}


def _one_thread(_worker_id: int) -> None:
    torch.set_num_threads(1)  # workers read and decode files; the head's step keeps the cores


class MicroBatchStream:
    """Items of MicroBatches in order from a start step: synchronous (workers=0) or from a DataLoader
    with `workers` processes keeping `prefetch` items each in flight. Asked out of order (a new run
    or resume step), it starts over at the step asked for."""

    def __init__(self, dataset: MicroBatches, end_step: int, workers: int = 0, prefetch: int = 2):
        if workers < 0 or prefetch < 1:
            raise ValueError(f"train.loader_workers must be >= 0 and train.prefetch >= 1, got {workers} and {prefetch}")
        self.data, self.end, self.workers, self.prefetch = dataset, end_step * dataset.accum, workers, prefetch
        self.next_k, self.it = None, None

    def get(self, step: int, micro: int) -> dict:
        k = step * self.data.accum + micro
        if k != self.next_k:
            self._start(k)
        self.next_k = k + 1
        item = next(self.it) if self.it is not None else self.data[k]
        assert (item["step"], item["micro"]) == (step, micro), "loader out of step"
        return item

    def _start(self, k: int) -> None:
        self.it = None
        if self.workers and k < self.end:
            loader = DataLoader(self.data, batch_size=None, sampler=range(k, self.end), num_workers=self.workers,
                                prefetch_factor=self.prefetch, worker_init_fn=_one_thread)
            self.it = iter(loader)


def to_device(feats: TargetFeatures, device: torch.device) -> TargetFeatures:
    """A worker's CPU features on the training device (tensors moved, the rest kept)."""
    return dataclasses.replace(feats, **{f.name: getattr(feats, f.name).to(device) for f in dataclasses.fields(feats)
                                         if isinstance(getattr(feats, f.name), torch.Tensor)})
