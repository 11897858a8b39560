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
    feats = tiny_target.features(ids, None, head.feature_layers)
    train = [head.logits(o) for o in head.unroll(feats)]  # each (B, T-1, N)
    for t in (0, 3, 6):
        seen = []

        def teacher(logits, t=t):
            i = len(seen)
            seen.append(logits[:, head.draft_ids])
            return ids[:, t + 2 + i], None  # feed the ground truth x_{t+2+i}

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
