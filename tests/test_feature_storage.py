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


# ---- train.target_topk: the target's top-k log-probabilities instead of its final hidden state ----
def test_topk_teacher_kl_equals_the_hand_computed_kl_with_zeros_off_its_support():
    import math

    from draftkit.heads import build_head
    from draftkit.heads.losses import kl_rows
    from draftkit.heads.vocab import in_vocab_mean

    head = build_head({"type": "eagle3", "draft_vocab_size": 5, "ttt_steps": 1}, make_tiny_target(vocab=8))
    head.set_draft_vocab(tokens=[1, 2, 4, 6, 7])  # draft ids 0..4 <-> target ids 1, 2, 4, 6, 7
    ids = torch.tensor([[2, 6, 0], [0, 3, 5], [7, 1, 4], [3, 4, 1]], dtype=torch.int32)  # (M, k) most likely first
    logp = torch.tensor([[-0.5, -1.5, -2.0], [-0.2, -2.0, -3.0], [-0.1, -3.0, -4.0], [-0.3, -1.0, -2.5]],
                        dtype=torch.float16)
    student = torch.tensor([[0.3, -1.0, 2.0, 0.5, -0.2], [1.0, 0.0, -1.0, 2.0, 0.5],
                            [-0.7, 0.1, 0.9, -1.2, 1.5], [0.0, 0.4, -0.4, 1.1, -2.0]], requires_grad=True)
    kl, pred, top = kl_rows(lambda h: h, head.topk_on_draft_vocab, student, ids, logp, vocab=5)
    draft = {1: 0, 2: 1, 4: 2, 6: 3, 7: 4}
    for m in range(4):
        q = [math.exp(x) for x in student[m].tolist()]
        logq = [math.log(x / sum(q)) for x in q]
        support = [(draft[t], lp) for t, lp in zip(ids[m].tolist(), logp[m].float().tolist()) if t in draft]
        z = sum(math.exp(lp) for _, lp in support)
        want = sum(math.exp(lp) / z * (lp - math.log(z) - logq[j]) for j, lp in support)  # 0 on an empty support
        assert abs(kl[m].item() - want) < 1e-6, (m, kl[m].item(), want)
    assert kl[1].item() == 0.0  # no top-k token in the draft vocabulary: an exact zero, not NaN
    assert torch.equal(top, torch.tensor([2, 0, 7, 3])) and torch.equal(pred, student.argmax(-1))
    loss = in_vocab_mean(kl, top, head.t2d)  # rows 1 and 3 (top-1 0 / 3 outside) are left out
    torch.testing.assert_close(loss, (kl[0] + kl[2]) / 2)
    loss.backward()
    assert torch.isfinite(student.grad).all() and torch.equal(student.grad[1], torch.zeros(5))
    teacher_logits, _ = head.topk_on_draft_vocab(ids, logp)
    assert torch.isinf(teacher_logits[0, [0, 2, 4]]).all() and torch.isinf(teacher_logits[1]).all()


def test_target_topk_log_probs_are_the_full_vocabulary_ones_chunked_or_not(tiny_target):
    final = tiny_target.features(torch.tensor([[5, 9, 3, 40, 41, 7]])).final_hidden[0]  # (T, H)
    ids, logp = tiny_target.topk_logprobs(final, 5)
    full = tiny_target.logits(final).float().log_softmax(-1)  # (T, V)
    assert ids.dtype == torch.int32 and logp.dtype == torch.float16 and ids.shape == (6, 5)
    assert torch.equal(ids[:, 0].long(), full.argmax(-1))
    assert torch.equal(logp, full.gather(1, ids.long()).half()) and (logp[:, :-1] >= logp[:, 1:]).all()
    one_row = tiny_target.topk_logprobs(final, 5, rows=1)
    assert torch.equal(one_row[0], ids) and torch.equal(one_row[1], logp)


