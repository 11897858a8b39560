"""What the trainer feeds the head: a deterministic sample order, padded batches, cached features.

The order is a pure function of (seed, step), so a resumed run reads exactly the batches the
uninterrupted run would have read, and every rank reads its own disjoint shard.
Target features are computed once per sample and stored on disk (keyed by content), so epochs
after the first, and resumed runs, never run the target again for the same sample.
"""
from __future__ import annotations

import copy
import hashlib
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from draftkit.target import FINAL, Target, TargetError, TargetFeatures


class SampleOrder:
    """Global sample sequence: epoch e visits all samples in a permutation seeded by (seed, e).

    batching "random" reads the permutation as it is. "length_buckets" (needs `lengths` and the
    micro-batch size) cuts it into windows of `window` samples, sorts each window by sample length,
    cuts it into micro-batches and shuffles their order (seeded by seed, epoch, window): each
    micro-batch holds samples of similar length (little padding), the steps still see lengths in
    random order, and every epoch is still a permutation. Either way the stream is a pure function
    of (seed, position), so a resumed run reads the batches an uninterrupted one would, and ranks
    read disjoint positions of it.
    """

    def __init__(self, num_samples: int, seed: int, batching: str = "random", lengths: list[int] | None = None,
                 micro_batch: int = 1, window: int = 1):
        if num_samples == 0:
            raise ValueError("no training samples")
        if batching not in ("random", "length_buckets"):
            raise ValueError(f"train.batching: expected random or length_buckets, got {batching!r}")
        if batching == "length_buckets" and (lengths is None or len(lengths) != num_samples):
            raise ValueError(f"train.batching: length_buckets needs one length per sample ({num_samples})")
        self.n, self.seed, self.batching = num_samples, seed, batching
        self.lengths, self.mb, self.window = lengths, micro_batch, max(window // micro_batch, 1) * micro_batch
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            perm = torch.randperm(self.n, generator=g).tolist()
            self._perms = {epoch: perm if self.batching == "random" else self._bucketed(perm, epoch)}
        return self._perms[epoch]

    def _bucketed(self, perm: list[int], epoch: int) -> list[int]:
        """The epoch's permutation with each window sorted by length and its micro-batches shuffled.

        Micro-batches are cut on the global grid (positions k * micro_batch): when the epoch does not
        start on it, its first `head` samples complete a micro-batch of the previous epoch and stay
        as drawn, and a last partial micro-batch stays last (it continues into the next epoch).
        """
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch + 7_919 * 1_000_003)
        head = (-epoch * self.n) % self.mb
        out = perm[:head]
        for w0 in range(head, self.n, self.window):
            window = sorted(perm[w0: w0 + self.window], key=lambda i: self.lengths[i])  # stable: ties as drawn
            full = len(window) // self.mb
            for k in torch.randperm(full, generator=g).tolist():
                out += window[k * self.mb: (k + 1) * self.mb]
            out += window[full * self.mb:]
        return out

    def indices(self, step: int, micro: int, micro_batch: int, accum: int, world: int, rank: int) -> list[int]:
        if self.batching == "length_buckets" and micro_batch != self.mb:
            raise ValueError(f"SampleOrder: built for micro-batches of {self.mb}, asked for {micro_batch}")
        start = ((step * accum + micro) * world + rank) * micro_batch  # position in the global stream
        return [self._perm(c // self.n)[c % self.n] for c in range(start, start + micro_batch)]


def padding_ratio(batches: list[list[int]], lengths: list[int]) -> float:
    """Padded over real tokens of right-padded micro-batches (lists of sample indices): 1.0 = no padding."""
    real = sum(lengths[i] for b in batches for i in b)
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) / max(real, 1)


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


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def encode(x: Tensor, storage: str, groups: int = 1) -> dict[str, Tensor]:
    """(L, G*H) features of G layers -> what is stored: as computed ("target"), bf16, or fp8 e4m3
    with an fp32 scale per token and layer ("_scale", (L, G): layers differ in magnitude)."""
    if storage == "target":
        return {"": x}
    if storage == "bfloat16":
        return {"": x.to(torch.bfloat16)}
    g = x.float().unflatten(-1, (groups, -1))  # (L, G, H)
    scale = g.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # (L, G)
    return {"": (g / scale[..., None]).flatten(-2).to(torch.float8_e4m3fn), "_scale": scale}


def decode(stored: dict[str, Tensor], key: str, dtype: torch.dtype) -> Tensor:
    x = stored[key]
    scale = stored.get(f"{key}_scale")  # (L, G) with fp8
    if scale is not None:
        return (x.float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2).to(dtype)
    return x.to(dtype)


def feature_store(recipe, target: Target, layers: tuple[int, ...]) -> "FeatureStore":
    """A recipe's feature store: on disk under <data.cache_dir>/features with train.features
    offline (where `draftkit prepare --features` writes them ahead of training), else online."""
    from draftkit.target import cache_root

    r = recipe
    directory = (Path(r.data.cache_dir) if r.data.cache_dir else cache_root()) / "features"
    return FeatureStore(target, layers, directory if r.train.features == "offline" else None,
                        r.train.feature_storage, r.train.target_topk)


class FeatureStore:
    """Target features per sample: computed on first use, then read from `directory`.

    storage (train.feature_storage): "target" keeps the target's dtype, "bfloat16" casts,
    "float8" stores e4m3 with one fp32 scale per token (a quarter of fp32's bytes, half of bf16's).
    topk (train.target_topk): 0 stores the final hidden state (the teacher's logits are rebuilt from
    it) and the top-1 id; k > 0 stores the target's top-k ids (int32) and log-probs (float16) instead.
    Files are safetensors, one per sample: {"hidden"[, "hidden_scale"]} (L, G*H) [, (L, G)] plus
    {"final"[, "final_scale"], "top1" (L,)} or {"topk_ids", "topk_logp"} (L, k).
    """

    def __init__(self, target: Target, layers: tuple[int, ...], directory: Path | None, storage: str = "target",
                 topk: int = 0):
        self.target, self.layers, self.storage, self.topk = target, tuple(layers), storage, topk
        self.same = self.layers == (FINAL,) and not topk  # feature == final hidden: store it once
        self.dir = None
        if directory is not None:
            tag = f"{target.fingerprint}-{target.dtype}-{'_'.join(map(str, self.layers))}".replace("torch.", "")
            tag += "" if storage == "target" else f"-{storage}"
            tag += f"-top{topk}" if topk else ""
            self.dir = Path(directory) / tag
            self.dir.mkdir(parents=True, exist_ok=True)
        self.computed = 0  # samples whose features this process computed (the rest came from disk)

    def batch(self, samples: list[dict], pad_id: int) -> TargetFeatures:
        b = collate(samples, pad_id)
        dev = self.target.device
        if self.dir is None:  # online: recompute every time
            self.computed += len(samples)
            return self.target.features(b["input_ids"].to(dev), b["attention_mask"].to(dev), self.layers,
                                        b["loss_mask"].to(dev), topk=self.topk)
        self.ensure(samples, pad_id)
        paths = [self.dir / f"{sample_key(s)}.safetensors" for s in samples]
        got = self._load(paths, b["input_ids"].shape[1])
        to = lambda key: got[key].to(dev) if key in got else None  # noqa: E731
        top1 = got["topk_ids"][..., 0] if self.topk else got["top1"]
        return TargetFeatures(b["input_ids"].to(dev), b["attention_mask"].to(dev), to("hidden"), to("final"),
                              b["loss_mask"].to(dev), top1.long().to(dev), to("topk_ids"), to("topk_logp"))

    def missing(self, samples: list[dict]) -> list[int]:
        """Indices of the samples whose features are not stored (all of them online)."""
        if self.dir is None:
            return list(range(len(samples)))
        return [i for i, s in enumerate(samples) if not (self.dir / f"{sample_key(s)}.safetensors").is_file()]

    def ensure(self, samples: list[dict], pad_id: int) -> int:
        """Compute and store the features of the samples not on disk yet; returns how many."""
        paths = [self.dir / f"{sample_key(s)}.safetensors" for s in samples]
        missing = self.missing(samples)
        if missing and not self.target.has_transformer:
            raise TargetError(f"offline features of {len(missing)} samples are missing from {self.dir} (first: "
                              f"{paths[missing[0]].name}), and target {self.target.name} was loaded without its "
                              "transformer; run `draftkit prepare --features` with this recipe first")
        if missing:
            self._compute([samples[i] for i in missing], [paths[i] for i in missing], pad_id)
        return len(missing)

    def _compute(self, samples: list[dict], paths: list[Path], pad_id: int) -> None:
        b = collate(samples, pad_id)
        dev = self.target.device
        f = self.target.features(b["input_ids"].to(dev), b["attention_mask"].to(dev), self.layers, top1=True,
                                 topk=self.topk)
        for i, (s, path) in enumerate(zip(samples, paths)):
            L = len(s["input_ids"])
            if self.topk:  # the teacher as top-k, no final hidden
                tensors = {"topk_ids": f.topk_ids[i, :L].contiguous().cpu(),
                           "topk_logp": f.topk_logp[i, :L].contiguous().cpu()}
                parts = [("hidden", f.hidden, len(self.layers))]
            else:
                tensors = {"top1": f.top1[i, :L].to(torch.int32).contiguous().cpu()}
                parts = [("final", f.final_hidden, 1)] + ([] if self.same else [("hidden", f.hidden, len(self.layers))])
            for key, x, groups in parts:
                enc = encode(x[i, :L], self.storage, groups)
                tensors.update({key + k: v.contiguous().cpu() for k, v in enc.items()})
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(tensors, tmp)
            os.replace(tmp, path)  # atomic: a killed run never leaves a half-written feature file
        self.computed += len(samples)

    def bytes_per_token(self) -> int:
        """Bytes one token's stored features take (top-1 id or top-k included; file headers not)."""
        return layout_bytes(self.target.hidden_size, self.layers, self.storage, self.topk,
                            self.target.dtype.itemsize)

    def check_disk(self, num_tokens: int) -> str:
        """Refuse (ValueError) when the offline features of num_tokens tokens would not fit on the
        disk of the cache; else say what they take."""
        if self.dir is None:
            return "train.features: online, nothing written"
        need = self.bytes_per_token() * num_tokens
        have = sum(f.stat().st_size for f in self.dir.glob("*.safetensors"))
        free = shutil.disk_usage(self.dir).free
        teacher = f", top-{self.topk} log-probs" if self.topk else ""
        text = (f"offline features ({self.storage}{teacher}): {self.bytes_per_token()} bytes/token x "
                f"{num_tokens} tokens = {need / 1e9:.2f} GB ({have / 1e9:.2f} GB cached, {free / 1e9:.1f} GB free) "
                f"in {self.dir}")
        if need - have > free:
            raise ValueError(f"train.features: {text}: not enough disk; free space, move data.cache_dir, set "
                             f"train.feature_storage: float8, train.target_topk: 16 (EAGLE-3), or "
                             f"train.features: online")
        return text

    def _load(self, paths: list[Path], T: int) -> dict[str, Tensor]:
        """The samples' stored tensors, decoded and right-padded to T: {"hidden", "final", "top1"}
        or {"hidden", "topk_ids", "topk_logp"}, each (B, T, ...), read with safetensors."""
        rows = [load_file(p) for p in paths]
        dtype = self.target.dtype
        def pad(key: str) -> Tensor:
            vals = [r[key] if key in ("top1", "topk_ids", "topk_logp") else decode(r, key, dtype) for r in rows]
            out = torch.zeros(len(rows), T, *vals[0].shape[1:], dtype=vals[0].dtype)
            for i, v in enumerate(vals):
                out[i, : v.shape[0]] = v
            return out
        if self.topk:
            return {k: pad(k) for k in ("hidden", "topk_ids", "topk_logp")}
        final = pad("final")
        return {"hidden": final if self.same else pad("hidden"), "final": final, "top1": pad("top1")}


def layout_bytes(hidden_size: int, layers: tuple[int, ...], storage: str, topk: int = 0,
                 target_itemsize: int = 2) -> int:
    """Bytes per token of FeatureStore's layout (file headers not counted): the layers' features
    (the final hidden once when it is the only layer), plus the final hidden and the top-1 id
    (topk 0) or k ids and log-probs (int32 + float16); fp8 adds an fp32 scale per stored layer."""
    elem = {"target": target_itemsize, "bfloat16": 2, "float8": 1}[storage]
    same = tuple(layers) == (FINAL,) and not topk
    groups = 1 if same else len(layers) + (0 if topk else 1)  # stored (L, H) blocks per token
    teacher = 6 * topk if topk else 4
    return groups * hidden_size * elem + teacher + (4 * groups if storage == "float8" else 0)



def sample_order(train, samples: list[dict], micro_batch: int, global_batch: int) -> SampleOrder:
    """The recipe's sample order (train: TrainConfig): train.batching over the training samples."""
    return SampleOrder(len(samples), train.seed, train.batching, [len(s["input_ids"]) for s in samples],
                       micro_batch, train.bucket_window * global_batch)


class _TargetOnCpu:
    """A target as a DataLoader worker sees it: every attribute, but device CPU (workers never run it)."""

    device = torch.device("cpu")

    def __init__(self, target: Target):
        self._target = target

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def read_stored(store: FeatureStore, samples: list[dict], pad_id: int) -> TargetFeatures | None:
    """What store.batch(samples, pad_id) returns, on the CPU, when every sample's features are on disk
    already (so it only reads them); None when one is missing or features are online (the main
    process computes those). What a DataLoader worker calls (train/loader.py)."""
    if store.dir is None or store.missing(samples):
        return None
    view = copy.copy(store)
    view.target = _TargetOnCpu(store.target)
    return view.batch(samples, pad_id)
