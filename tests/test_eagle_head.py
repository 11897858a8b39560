import torch

from draftkit.heads import build_head, load_head
from draftkit.heads.eagle import EagleHead
from draftkit.target import FINAL
from tests.conftest import make_tiny_target


def batch(target, B=3, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -3:] = 0  # a right-padded row
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0  # "prompt" tokens
    return ids, attn, loss_mask


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
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = head.loss(feats)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.5 * losses[0]
    head.save_pretrained(tmp_path / "head")
    again = load_head(tmp_path / "head", tiny_target)
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    torch.testing.assert_close(again.loss(feats)["loss"], head.loss(feats)["loss"], rtol=0, atol=0)


def greedy(logits):
    return logits.argmax(-1), None


def test_eagle_draft_matches_training_forward(tiny_target):
    """Drafting with the KV cache equals the full-sequence forward on the same inputs."""
    head = build_head({"type": "eagle", "num_layers": 2}, tiny_target)
    ids, _, _ = batch(tiny_target, B=2, T=10)
    f = tiny_target.features(ids, None, head.feature_layers).hidden
    # Full forward over pairs (f_t, x_{t+1}), t = 0..8
    T = ids.shape[1] - 1
    pos = torch.arange(T).expand(2, -1)
    full = head(f[:, :-1], ids[:, 1:], pos, torch.ones(2, 1, T, T, dtype=torch.bool).tril())
    # Incremental: 6 pairs, then 3 more (the second call discards no speculation when k=1)
    state = head.new_draft_state(2)
    ones = torch.ones(2, 6, dtype=torch.bool)
    tok, _ = head.draft(state, f[:, :6], ids[:, 1:7], ones, 1, greedy)
    assert torch.equal(tok[:, 0], tiny_target.logits(full[:, 5]).float().argmax(-1))
    tok, _ = head.draft(state, f[:, 6:9], ids[:, 7:10], ones[:, :3], 3, greedy)
    assert torch.equal(tok[:, 0], tiny_target.logits(full[:, 8]).float().argmax(-1))
    # The chained second draft equals a forward that feeds f̂ and the first draft back in.
    f2 = torch.cat([f[:, :9], full[:, 8:9]], 1)
    ids2 = torch.cat([ids[:, 1:10], tok[:, :1]], 1)
    pos2 = torch.arange(10).expand(2, -1)
    full2 = head(f2, ids2, pos2, torch.ones(2, 1, 10, 10, dtype=torch.bool).tril())
    assert torch.equal(tok[:, 1], tiny_target.logits(full2[:, 9]).float().argmax(-1))


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


def test_target_fingerprint_is_the_same_in_fp32_and_bf16():
    a = make_tiny_target(seed=5)
    b = make_tiny_target(seed=5, dtype=torch.bfloat16)
    assert a.fingerprint == b.fingerprint
    assert make_tiny_target(seed=6).fingerprint != a.fingerprint