def test_topk_of_the_whole_vocabulary_gives_the_full_logit_loss_and_gradients(tiny_target):
    from draftkit.heads import build_head
    from tests.conftest import batch

    torch.manual_seed(0)
    head = build_head({"type": "eagle3", "draft_vocab_size": 64, "ttt_steps": 3}, tiny_target)
    ids, attn, lm = batch(tiny_target, B=3, T=12)
    head.set_draft_vocab(tokens=ids)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    results = []
    for kwargs in ({"top1": True}, {"topk": tiny_target.vocab_size}):
        feats = tiny_target.features(ids, attn, head.feature_layers, lm, **kwargs)
        head.zero_grad()
        out = head.loss(feats)
        out["loss"].backward()
        results.append((out, [p.grad.clone() for p in head.parameters()]))
    (full, full_g), (topk, topk_g) = results
    assert full["tokens"] == topk["tokens"] > 0
    for key in ("loss", "kl_0", "kl_1", "kl_2", "acc_0"):  # the top-k log-probs are float16
        torch.testing.assert_close(topk[key], full[key], rtol=2e-3, atol=1e-4)
    for a, b in zip(topk_g, full_g):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("storage, want", [("bfloat16", 3 * 32 * 2 + 4 * 6), ("float8", 3 * 32 + 3 * 4 + 4 * 6)])
def test_topk_layout_stores_ids_and_log_probs_instead_of_the_final_hidden(tmp_path, storage, want):
    import json
    import struct

    from draftkit.train.data import layout_bytes

    target = make_tiny_target()
    store = FeatureStore(target, (1, 2, 3), tmp_path, storage, topk=4)
    assert store.bytes_per_token() == want and store.dir.name.endswith(f"-{storage}-top4")
    got = store.batch(SAMPLES, pad_id=0)
    assert got.final_hidden is None and got.topk_ids.shape == (3, 9, 4) and got.topk_logp.dtype == torch.float16
    assert torch.equal(got.top1, got.topk_ids[..., 0].long())
    for f in sorted(store.dir.glob("*.safetensors")):
        stored = load_file(f)
        L = stored["topk_ids"].shape[0]
        scales = ["hidden_scale"] if storage == "float8" else []
        assert sorted(stored) == sorted(["hidden", "topk_ids", "topk_logp", *scales])
        raw = f.read_bytes()
        header = struct.unpack("<Q", raw[:8])[0]
        assert json.loads(raw[8:8 + header])  # the rest of the file is the tensors' bytes
        assert (len(raw) - 8 - header) / L == sum(v.nbytes for v in stored.values()) / L == want
    # the reference: EAGLE-3 on a 4096-wide target, bf16 three layers + final hidden (+ top-1 id)
    assert layout_bytes(4096, (2, 16, 29), "bfloat16") == 4 * 4096 * 2 + 4
    assert layout_bytes(4096, (2, 16, 29), "float8", topk=16) == 3 * 4096 + 3 * 4 + 16 * 6  # 2.64x smaller


def test_eagle3_step_with_offline_topk_features_equals_the_online_one(tmp_path):
    from draftkit.heads import build_head

    target = make_tiny_target()
    offline = FeatureStore(target, (1, 2, 3), tmp_path, topk=8)
    offline.batch(SAMPLES, pad_id=0)  # written ...
    read = FeatureStore(target, (1, 2, 3), tmp_path, topk=8).batch(SAMPLES, pad_id=0)  # ... and read back
    online = FeatureStore(target, (1, 2, 3), None, topk=8).batch(SAMPLES, pad_id=0)
    weights = []
    for feats in (read, online):
        torch.manual_seed(0)
        head = build_head({"type": "eagle3", "draft_vocab_size": 48, "ttt_steps": 2, "feature_layers": [1, 2, 3]},
                          target)
        head.set_draft_vocab(tokens=[s["input_ids"] for s in SAMPLES])
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
        loss = head.loss(feats)["loss"]
        loss.backward()
        opt.step()
        weights.append((loss.detach(), {k: v.detach().clone() for k, v in head.state_dict().items()}))
    assert read.final_hidden is None and online.final_hidden is not None  # online keeps it, the loss does not read it
    assert torch.equal(weights[0][0], weights[1][0])
    assert all(torch.equal(weights[0][1][k], weights[1][1][k]) for k in weights[0][1])


@pytest.mark.parametrize("family", ["eagle", "medusa", "mtp"])
def test_families_that_read_the_final_hidden_as_input_refuse_target_topk(tiny_target, family):
    from draftkit.heads import HeadError, build_head

    head = build_head({"type": family}, tiny_target)
    head.check_target_topk(0)
    with pytest.raises(HeadError, match=rf"train.target_topk: 4 .* the {family} head reads that state as its input"):
        head.check_target_topk(4)
    eagle3 = build_head({"type": "eagle3", "draft_vocab_size": 64}, tiny_target)
    eagle3.check_target_topk(16)
    with pytest.raises(HeadError, match="train.target_topk: 97 exceeds the target's vocabulary"):
        eagle3.check_target_topk(97)
