"""Length-bucketed micro-batches and the DataLoader that reads offline features in workers."""
from __future__ import annotations

import random

import pytest
import torch

from draftkit.config import TrainConfig
from draftkit.train.data import FeatureStore, SampleOrder, padding_ratio, sample_order
from draftkit.train.loader import MicroBatches, MicroBatchStream
from tests.conftest import make_tiny_target
from tests.test_train import head_weights, prompt_file, python_run, recipe_args, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def skewed_lengths(n: int, seed: int = 0) -> list[int]:
    """Lengths of chat samples: mostly short, a long tail (log-normal, 5..~1000 tokens)."""
    rng = random.Random(seed)
    return [5 + int(rng.lognormvariate(4.5, 0.9)) for _ in range(n)]


def stream(order: SampleOrder, steps: range, mb: int, accum: int, world: int) -> list[list[list[int]]]:
    """Per micro step (step, micro), the micro-batch of each rank."""
    return [[order.indices(s, m, mb, accum, world, r) for r in range(world)] for s in steps for m in range(accum)]


@pytest.mark.parametrize("n, mb, accum, world", [(50, 3, 2, 2), (48, 4, 1, 3), (7, 2, 1, 1)])
def test_length_buckets_visit_each_sample_once_per_epoch_on_disjoint_ranks(n, mb, accum, world):
    lengths = skewed_lengths(n)
    order = SampleOrder(n, seed=5, batching="length_buckets", lengths=lengths, micro_batch=mb, window=4 * mb)
    steps = 4 * n // (mb * accum * world) + 1  # > 4 epochs, epochs not aligned to micro-batches when n % mb
    per_micro = stream(order, range(steps), mb, accum, world)
    width = mb * world  # global positions one micro step reads
    for k, ranks in enumerate(per_micro):
        if (k * width) // n == (k * width + width - 1) // n:  # within one epoch (as with random order)
            assert len({i for b in ranks for i in b}) == width  # ranks (and samples in a batch) disjoint
    flat = [i for ranks in per_micro for b in ranks for i in b]
    for e in range(4):
        assert sorted(flat[e * n: (e + 1) * n]) == list(range(n)), f"epoch {e}"
    assert flat[:n] != flat[n: 2 * n]  # each epoch its own order


def test_length_buckets_are_a_pure_function_of_seed_and_step():
    lengths = skewed_lengths(40)
    make = lambda seed: SampleOrder(40, seed, "length_buckets", lengths, micro_batch=2, window=8)  # noqa: E731
    order = make(1)
    walked = stream(order, range(30), 2, 2, 2)
    resumed = make(1)  # a resumed run asks for step 17 first, then on
    assert stream(resumed, range(17, 30), 2, 2, 2) == walked[17 * 2:]
    assert stream(make(1), range(30), 2, 2, 2) == walked
    assert stream(make(2), range(30), 2, 2, 2) != walked


def test_length_buckets_group_similar_lengths_in_shuffled_order():
    lengths = skewed_lengths(64, seed=3)
    order = SampleOrder(64, seed=0, batching="length_buckets", lengths=lengths, micro_batch=4, window=32)
    batches = [order.indices(s, 0, 4, 1, 1, 0) for s in range(16)]  # epoch 0: two windows of 8 batches
    for w in range(2):
        window = batches[w * 8: (w + 1) * 8]
        spans = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in window]
        for a in spans:  # each batch a slice of the window sorted by length: spans do not interleave
            assert all(a[1] <= b[0] or b[1] <= a[0] or a == b for b in spans)
        assert spans != sorted(spans) and spans != sorted(spans, reverse=True)  # order shuffled


def test_length_buckets_pad_far_less_than_random_on_skewed_lengths():
    lengths = skewed_lengths(512)
    cfg = TrainConfig(seed=0, bucket_window=64)
    samples = [{"input_ids": [0] * n} for n in lengths]
    ratios = {}
    for batching in ("random", "length_buckets"):
        cfg.batching = batching
        order = sample_order(cfg, samples, micro_batch=4, global_batch=8)
        assert order.batching == batching
        batches = [b for ranks in stream(order, range(128), 4, 1, 2) for b in ranks]  # 2 epochs
        ratios[batching] = padding_ratio(batches, lengths)
    assert ratios["random"] > 1.5  # skewed lengths: random batches pad heavily ...
    assert ratios["length_buckets"] < 1.1  # ... bucketed ones hardly at all


def test_padding_ratio_counts_padded_over_real_tokens():
    assert padding_ratio([[0, 1], [2]], [3, 1, 5]) == (2 * 3 + 1 * 5) / 9


def test_recipe_fingerprint_counts_batching_but_not_how_batches_are_read():
    from draftkit.config import load_recipe

    base = load_recipe(None).fingerprint()
    assert load_recipe(None, ["train.loader_workers=2", "train.prefetch=4"]).fingerprint() == base
    assert load_recipe(None, ["train.batching=length_buckets"]).fingerprint() != base
    assert load_recipe(None, ["train.bucket_window=8"]).fingerprint() != base


