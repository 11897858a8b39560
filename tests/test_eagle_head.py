import pytest
import torch

from draftkit.heads import HeadError, build_head, load_head
from draftkit.heads.eagle import EagleHead
from draftkit.target import FINAL
from tests.conftest import LOOP_PROMPTS, batch, fit, fit_on_greedy_continuations, greedy, make_tiny_target


def test_eagle_feature_is_lm_head_input(tiny_target):
    ids, attn, _ = batch(tiny_target)
    feats = tiny_target.features(ids, attn, (FINAL,))
    logits = tiny_target.model(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(tiny_target.logits(feats.hidden), logits, rtol=0, atol=0)
    head = build_head({"type": "eagle"}, tiny_target)
    assert head.feature_layers == (FINAL,)


def test_eagle_loss_decreases_and_save_load_roundtrip(tiny_target, tmp_path):
    head = build_head({"type": "eagle"}, tiny_target)
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    losses, out = fit(head, feats, steps=30, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0]
    head.save_pretrained(tmp_path / "head")
    again = load_head(tmp_path / "head", tiny_target)
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    torch.testing.assert_close(again.loss(feats)["loss"], head.loss(feats)["loss"], rtol=0, atol=0)


def prefix_forward(head, f, ids, window: int | None = None):
    """Reference without any mask formula: each layer's output at t is that layer run on the previous
    layer's outputs at 0..t ALONE (window: at the last `window` positions t-window+1..t alone), every
    key visible (nothing else exists), last row taken.
    f (B, n, H) features, ids (B, n) next tokens -> (B, n, H)."""
    B, n = ids.shape
    dtype = head.fc.weight.dtype
    x = head.fc(torch.cat([head.embed(ids, dtype), f.to(dtype)], dim=-1))  # position-wise
    cos, sin = head.cos_sin(torch.arange(n).expand(B, -1), dtype)
    lo = [0 if window is None else max(0, t - window + 1) for t in range(n)]
    for layer in head.layers:
        x = torch.stack([layer(x[:, lo[t]:t + 1], x[:, lo[t]:t + 1], cos[:, lo[t]:t + 1], sin[:, lo[t]:t + 1],
                               torch.ones(B, 1, t + 1 - lo[t], t + 1 - lo[t], dtype=torch.bool))[:, -1]
                         for t in range(n)], 1)
    return x


def test_eagle_draft_matches_training_forward(tiny_target):
    """Drafting with the KV cache equals the head run on each prefix alone."""
    head = build_head({"type": "eagle", "num_layers": 2}, tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=10)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    full = prefix_forward(head, f[:, :-1], ids[:, 1:])  # pairs (f_t, x_{t+1}), t = 0..8
    # Incremental: 6 pairs, then 3 more (the second call discards no speculation when k=1)
    state = head.new_draft_state(2)
    ones = torch.ones(2, 6, dtype=torch.bool)
    tok, _ = head.draft(state, f[:, :6], ids[:, 1:7], ones, 1, greedy)
    assert torch.equal(tok[:, 0], tiny_target.logits(full[:, 5]).float().argmax(-1))
    tok, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], ones[:, :3], 3, greedy)
    assert torch.equal(tok[:, 0], tiny_target.logits(full[:, 8]).float().argmax(-1))
    # The chained second draft equals the prefix run that feeds f̂ and the first draft back in.
    f2 = torch.cat([f[:, :9], full[:, 8:9]], 1)
    ids2 = torch.cat([ids[:, 1:10], tok[:, :1]], 1)
    full2 = prefix_forward(head, f2, ids2)
    assert torch.equal(tok[:, 1], tiny_target.logits(full2[:, 9]).float().argmax(-1))


def test_eagle_training_forward_sees_exactly_the_prefix(tiny_target):
    """The loss's full-sequence forward (causal mask over a right-padded batch) gives, at every real
    position, what the head computes from that row's prefix alone: no peeking at later tokens."""
    head = build_head({"type": "eagle", "num_layers": 2}, tiny_target)
    ids, attn, lm = batch(tiny_target, B=3, T=12)  # row 1: 9 real tokens, 3 pads
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    seen = {}
    head.register_forward_hook(lambda mod, args, out: seen.setdefault("pred", out))
    head.loss(feats)
    for row, n in ((0, 12), (1, 9), (2, 12)):
        f = tiny_target.features(ids[row:row + 1, :n], None, head.feature_layers).hidden
        with torch.no_grad():
            want = prefix_forward(head, f[:, :-1], ids[row:row + 1, 1:n])[0]  # (n-1, H)
        torch.testing.assert_close(seen["pred"][row, :n - 1], want, rtol=1e-5, atol=1e-5)


