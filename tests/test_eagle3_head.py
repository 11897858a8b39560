import pytest
import torch

from draftkit.heads import HeadError, build_head, load_head
from draftkit.heads.eagle3 import build_draft_vocab
from draftkit.target import TargetError
from tests.conftest import LOOP_PROMPTS, batch, fit, fit_on_greedy_continuations, greedy, make_tiny_target


def head_for(target, **kw):
    head = build_head({"type": "eagle3", "draft_vocab_size": 64, "ttt_steps": 3, **kw}, target)
    ids, _, _ = batch(target, B=8, T=16, seed=7)
    head.set_draft_vocab(tokens=ids)
    return head


def test_eagle3_default_layers_follow_the_input_convention():
    target = make_tiny_target(layers=8)
    head = build_head({"type": "eagle3"}, target)
    assert head.feature_layers == (2, 4, 5)  # 2, N//2, N-3: residual stream entering those layers
    assert head.config.draft_vocab_size == target.vocab_size  # min(32000, V)
    ids, attn, _ = batch(target)
    feats = target.features(ids, attn, head.feature_layers)
    hs = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats.hidden, torch.cat([hs[2], hs[4], hs[5]], -1), rtol=0, atol=0)


def test_eagle3_draft_vocab():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 2])
    d2t, t2d = build_draft_vocab(4, 8, counts=counts)
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 6]  # top-4 by count, ascending target id
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]
    d2t2, _ = build_draft_vocab(4, 8, tokens=[[0, 2, 2, 3], torch.tensor([3, 6, 0])])
    assert (torch.arange(4) + d2t2).tolist() == [0, 2, 3, 6]
    with pytest.raises(HeadError, match="draft_vocab_size"):
        build_draft_vocab(9, 8, counts=counts)


def test_eagle3_shapes_and_target_ids(tiny_target):
    head = head_for(tiny_target)
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    assert feats.hidden.shape == (3, 12, 3 * tiny_target.hidden_size)
    outs = head.unroll(feats)
    assert len(outs) == 3 and all(o.shape == (3, 11, tiny_target.hidden_size) for o in outs)
    assert head.lm_head.weight.shape == (64, tiny_target.hidden_size)
    # lm_head starts as the target's rows of the draft tokens
    torch.testing.assert_close(head.lm_head.weight, tiny_target.lm_head.weight[head.draft_ids])
    probs_seen = []

    def softmax_sample(logits):
        p = logits.softmax(-1)
        probs_seen.append(p)
        return p.argmax(-1), p

    state = head.new_draft_state(3)
    ones = torch.ones(3, 5, dtype=torch.bool)
    tok, probs = head.draft(state, feats.hidden[:, :5], ids[:, 1:6], ones, 4, softmax_sample)
    assert tok.shape == (3, 4) and probs.shape == (3, 4, tiny_target.vocab_size)
    assert head.t2d[tok].all()  # target ids, inside the draft vocabulary
    assert (probs[:, :, ~head.t2d] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))


def test_eagle3_loss_decreases_and_save_load_roundtrip(tiny_target, tmp_path):
    head = head_for(tiny_target)
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    losses, out = fit(head, feats, steps=20, lr=5e-3)
    assert losses[-1] < 0.5 * losses[0]
    assert {"acc", "acc_0", "acc_2", "kl_2"} <= set(out)
    head.save_pretrained(tmp_path / "head")
    again = load_head(tmp_path / "head", tiny_target)
    assert list(head.state_dict()) == list(again.state_dict())
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    assert torch.equal(again.d2t, head.d2t) and again.t2d.dtype == torch.bool
    torch.testing.assert_close(again.loss(feats)["loss"], head.loss(feats)["loss"], rtol=0, atol=0)


