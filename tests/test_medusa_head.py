import pytest
import torch

from draftkit.heads import HeadError, build_head, load_head
from draftkit.inference.typical import typical_acceptance
from draftkit.target import FINAL, TargetError

from tests.conftest import LOOP_PROMPTS, batch, greedy


def trained(target, steps=5, **kw):
    """A head whose blocks are no longer the identity, so heads differ from each other."""
    head = build_head({"type": "medusa", **kw}, target)
    ids, attn, lm = batch(target, seed=11)
    feats = target.features(ids, attn, head.feature_layers, lm)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        head.loss(feats)["loss"].backward()
        opt.step()
    return head


def test_medusa_starts_as_the_target_and_shapes(tiny_target):
    head = build_head({"type": "medusa"}, tiny_target)
    assert head.feature_layers == (FINAL,) and head.max_draft_tokens == 4
    ids, attn, _ = batch(tiny_target)
    f = tiny_target.features(ids, attn, head.feature_layers).hidden  # (B, T, H) the lm_head input
    logits = tiny_target.model(input_ids=ids, attention_mask=attn).logits
    for i in range(4):  # zero-initialised blocks + the target's lm_head = the target's own logits
        torch.testing.assert_close(head.head_logits(i, f), logits, rtol=0, atol=1e-6)
    names = set(head.state_dict())
    assert "medusa_head.0.0.linear.weight" in names and "medusa_head.3.1.weight" in names
    shared = build_head({"type": "medusa", "share_lm_head": True, "num_layers": 2}, tiny_target)
    assert not any(n.endswith(".2.weight") for n in shared.state_dict())
    blocks = list(shared.medusa_head[0])
    assert len(blocks) == 2 and blocks[0].linear.weight is not blocks[1].linear.weight
    assert sum(p.numel() for p in shared.parameters()) < sum(p.numel() for p in head.parameters())


@pytest.mark.parametrize("share", [False, True])
def test_medusa_loss_decreases_and_save_load_roundtrip(tiny_target, tmp_path, share):
    head = build_head({"type": "medusa", "share_lm_head": share, "num_heads": 3}, tiny_target)
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-2 if share else 3e-3)  # the frozen lm_head is small
    losses = []
    for _ in range(30):
        out = head.loss(feats)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.5 * losses[0]
    assert {"acc", "acc_2", "kl_2"} <= set(out)
    head.save_pretrained(tmp_path / "head")
    again = load_head(tmp_path / "head", tiny_target)
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    torch.testing.assert_close(again.loss(feats)["loss"], head.loss(feats)["loss"], rtol=0, atol=0)


def test_medusa_loss_weights(tiny_target):
    head = build_head({"type": "medusa", "num_heads": 3, "weight_decay_per_head": 0.5}, tiny_target)
    assert head.config.weights() == [1.0, 0.5, 0.25]
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    out = head.loss(feats)
    torch.testing.assert_close(out["loss"], out["kl_0"] + 0.5 * out["kl_1"] + 0.25 * out["kl_2"])


def test_medusa_draft_matches_training_forward(tiny_target):
    """Draft i after the newest token = head i's prediction at that position in training."""
    head = trained(tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=10, seed=4)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    state = head.new_draft_state(2)
    ones = torch.ones(2, 6, dtype=torch.bool)
    probs_seen = []

    def sample(logits):
        probs_seen.append(logits.softmax(-1))
        return logits.argmax(-1), probs_seen[-1]

    tok, probs = head.draft(state, f[:, :6], ids[:, 1:7], ones, 4, sample)
    for i in range(4):
        train_logits = head.head_logits(i, f)[:, 5]  # what the loss at t = 5 scores for x_{5+i+2}
        assert torch.equal(tok[:, i], train_logits.argmax(-1))
        torch.testing.assert_close(probs[:, i], train_logits.softmax(-1))
    assert len({tuple(t) for t in tok.T.tolist()}) > 1  # the heads do differ