def test_eagle_ragged_rows_equal_single_rows(tiny_target):
    """A padded batch drafts exactly what each row drafts alone."""
    head = build_head({"type": "eagle"}, tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=10, seed=3)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    valid = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    state = head.new_draft_state(2)
    tok_b, _ = head.draft(state, f[:, :6], ids[:, 1:7], valid, 3, greedy)
    valid2 = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    tok_b2, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], valid2, 3, greedy)
    for r, (n1, n2) in enumerate([(6, 2), (4, 3)]):
        s = head.new_draft_state(1)
        t1, _ = head.draft(s, f[r:r + 1, :n1], ids[r:r + 1, 1:n1 + 1], torch.ones(1, n1, dtype=torch.bool), 3, greedy)
        assert torch.equal(t1[0], tok_b[r])
        # the second chunk for row r continues from where its own first chunk ended (in the batch
        # the padded slots are holes, positions continue per row)
    s = head.new_draft_state(1)
    head.draft(s, f[1:2, :4], ids[1:2, 1:5], torch.ones(1, 4, dtype=torch.bool), 3, greedy)
    t2, _ = head.draft(s, f[1:2, 6:9], ids[1:2, 7:10], torch.ones(1, 3, dtype=torch.bool), 3, greedy)
    assert torch.equal(t2[0], tok_b2[1])


def test_eagle_attention_window_drafts_as_the_head_run_on_each_window_alone(tiny_target):
    """head.attention_window = W (the window vLLM puts on a drafter on a sliding-window target: the
    engine loop sets it): every cached and chained step equals the head run on its last W positions
    alone, counted in positions, not cache slots (row 1 is padded in the first call, so its later
    slots sit two past its positions), and the window changes the logits (it is not a no-op here)."""
    W = 4
    head = build_head({"type": "eagle", "num_layers": 2}, tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=12, seed=3)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    seen = []

    def record(logits):
        seen.append(logits)
        return greedy(logits)

    head.attention_window = W
    state = head.new_draft_state(2)
    head.draft(state, f[:, :6], ids[:, 1:7], torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool), 1, record)
    toks, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], torch.ones(2, 3, dtype=torch.bool), 3, record)
    head.attention_window = None
    for r, n1 in ((0, 6), (1, 4)):  # row r's pairs in order: n1 from the first call, 3 from the second
        pick = list(range(n1)) + [6, 7, 8]
        fr, ir = f[r:r + 1, pick], ids[r:r + 1, [i + 1 for i in pick]]
        first = prefix_forward(head, fr[:, :n1], ir[:, :n1], W)[0, -1]
        torch.testing.assert_close(seen[0][r], tiny_target.logits(first).float(), rtol=1e-4, atol=1e-4)
        full = prefix_forward(head, fr, ir, W)  # (1, n1 + 3, H)
        torch.testing.assert_close(seen[1][r], tiny_target.logits(full[0, -1]).float(), rtol=1e-4, atol=1e-4)
        # the chained second draft: f-hat and the first draft fed back in, still windowed
        f2, i2 = torch.cat([fr, full[:, -1:]], 1), torch.cat([ir, toks[r:r + 1, :1]], 1)
        torch.testing.assert_close(seen[2][r], tiny_target.logits(prefix_forward(head, f2, i2, W)[0, -1]).float(),
                                   rtol=1e-4, atol=1e-4)
        whole = prefix_forward(head, fr, ir)[0, -1]  # the whole context: other logits
        assert not torch.allclose(seen[1][r], tiny_target.logits(whole).float(), rtol=1e-3, atol=1e-3)


