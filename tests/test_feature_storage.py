"""Offline feature storage (train.feature_storage): bf16 / fp8 with per-token scales, and the disk check."""
from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file

from draftkit.train.data import FeatureStore, decode, encode
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLES = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [0] * 2 + [1] * (n - 2)} for n in (5, 9, 7)]


def fp8_bound(x: torch.Tensor, groups: int) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x|, plus half the subnormal step of the scale."""
    g = x.float().unflatten(-1, (groups, -1))
    scale = g.abs().amax(-1, keepdim=True) / 448
    return (g.abs() * 2 ** -4 + scale * 2 ** -10).flatten(-2)


def test_fp8_per_token_and_layer_scales_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 16, generator=g)
    x[:, 1] *= 1e5  # a layer far larger than the other: a scale per layer keeps the small one precise
    x[2] *= 1e-3  # and one quiet token
    x = x.flatten(1)
    enc = encode(x, "float8", groups=2)
    assert enc[""].dtype == torch.float8_e4m3fn and enc["_scale"].shape == (6, 2)
    back = decode({"h": enc[""], "h_scale": enc["_scale"]}, "h", torch.float32)
    err = (back - x).abs()
    assert torch.all(err <= fp8_bound(x, 2)) and err.max() > 0
    one_scale = decode({"h": (e := encode(x, "float8", 1))[""], "h_scale": e["_scale"]}, "h", torch.float32)
    rel = lambda y: ((y - x)[:, :16].abs() / x[:, :16].abs()).median()  # noqa: E731  (the small layer)
    assert rel(back) <= 2 ** -5 and rel(one_scale) > 0.25  # one scale per token would flush it to ~0
    assert torch.equal(decode({"h": encode(x, "bfloat16")[""]}, "h", torch.float32), x.bfloat16().float())
    assert encode(x, "target")[""] is x


@pytest.mark.parametrize("layers", [(-1,), (1, 2, -1)])
def test_feature_store_fp8_reads_back_close_in_the_targets_dtype_and_says_its_size(tmp_path, layers):
    target = make_tiny_target()
    exact = FeatureStore(target, layers, None).batch(SAMPLES, pad_id=0)
    store = FeatureStore(target, layers, tmp_path, "float8")
    store.batch(SAMPLES, pad_id=0)
    again = FeatureStore(target, layers, tmp_path, "float8")
    got = again.batch(SAMPLES, pad_id=0)
    assert again.computed == 0 and store.dir.name.endswith("-float8")  # read from disk, its own directory
    assert got.hidden.dtype == got.final_hidden.dtype == target.dtype
    real = exact.attention_mask.bool()
    for name, groups in (("hidden", len(layers)), ("final_hidden", 1)):
        want, have = getattr(exact, name)[real], getattr(got, name)[real]
        assert torch.all((have - want).abs() <= fp8_bound(want, groups)), name
    files = sorted(store.dir.glob("*.safetensors"))
    per_token = [sum(v.nbytes for v in load_file(f).values()) / load_file(f)["top1"].shape[0] for f in files]
    assert per_token == [store.bytes_per_token()] * 3
    full = FeatureStore(target, layers, tmp_path / "f32")
    assert store.bytes_per_token() < full.bytes_per_token() / 3  # fp32 target: 4 bytes -> 1 byte + scales


def test_disk_check_prints_bytes_per_token_times_tokens_and_refuses_when_short(tmp_path, monkeypatch):
    target = make_tiny_target()
    store = FeatureStore(target, (1, -1), tmp_path, "bfloat16")
    assert store.bytes_per_token() == (2 * 32 + 32) * 2 + 4
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 0, 10 ** 9))
    text = store.check_disk(1000)
    assert "196 bytes/token x 1000 tokens = 0.00 GB" in text and str(store.dir) in text
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 0, 195_999))
    with pytest.raises(ValueError, match=r"train.features: .*196 bytes/token x 1000 tokens.*not enough disk"):
        store.check_disk(1000)
    store.batch(SAMPLES, pad_id=0)  # what is already cached counts as written
    store.check_disk(1000)
    assert "online" in FeatureStore(target, (-1,), None).check_disk(10 ** 15)