def test_eagle3_ttt_equals_sequential_drafts(tiny_target):
    """Step i of the unrolled training forward at position t == the i-th chained draft after
    consuming the prefix 0..t, when the chain is fed the same tokens."""
    head = head_for(tiny_target, ttt_steps=4)
    ids, _, _ = batch(tiny_target, B=2, T=12, seed=5)
    head.set_draft_vocab(tokens=ids)  # the chain samples over the draft vocabulary: feed it tokens it has
    draft_of = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft index
    assert head.t2d[ids].all()
    feats = tiny_target.features(ids, None, head.feature_layers)
    train = [head.logits(o) for o in head.unroll(feats)]  # each (B, T-1, N)
    for t in (0, 3, 6):
        seen = []

        def teacher(logits, t=t):
            i = len(seen)
            seen.append(logits)  # (B, N) over the draft vocabulary
            return draft_of[ids[:, t + 2 + i]], None  # feed the ground truth x_{t+2+i}

        state = head.new_draft_state(2)
        head.draft(state, feats.hidden[:, :t + 1], ids[:, 1:t + 2], torch.ones(2, t + 1, dtype=torch.bool), 4, teacher)
        for i in range(4):
            torch.testing.assert_close(seen[i], train[i][:, t], rtol=1e-4, atol=1e-5)


def test_eagle3_ragged_rows_equal_single_rows(tiny_target):
    head = head_for(tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=10, seed=3)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    state = head.new_draft_state(2)
    valid = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    tok_b, _ = head.draft(state, f[:, :6], ids[:, 1:7], valid, 3, greedy)
    valid2 = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    tok_b2, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], valid2, 3, greedy)
    for r, (n1, n2) in enumerate([(6, 2), (4, 3)]):
        s = head.new_draft_state(1)
        t1, _ = head.draft(s, f[r:r + 1, :n1], ids[r:r + 1, 1:n1 + 1], torch.ones(1, n1, dtype=torch.bool), 3, greedy)
        assert torch.equal(t1[0], tok_b[r])
        ones = torch.ones(1, n2, dtype=torch.bool)
        t2, _ = head.draft(s, f[r:r + 1, 6:6 + n2], ids[r:r + 1, 7:7 + n2], ones, 3, greedy)
        assert torch.equal(t2[0], tok_b2[r])


def test_eagle3_bad_input(tiny_target, tmp_path):
    with pytest.raises(TargetError, match=r"head.eagle3.feature_layers: layer 9"):
        build_head({"type": "eagle3", "feature_layers": [1, 2, 9]}, tiny_target)
    with pytest.raises(HeadError, match="head.feature_layers: EAGLE-3 fuses exactly three"):
        build_head({"type": "eagle3", "feature_layers": [1, 2]}, tiny_target)
    with pytest.raises(HeadError, match="head.draft_vocab_size: 200"):
        build_head({"type": "eagle3", "draft_vocab_size": 200}, tiny_target)
    head = head_for(tiny_target)
    head.save_pretrained(tmp_path / "h")
    with pytest.raises(HeadError, match="holds a 'eagle3' head, not 'medusa'"):
        load_head(tmp_path / "h", expected_family="medusa")


def test_eagle3_greedy_loop_is_lossless(tiny_target):
    from draftkit.inference import decoder as dec
    head = build_head({"type": "eagle3", "draft_vocab_size": 64, "ttt_steps": 3}, tiny_target)
    ref = fit_on_greedy_continuations(tiny_target, head, steps=10)
    out, stats = dec.SpecDecoder(tiny_target, head, k=3).generate(LOOP_PROMPTS, max_new_tokens=16)
    assert out == ref
    assert stats.tau > 1.5

def dense_unroll_mask(valid, step):
    """The step's mask written out entry by entry: query t sees step-0 key s when s <= t and s is
    valid, or s == t; and key t of every earlier step j >= 1 (its own diagonal)."""
    B, L = valid.shape
    m = torch.zeros(B, 1, L, (step + 1) * L, dtype=torch.bool)
    for b in range(B):
        for t in range(L):
            for s in range(L):
                m[b, 0, t, s] = bool(s == t or (s <= t and valid[b, s]))
            for j in range(1, step + 1):
                m[b, 0, t, j * L + t] = True
    return m


