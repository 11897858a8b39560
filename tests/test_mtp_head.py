import pytest
import torch

from draftkit.heads import HeadError, build_head, load_head
from draftkit.target import FINAL

from tests.conftest import LOOP_PROMPTS, batch, fit, fit_on_greedy_continuations, greedy


def test_mtp_reads_the_final_norm_output(tiny_target):
    """Depth 0 reads the post-norm hidden (what the lm_head reads, what vLLM hands its MTP drafter)."""
    head = build_head({"type": "mtp"}, tiny_target)
    assert head.feature_layers == (FINAL,)
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    logits = tiny_target.model(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(tiny_target.logits(feats.hidden), logits, rtol=0, atol=0)
    # the loss really consumes features.hidden (not some other tensor): perturbing it changes it
    base = head.loss(feats)["loss"]
    feats.hidden = feats.hidden + 1.0
    assert not torch.equal(head.loss(feats)["loss"], base)
    with pytest.raises(HeadError, match="MTP reads the final norm output"):
        build_head({"type": "mtp", "feature_layers": [3]}, tiny_target)


def test_mtp_shapes_and_names(tiny_target):
    head = build_head({"type": "mtp", "num_depths": 2}, tiny_target)
    names = set(head.state_dict())
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "mtp_block.self_attn.q_proj.weight",
              "mtp_block.input_layernorm.weight", "shared_head.norm.weight"):
        assert f"layers.0.{n}" in names and f"layers.1.{n}" in names
    assert not any("lm_head" in n or "shared_head.head" in n or "embed" in n for n in names)
    H = tiny_target.hidden_size
    assert head.layers[0].eh_proj.weight.shape == (H, 2 * H)
    ids, attn, lm = batch(tiny_target)
    outs = head.unroll(tiny_target.features(ids, attn, head.feature_layers, lm))
    assert [o.shape for o in outs] == [(3, 11, H)] * 2
    tok, probs = head.draft(head.new_draft_state(3), tiny_target.features(ids, None).hidden[:, :5], ids[:, 1:6],
                            torch.ones(3, 5, dtype=torch.bool), 5, lambda lg: (lg.argmax(-1), lg.softmax(-1)))
    assert tok.shape == (3, 5) and probs.shape == (3, 5, tiny_target.vocab_size)


def test_mtp_loss_decreases_and_save_load_roundtrip(tiny_target, tmp_path):
    head = build_head({"type": "mtp", "num_depths": 2, "depth_weights": [1.0, 0.5]}, tiny_target)
    ids, attn, lm = batch(tiny_target)
    feats = tiny_target.features(ids, attn, head.feature_layers, lm)
    losses, out = fit(head, feats, steps=30, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0]
    torch.testing.assert_close(out["loss"].detach(), out["kl_0"] + 0.5 * out["kl_1"])
    head.save_pretrained(tmp_path / "head")
    again = load_head(tmp_path / "head", tiny_target)
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    torch.testing.assert_close(again.loss(feats)["loss"], head.loss(feats)["loss"], rtol=0, atol=0)


def test_mtp_drafts_equal_teacher_forced_depths(tiny_target):
    """Draft d after consuming 0..t (fed the true tokens) == depth d of the training forward at t,
    whether the prefix arrives in one call or in pieces; drafts past D keep chaining."""
    D, k = 3, 5
    head = build_head({"type": "mtp", "num_depths": D}, tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=14, seed=5)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    train = [head.logits(d, o) for d, o in enumerate(head.unroll(tiny_target.features(ids, None)))]  # (B, T-1, V)
    for t, cuts in ((0, [1]), (4, [5]), (7, [2, 3, 8])):
        state, start = head.new_draft_state(2), 0
        for end in cuts:
            seen = []

            def teacher(logits, t=end - 1, seen=seen):
                seen.append(logits)
                return ids[:, min(t + 1 + len(seen), ids.shape[1] - 1)], None  # x_{t+2+j}

            tok, _ = head.draft(state, f[:, start:end], ids[:, start + 1:end + 1],
                                torch.ones(2, end - start, dtype=torch.bool), k, teacher)
            start = end
        assert tok.shape == (2, k)
        for d in range(D):
            torch.testing.assert_close(seen[d], train[d][:, t], rtol=1e-4, atol=1e-5)


def test_mtp_ragged_rows_equal_single_rows(tiny_target):
    head = build_head({"type": "mtp", "num_depths": 2}, tiny_target)
    with torch.no_grad():  # make the depths differ from their (identical-looking) init
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids, _, _ = batch(tiny_target, B=2, T=10, seed=3)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    state = head.new_draft_state(2)
    valid = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    tok_b, _ = head.draft(state, f[:, :6], ids[:, 1:7], valid, 3, greedy)
    valid2 = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)  # a hole in the middle of row 0
    tok_b2, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], valid2, 3, greedy)
    for r, n1, keep in ((0, 6, [6, 8]), (1, 4, [6, 7, 8])):
        s = head.new_draft_state(1)
        t1, _ = head.draft(s, f[r:r + 1, :n1], ids[r:r + 1, 1:n1 + 1], torch.ones(1, n1, dtype=torch.bool), 3, greedy)
        assert torch.equal(t1[0], tok_b[r])
        keep = torch.tensor(keep)
        ones = torch.ones(1, len(keep), dtype=torch.bool)
        t2, _ = head.draft(s, f[r:r + 1, keep], ids[r:r + 1, keep + 1], ones, 3, greedy)
        assert torch.equal(t2[0], tok_b2[r])


def test_mtp_bad_input(tiny_target, tmp_path):
    with pytest.raises(HeadError, match="head.num_depths: must be >= 1"):
        build_head({"type": "mtp", "num_depths": 0}, tiny_target)
    with pytest.raises(HeadError, match="head.depth_weights: 1 weights for 2 depths"):
        build_head({"type": "mtp", "num_depths": 2, "depth_weights": [1.0]}, tiny_target)
    head = build_head({"type": "mtp"}, tiny_target)
    head.save_pretrained(tmp_path / "h")
    with pytest.raises(HeadError, match="holds a 'mtp' head, not 'eagle'"):
        load_head(tmp_path / "h", expected_family="eagle")


def test_mtp_greedy_loop_is_lossless(tiny_target):
    from draftkit.inference import decoder as dec
    head = build_head({"type": "mtp", "num_depths": 2}, tiny_target)
    ref = fit_on_greedy_continuations(tiny_target, head, steps=10)
    for k in (2, 4):  # k = 4 > num_depths: the last depth chains
        out, stats = dec.SpecDecoder(tiny_target, head, k=k).generate(LOOP_PROMPTS, max_new_tokens=16)
        assert out == ref
        assert stats.tau > 1.5