def test_target_fingerprint_is_the_same_in_fp32_and_bf16():
    a = make_tiny_target(seed=5)
    b = make_tiny_target(seed=5, dtype=torch.bfloat16)
    assert a.fingerprint == b.fingerprint
    assert make_tiny_target(seed=6).fingerprint != a.fingerprint


# ---- draft vocabulary (head.draft_vocab_size) ----

def vocab_head(target, n=40, **kw):
    head = build_head({"type": "eagle", "draft_vocab_size": n, **kw}, target)
    ids, _, _ = batch(target, B=8, T=16, seed=7)
    head.set_draft_vocab(tokens=ids)
    return head


def test_eagle_draft_vocab_loss_decreases_and_save_load_roundtrip(tiny_target, tmp_path):
    head = vocab_head(tiny_target)
    assert head.d2t.shape == (40,) and int(head.t2d.sum()) == 40
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    losses, out = fit(head, feats, steps=30, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0]
    assert not any(k.startswith("_") or "vocab_w" in k for k in head.state_dict())  # the cached rows are not saved
    head.save_pretrained(tmp_path / "head")
    again = load_head(tmp_path / "head", tiny_target)
    assert list(head.state_dict()) == list(again.state_dict())
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d) and again.t2d.dtype == torch.bool
    torch.testing.assert_close(again.loss(feats)["loss"], head.loss(feats)["loss"], rtol=0, atol=0)


def test_eagle_draft_vocab_kl_is_restricted_and_acc_uses_the_full_vocab(tiny_target):
    head = vocab_head(tiny_target)
    g = torch.Generator().manual_seed(0)
    pred, final = torch.randn(20, 32, generator=g), torch.randn(20, 32, generator=g)
    out = head.distill_loss(pred, torch.zeros(20, 32), final)
    tgt = tiny_target.logits(final).float()
    p = tgt[:, head.draft_ids].log_softmax(-1)
    q = tiny_target.logits(pred).float()[:, head.draft_ids].log_softmax(-1)
    inside = head.t2d[tgt.argmax(-1)]
    kl = (p.exp() * (p - q)).sum(-1)[inside].mean()
    torch.testing.assert_close(out["kl"], kl)
    acc = (head.draft_ids[q.argmax(-1)] == tgt.argmax(-1)).float().mean()
    torch.testing.assert_close(out["acc"], acc, rtol=0, atol=0)


def test_eagle_draft_vocab_drafts_match_training_forward(tiny_target):
    """Drafted token == argmax over the draft vocab of the full-sequence forward, mapped to target ids."""
    head = vocab_head(tiny_target, num_layers=2)
    ids, _, _ = batch(tiny_target, B=2, T=10)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    full = prefix_forward(head, f[:, :-1], ids[:, 1:])
    seen = []

    def sample(logits):
        seen.append(logits)
        return logits.argmax(-1), None

    state = head.new_draft_state(2)
    tok, _ = head.draft(state, f[:, :6], ids[:, 1:7], torch.ones(2, 6, dtype=torch.bool), 1, sample)
    assert torch.equal(tok[:, 0], head.draft_ids[head.draft_logits(full[:, 5]).argmax(-1)])
    tok, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], torch.ones(2, 3, dtype=torch.bool), 3, sample)
    assert torch.equal(tok[:, 0], head.draft_ids[head.draft_logits(full[:, 8]).argmax(-1)])
    # sample saw the draft vocabulary's logits only (N of them, all finite), not a -inf-padded row of V
    assert all(s.shape == (2, head.d2t.shape[0]) and torch.isfinite(s).all() for s in seen)


def test_eagle_draft_vocab_drafts_stay_inside(tiny_target):
    head = vocab_head(tiny_target, n=12)
    ids, _, _ = batch(tiny_target, B=3, T=10, seed=4)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    gen = torch.Generator().manual_seed(0)

    def sample(logits):
        p = logits.softmax(-1)
        return torch.multinomial(p, 1, generator=gen)[:, 0], p

    tok, probs = head.draft(head.new_draft_state(3), f[:, :8], ids[:, 1:9], torch.ones(3, 8, dtype=torch.bool), 5, sample)
    assert tok.shape == (3, 5) and head.t2d[tok].all()
    assert (probs[:, :, ~head.t2d] == 0).all()


