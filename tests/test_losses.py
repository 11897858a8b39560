"""Chunked distillation losses (draftkit.heads.losses): the same loss and gradients as one chunk."""
import pytest
import torch

from draftkit.heads import build_head
from draftkit.heads import losses
from tests.conftest import batch

SETTINGS = [{"type": "eagle"}, {"type": "eagle", "draft_vocab_size": 40}, {"type": "eagle3", "draft_vocab_size": 64, "ttt_steps": 3},
            {"type": "medusa", "num_heads": 3}, {"type": "mtp", "num_depths": 2}]


def loss_and_grads(head, feats):
    head.zero_grad()
    out = head.loss(feats)
    out["loss"].backward()
    return out, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("cached_top1", [False, True])
def test_chunked_loss_equals_one_chunk_with_gradients(tiny_target, monkeypatch, settings, cached_top1):
    torch.manual_seed(0)
    head = build_head(settings, tiny_target)
    ids, attn, lm = batch(tiny_target, B=3, T=12)
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(tokens=ids)
    with torch.no_grad():  # move the heads off their initial point so every term has a gradient
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    feats = tiny_target.features(ids, attn, head.feature_layers, lm, top1=cached_top1)
    whole, whole_g = loss_and_grads(head, feats)
    chunks = []
    real = losses.checkpoint
    monkeypatch.setattr(losses, "checkpoint", lambda *a, **k: chunks.append(1) or real(*a, **k))
    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 2 * 96)  # 2 rows of the full vocabulary, 3-4 of a draft one
    parts, parts_g = loss_and_grads(head, feats)
    assert len(chunks) >= 3  # really cut into checkpointed chunks
    for key in whole:
        torch.testing.assert_close(parts[key], whole[key], rtol=1e-5, atol=1e-6)
    assert whole_g.keys() == parts_g.keys() and whole_g
    for name in whole_g:
        torch.testing.assert_close(parts_g[name], whole_g[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kl_rows_matches_the_dense_formula():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(50, 8, generator=g, requires_grad=True)
    h, t = torch.randn(30, 8, generator=g), torch.randn(30, 50, generator=g)
    kl, pred, top = losses.kl_rows(lambda x: x @ W.T, lambda y: (y, y.argmax(-1)), h, t, vocab=50, budget=50 * 4)
    q, p = (h @ W.T).log_softmax(-1), t.log_softmax(-1)
    torch.testing.assert_close(kl, (p.exp() * (p - q)).sum(-1))
    assert torch.equal(pred, q.argmax(-1)) and torch.equal(top, t.argmax(-1))
    kl.sum().backward()
    want = torch.autograd.grad((p.exp() * (p - (h @ W.T).log_softmax(-1))).sum(), W)[0]
    torch.testing.assert_close(W.grad, want)