def test_medusa_ragged_rows_equal_single_rows(tiny_target):
    head = trained(tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=10, seed=3)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    state = head.new_draft_state(2)
    valid = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    tok_b, _ = head.draft(state, f[:, :6], ids[:, 1:7], valid, 3, greedy)
    for r, n in enumerate([6, 4]):
        t1, _ = head.draft(head.new_draft_state(1), f[r:r + 1, :n], ids[r:r + 1, 1:n + 1],
                           torch.ones(1, n, dtype=torch.bool), 3, greedy)
        assert torch.equal(t1[0], tok_b[r])
    # a row that confirms nothing this call keeps drafting from its last feature
    tok_c, _ = head.draft(state, f[:, 6:7], ids[:, 7:8], torch.tensor([[True], [False]]), 3, greedy)
    assert torch.equal(tok_c[1], tok_b[1])


def test_typical_acceptance():
    V = 4
    target = torch.tensor([[[0.97, 0.01, 0.01, 0.01],    # confident: bar = min(0.09, 0.3 e^-H) ~ 0.26*.. small
                            [0.25, 0.25, 0.25, 0.25],    # uniform: bar = min(0.09, 0.3/4) = 0.075
                            [0.9, 0.05, 0.03, 0.02]]])
    assert typical_acceptance(torch.tensor([[0, 1, 0]]), target).tolist() == [3]
    assert typical_acceptance(torch.tensor([[0, 1, 3]]), target).tolist() == [2]  # 0.02 < bar
    assert typical_acceptance(torch.tensor([[1, 1, 0]]), target).tolist() == [0]  # 0.01 < bar, stops
    assert typical_acceptance(torch.tensor([[0, 2, 0]]), target, epsilon=0.3, delta=10.0).tolist() == [1]
    assert typical_acceptance(torch.tensor([[0, -1, 0]]), target).tolist() == [1]  # -1 = no draft
    assert target.shape[-1] == V


def test_medusa_bad_input(tiny_target, tmp_path):
    with pytest.raises(HeadError, match="head.num_heads: Medusa needs at least one head"):
        build_head({"type": "medusa", "num_heads": 0}, tiny_target)
    with pytest.raises(HeadError, match="head.head_weights: 2 weights for 4 heads"):
        build_head({"type": "medusa", "head_weights": [1.0, 0.5]}, tiny_target)
    with pytest.raises(TargetError, match="head.medusa.feature_layers: layer 7"):
        build_head({"type": "medusa", "feature_layers": [7]}, tiny_target)
    with pytest.raises(HeadError, match="Medusa reads the final norm output"):
        build_head({"type": "medusa", "feature_layers": [2]}, tiny_target)
    head = build_head({"type": "medusa", "num_heads": 2}, tiny_target)
    f = torch.zeros(1, 1, tiny_target.hidden_size)
    with pytest.raises(HeadError, match="k=3"):
        head.draft(head.new_draft_state(1), f, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                   3, greedy)
    head.save_pretrained(tmp_path / "h")
    with pytest.raises(HeadError, match="holds a 'medusa' head, not 'eagle3'"):
        load_head(tmp_path / "h", expected_family="eagle3")


def test_medusa_greedy_loop_is_lossless(tiny_target):
    from draftkit.inference import decoder as dec
    prompts = LOOP_PROMPTS
    ref, _, _ = dec.plain_generate(tiny_target, prompts, max_new_tokens=16)
    head = build_head({"type": "medusa"}, tiny_target)  # identity blocks: this target repeats, all accepted
    out, stats = dec.SpecDecoder(tiny_target, head, k=4).generate(prompts, max_new_tokens=16)
    assert out == ref and stats.tau > 3
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.5 * torch.randn_like(p))
    out, stats = dec.SpecDecoder(tiny_target, head, k=4).generate(prompts, max_new_tokens=16)
    assert out == ref


# ---- typical acceptance in the verify loop (LOSSY option; the default stays rejection sampling) ----