def test_bad_batching_settings_are_named():
    with pytest.raises(ValueError, match="train.batching"):
        SampleOrder(4, 0, "sorted")
    with pytest.raises(ValueError, match="one length per sample"):
        SampleOrder(4, 0, "length_buckets", [1, 2], micro_batch=2)
    with pytest.raises(ValueError, match="train.loader_workers"):
        MicroBatchStream(None, 1, workers=-1)


# ---------------------------------------------------------------------------------------------
# the DataLoader
# ---------------------------------------------------------------------------------------------
def test_loader_workers_yield_exactly_the_synchronous_batches(tmp_path):
    target = make_tiny_target()
    lengths = skewed_lengths(24, seed=1)
    lengths = [min(n, 40) for n in lengths]
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(3, 96, (n,), generator=g).tolist(), "loss_mask": [0] * 2 + [1] * (n - 2)}
               for n in lengths]
    store = FeatureStore(target, (1, -1), tmp_path, "float8")
    store.ensure(samples[:20], pad_id=0)  # the last 4 not on disk: batches holding them fall back to the main process
    order = SampleOrder(24, 3, "length_buckets", lengths, micro_batch=2, window=8)
    data = MicroBatches(order, samples, store, pad_id=0, micro=2, accum=2, world=2, rank=1, read=True)
    loaded = MicroBatchStream(data, end_step=9, workers=2, prefetch=2)
    read_in_worker, missing = 0, set()
    for step in range(3, 9):  # from a resume step on
        for micro in range(2):
            item = loaded.get(step, micro)
            idx = order.indices(step, micro, 2, 2, 2, 1)
            assert item["indices"] == idx
            want = store.batch([samples[i] for i in idx], pad_id=0)
            if item["features"] is None:
                assert any(i >= 20 for i in idx)
                missing |= {i for i in idx if i >= 20}
                continue
            read_in_worker += 1
            for name in ("input_ids", "attention_mask", "hidden", "final_hidden", "loss_mask", "top1"):
                assert torch.equal(getattr(item["features"], name), getattr(want, name)), name
    assert read_in_worker >= 6
    assert missing and store.computed == 20 + len(missing)  # computed in the main process (store.batch), once


@pytest.mark.parametrize("features", ["online", "offline"])
def test_trainer_reads_in_workers_only_offline_features(features, tmp_path, caplog):
    """Online features are a target forward: it stays in the main process, and the log says so."""
    from types import SimpleNamespace

    from draftkit.train import loop

    target = make_tiny_target()
    samples = [{"input_ids": [3] * n, "loss_mask": [1] * n} for n in (4, 9, 5, 7)]
    me = SimpleNamespace(recipe=SimpleNamespace(train=TrainConfig(loader_workers=2, prefetch=3, max_steps=2)),
                         features=FeatureStore(target, (-1,), tmp_path if features == "offline" else None),
                         order=SampleOrder(4, 0), data=SimpleNamespace(train=samples), pad_id=0, micro=2, accum=1,
                         dist=SimpleNamespace(world_size=1, rank=0), main=True)
    me.epoch_padding = lambda: loop.Trainer.epoch_padding(me)
    with caplog.at_level("INFO", logger="draftkit.train"):
        stream = loop.Trainer.batches(me)
    assert (stream.workers, stream.data.read) == ((0, False) if features == "online" else (2, True))
    assert ("loader_workers: 2 ignored: online features" in caplog.text) == (features == "online")
    assert "batches: random, padded/real tokens" in caplog.text


@pytest.mark.integration
def test_training_with_loader_workers_and_buckets_resumes_to_the_same_weights(tiny_model_dir, prompt_file,  # noqa: F811
                                                                             tmp_path):
    cache = tmp_path / "cache"
    common = ["train.max_steps=6", "train.save_every=2", "train.epochs=2", "train.batching=length_buckets",
              "train.bucket_window=2"]
    sync = python_run(recipe_args(tiny_model_dir, prompt_file, tmp_path / "sync", cache, *common))
    assert sync.returncode == 0, sync.stderr[-3000:]
    killed = python_run(recipe_args(tiny_model_dir, prompt_file, tmp_path / "work", cache, *common,
                                    "train.loader_workers=1"), env_extra={"DRAFTKIT_FAULT_KILL_AFTER_STEP": "3"})
    assert killed.returncode == -9
    workers = common + ["train.loader_workers=2", "train.prefetch=3"]  # how batches are read may change on resume
    resumed = python_run(recipe_args(tiny_model_dir, prompt_file, tmp_path / "work", cache, *workers))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stderr
    a, b = head_weights(tmp_path / "sync"), head_weights(tmp_path / "work")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    for run in (sync, killed, resumed):  # the runs did bucket (and the last two read in workers)
        assert "batches: length_buckets, padded/real tokens" in run.stderr
    assert "read by loader_workers 1, prefetch 2" in killed.stderr
    assert "read by loader_workers 2, prefetch 3" in resumed.stderr