@pytest.mark.parametrize("budget", [1 << 24, 64])  # one chunk / many checkpointed chunks
@pytest.mark.parametrize("prefix", [True, False])  # right padding / holes anywhere
def test_unrolled_attention_equals_the_dense_mask_with_gradients(monkeypatch, budget, prefix):
    from draftkit.heads import layers

    monkeypatch.setattr(layers, "UNROLL_CHUNK_ELEMENTS", budget)
    g = torch.Generator().manual_seed(0)
    B, h, kvh, L, d = 2, 4, 2, 7, 8
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, 5:] = False
    if not prefix:
        valid[0, 2] = False
    for step in range(4):
        q = torch.randn(B, h, L, d, generator=g, requires_grad=True)
        k = torch.randn(B, kvh, (step + 1) * L, d, generator=g, requires_grad=True)
        v = torch.randn(B, kvh, (step + 1) * L, d, generator=g, requires_grad=True)
        mask = dense_unroll_mask(valid, step)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        got = layers.UnrolledMask(valid, step).attend(q, k, v)
        rows = valid if (step == 0 and prefix) else torch.ones_like(valid)  # causal path: padded queries are free
        torch.testing.assert_close(got.transpose(1, 2)[rows], want.transpose(1, 2)[rows], rtol=1e-5, atol=1e-6)
        w = torch.randn(got.shape, generator=g) * rows[:, None, :, None]
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
        want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_eagle3_padded_rows_unroll_as_alone_in_chunks(tiny_target, monkeypatch):
    """A right-padded row's unrolled outputs equal that row unrolled alone, with the attention cut
    into many checkpointed chunks (the length-2048 path) — and the loss's gradients equal one chunk's."""
    from draftkit.heads import layers

    head = head_for(tiny_target, ttt_steps=3)
    ids, attn, lm = batch(tiny_target, B=3, T=12, seed=2)  # row 1 right-padded by 3
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    whole = head.unroll(feats)
    head.zero_grad()
    head.loss(feats)["loss"].backward()
    want = {n: p.grad.clone() for n, p in head.named_parameters()}
    monkeypatch.setattr(layers, "UNROLL_CHUNK_ELEMENTS", 4 * 12 * 3)
    parts = head.unroll(feats)
    alone = head.unroll(tiny_target.features(ids[1:2, :9], attn[1:2, :9], head.feature_layers))
    for i in range(3):
        torch.testing.assert_close(parts[i], whole[i], rtol=1e-5, atol=1e-6)
        n = 8 - i  # positions whose step-i token x_{t+1+i} is real in the row (later ones read pads)
        torch.testing.assert_close(parts[i][1, :n], alone[i][0, :n], rtol=1e-5, atol=1e-6)
    head.zero_grad()
    head.loss(feats)["loss"].backward()
    for n, p in head.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_token_counts_equal_the_python_loop_they_replace():
    """token_counts is one bincount; it must count exactly what the old per-token loop counted."""
    from collections import Counter

    from draftkit.heads.vocab import token_counts

    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (30,), generator=g)]
    masks = [torch.randint(0, 2, (len(s),), generator=g).tolist() for s in samples]
    old = Counter(t for s, m in zip(samples, masks) for t, k in zip(s, m) if k)  # the trainer's former loop
    want = torch.tensor([old[v] for v in range(50)])
    assert torch.equal(token_counts(samples, 50, masks=masks), want)
    assert torch.equal(token_counts([t for s, m in zip(samples, masks) for t, k in zip(s, m) if k], 50), want)
    assert torch.equal(token_counts([torch.tensor(s) for s in samples], 50, masks=[torch.tensor(m) for m in masks]), want)
    every = Counter(t for s in samples for t in s)
    assert torch.equal(token_counts(samples, 50), torch.tensor([every[v] for v in range(50)]))
    assert torch.equal(token_counts([[1, 1], torch.tensor([3])], 4), torch.tensor([0, 2, 0, 1]))
    assert torch.equal(token_counts([], 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(HeadError, match="3 token ids but 2 mask values"):
        token_counts([[1, 2, 3]], 4, masks=[[1, 0]])
    with pytest.raises(HeadError, match=r"must lie in 0..3, got 1..7"):
        token_counts([[1, 7]], 4)