def peaked_target():
    """The tiny target with a sharper final norm: entropy ~3.7 nats at T = 0.7 instead of ~log V,
    where typical acceptance's bar (delta * e^-H) would let every token through."""
    from tests.conftest import make_tiny_target
    t = make_tiny_target()
    with torch.no_grad():
        t.model.model.norm.weight.mul_(5.0)
    return t


def test_typical_loop_accepts_more_and_is_lossless_only_at_t0(one_thread):
    from draftkit.inference.decoder import SpecDecoder, plain_generate
    from draftkit.inference.sampling import SamplingParams
    target = peaked_target()
    prompts = LOOP_PROMPTS
    head = build_head({"type": "medusa"}, target)
    default = SpecDecoder(target, head, k=4)
    assert default.acceptance == "rejection" and default.lossless and default.acceptance_label == "rejection (lossless)"
    typical = SpecDecoder(target, head, k=4, acceptance="typical")
    assert not typical.lossless and typical.acceptance_label == "typical (lossy, eps=0.09, delta=0.3)"
    params, seeds = SamplingParams(0.7), [0, 1, 2, 3]
    _, rej = default.generate(prompts, 24, params, seeds)
    _, typ = typical.generate(prompts, 24, params, seeds)
    assert sum(typ.accepted_at) >= sum(rej.accepted_at) and typ.tau > rej.tau
    # T = 0: the processed distribution is one-hot, so the rule is exact match and output = plain decoding
    ref, _, _ = plain_generate(target, prompts, 16)
    assert typical.generate(prompts, 16)[0] == ref and default.generate(prompts, 16)[0] == ref


def test_typical_verify_accepts_what_rejection_sampling_would_not(one_thread):
    """A draft with p = 0.4 (above the bar, not the argmax): rejection sampling keeps it in ~40% of
    rows, as losslessness demands; typical acceptance keeps it in every row: lossy, and more accepted."""
    from draftkit.inference.decoder import sample_fn
    from draftkit.inference.typical import typical_verify
    from draftkit.inference.rejection import RejectionSampler
    from draftkit.inference.sampling import SamplingParams, make_generators
    B, V = 256, 8
    p = torch.tensor([0.5, 0.4] + [0.1 / (V - 2)] * (V - 2))
    logits = p.log().expand(B, 2, V).clone()  # T = 1 gives back p at both positions
    drafts = torch.ones(B, 1, dtype=torch.long)
    num_draft = torch.ones(B, dtype=torch.long)
    params = SamplingParams(1.0)
    _, n_rej = RejectionSampler("torch")(drafts, None, logits, num_draft, params, make_generators(range(B), "cpu"))
    out, n_typ = typical_verify(drafts, logits, num_draft, params, sample_fn(params, make_generators(range(B), "cpu")))
    assert n_typ.tolist() == [1] * B and 0.25 < n_rej.float().mean() < 0.55
    assert torch.equal(out[:, 0], drafts[:, 0]) and (out[:, 1] >= 0).all()  # the bonus is the target's draw
    # rows offering fewer drafts, a rejected draft, greedy: the target's argmax follows the accepted prefix
    logits = torch.zeros(2, 3, V)
    logits[:, :, 3] = 5.0
    logits[1, 1, 5] = 9.0
    out, n = typical_verify(torch.tensor([[3, 3], [3, 1]]), logits, torch.tensor([1, 2]), SamplingParams(),
                            sample_fn(SamplingParams(), None))
    assert n.tolist() == [1, 1] and out.tolist() == [[3, 3, -1], [3, 5, -1]]


def test_typical_settings_are_checked(tiny_target):
    from draftkit.inference.decoder import SpecDecoder
    from draftkit.inference.errors import SpecError
    head = build_head({"type": "medusa"}, tiny_target)
    with pytest.raises(SpecError, match="acceptance must be one of rejection, typical"):
        SpecDecoder(tiny_target, head, k=2, acceptance="greedy")
    with pytest.raises(SpecError, match="typical_delta"):
        SpecDecoder(tiny_target, head, k=2, acceptance="typical", typical_delta=-1.0)