def test_eagle_draft_vocab_cache_follows_vocab_and_dtype(tiny_target):
    head = vocab_head(tiny_target)
    h = torch.randn(3, 32)
    first = head.draft_logits(h)
    torch.testing.assert_close(first, tiny_target.logits(h).float()[:, head.draft_ids], rtol=0, atol=0)
    head.set_draft_vocab(counts=torch.arange(tiny_target.vocab_size))  # the 40 highest ids now
    assert head.draft_ids.tolist() == list(range(56, 96))
    torch.testing.assert_close(head.draft_logits(h), tiny_target.logits(h).float()[:, 56:], rtol=0, atol=0)
    bf = make_tiny_target(dtype=torch.bfloat16)
    head.attach(bf)
    assert head.draft_logits(h).shape == (3, 40) and head._vocab_w[1].dtype == torch.bfloat16


def test_eagle_draft_vocab_bad_size_and_default_unchanged(tiny_target):
    with pytest.raises(HeadError, match="head.draft_vocab_size: 200"):
        build_head({"type": "eagle", "draft_vocab_size": 200}, tiny_target)
    # None: no buffers, set_draft_vocab is a no-op, loss and drafts over the full vocabulary as before
    plain = build_head({"type": "eagle"}, tiny_target)
    keys = list(plain.state_dict())
    plain.set_draft_vocab(tokens=[[5, 6, 7]])
    assert list(plain.state_dict()) == keys and not any(k in ("d2t", "t2d") for k in keys)
    g = torch.Generator().manual_seed(0)
    pred, feat, final = (torch.randn(20, 32, generator=g) for _ in range(3))
    out = plain.distill_loss(pred, feat, final)
    p, q = tiny_target.logits(final).float().log_softmax(-1), tiny_target.logits(pred).float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).sum() / 20
    f = torch.nn.functional.smooth_l1_loss(pred, feat, reduction="none").mean(-1).sum() / 20
    torch.testing.assert_close(out["kl"], kl, rtol=0, atol=0)
    torch.testing.assert_close(out["loss"], f + 0.1 * kl, rtol=0, atol=0)


def test_eagle_draft_vocab_greedy_loop_is_lossless(tiny_target):
    from draftkit.inference import decoder as dec
    head = build_head({"type": "eagle", "draft_vocab_size": 48}, tiny_target)
    ref = fit_on_greedy_continuations(tiny_target, head, steps=20)
    out, stats = dec.SpecDecoder(tiny_target, head, k=3).generate(LOOP_PROMPTS, max_new_tokens=16)
    assert out == ref
    assert stats.tau > 1.2

def test_eagle_feature_noise_perturbs_inputs_only_and_only_in_training(tiny_target):
    """The reference's U(-a, a) augmentation: on the input features, not on the regression target."""
    torch.manual_seed(0)
    noisy = build_head({"type": "eagle", "feature_noise": 0.1}, tiny_target)
    clean = build_head({"type": "eagle"}, tiny_target)
    clean.load_state_dict(noisy.state_dict())
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, noisy.feature_layers, lm)
    seen = {}
    noisy.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], pred=out))
    out = noisy.loss(feats)
    delta = seen["x"] - feats.hidden[:, :-1].float()
    assert 0.05 < delta.abs().max() <= 0.1 and delta.std() > 0.03  # really U(-0.1, 0.1)
    # the feature loss compares the prediction with the CLEAN next features
    valid = attn[:, 1:].bool() & attn[:, :-1].bool()
    sup = torch.zeros_like(valid)
    sup[:, :-1] = lm[:, 2:].bool() & valid[:, :-1]
    want = torch.nn.functional.smooth_l1_loss(seen["pred"][sup], feats.hidden[:, 1:][sup].float())
    torch.testing.assert_close(out["feat_loss"], want)
    assert noisy.loss(feats)["loss"] != out["loss"]  # fresh noise every step
    noisy.eval()  # eval: no noise, the same as a head without it
    torch.testing.assert_close(noisy.loss(feats)["loss"], clean.loss(feats)["loss"], rtol=0, atol=0)
    with pytest.raises(HeadError, match="head.feature_noise"):
        build_head({"type": "eagle", "feature_noise": -0.1}, tiny_target)
