"""EAGLE-3's on-policy loss weighting (head.loss_weighting: on_policy, heads/losses.py on_policy_weights).

1. The walk on a hand-built grid of hits: its roots (next root = root + accepted + 1, unsupervised
   roots skipped) and, at each root, the depths up to and including the first miss.
2. On a fitted tiny head the loss is exactly the loop's own steps: the real T = 0 loop
   (SpecDecoder, fp32) runs over a prompt, and the on-policy loss over the prompt + its verified
   continuation equals sum over the loop's steps and the depths each verified of
   ttt_decay^i * KL(target || head at that state), over the number of steps.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draftkit.heads import build_head
from draftkit.heads.losses import on_policy_weights
from draftkit.inference.agreement import loop_trace
from draftkit.inference.decoder import SpecDecoder
from tests.conftest import fit_on_greedy_continuations, make_arch_target

pytestmark = pytest.mark.usefixtures("one_thread")

K, NEW = 3, 24
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 33], [30, 31, 40, 41, 42]]


def test_walk_on_a_hand_built_grid():
    L = 8
    hits = torch.zeros(2, 3, L, dtype=torch.bool)
    sup = torch.zeros(2, 3, L, dtype=torch.bool)
    for d, n in enumerate((7, 6, 5)):  # depth d has a label up to t < n, as the unrolled steps do
        sup[:, d, :n] = True
    hits[0, 0] = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    hits[0, 1] = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    hits[0, 2] = torch.tensor([0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    # row 0: root 0 accepts 2 (depth 2 is the miss) -> root 3 accepts 1 (depth 1 is the miss) -> root 5
    # accepts 2, and depth 2's label there lies past the end (not counted) -> 8: the end. Row 1 misses
    # everything: every position with a label is a root, verified at depth 0 only.
    w = on_policy_weights(hits, sup)
    assert w[0].nonzero().tolist() == [[0, 0], [0, 3], [0, 5], [1, 0], [1, 3], [1, 5], [2, 0]]
    assert w[1, 0].tolist() == [1.0] * 7 + [0.0] and not w[1, 1:].any()
    # the same hits with a hole in the supervision: root 3 is no root, the walk goes on at 4
    sup[0, :, 3] = False
    assert on_policy_weights(hits, sup)[0, 0].nonzero().flatten().tolist() == [0, 4, 5]


@pytest.fixture(scope="module")
def fitted():
    """A tiny target and an EAGLE-3 head (3 TTT steps) fitted on its greedy continuations, so that
    the loop accepts drafts at every depth and misses some."""
    target = make_arch_target("llama")
    torch.manual_seed(0)
    head = build_head({"type": "eagle3", "draft_vocab_size": 48, "ttt_steps": K}, target)
    fit_on_greedy_continuations(target, head, steps=80, prompts=PROMPTS, new_tokens=NEW + K + 1, length=None)
    return target, head.eval()


def test_on_policy_loss_is_the_loops_own_steps(fitted):
    target, head = fitted
    c = head.config
    dec = SpecDecoder(target, head, k=K, stop_ids=[])
    depths, steps = [0] * K, 0
    for prompt in PROMPTS:
        trace = loop_trace(dec, prompt, NEW)
        L, seq = len(prompt), prompt + trace.continuation
        ids = torch.tensor([seq])
        mask = torch.zeros_like(ids)
        mask[0, L + 1:] = 1  # what the loop drafts: the prefill's token x_L is not drafted
        feats = dataclasses.replace(target.features(ids, torch.ones_like(ids), head.feature_layers), loss_mask=mask)
        with torch.no_grad():
            outs = head.unroll(feats)
            want = torch.zeros(())
            for r, acc in zip(trace.roots(L), trace.accepted):
                for i in range(min(acc, K - 1) + 1):  # the accepted depths and the first miss
                    # state (root r, depth i) drafts x_{r+2+i}; the target's distribution for it sits at r+1+i
                    q = torch.log_softmax(head.logits(outs[i][0, r]), -1)
                    tl, top = head.target_on_draft_vocab(feats.final_hidden[0, r + 1 + i][None], None)
                    p = torch.log_softmax(tl.float(), -1)[0]
                    kl = (p.exp() * (p - q)).where(p > float("-inf"), 0.0).sum() * head.t2d[top[0]].float()
                    want += c.ttt_decay ** i * kl
                    depths[i] += 1
            steps += len(trace.accepted)
            want /= len(trace.accepted)
            c.loss_weighting = "on_policy"
            got = head.loss(feats)
            c.loss_weighting = "decay"
            reference = head.loss(feats)["loss"]
        torch.testing.assert_close(got["loss"], want, rtol=1e-5, atol=1e-6)
        assert got["roots"] == pytest.approx(len(trace.accepted) / int(mask[0, 2:].sum()))
        assert not torch.isclose(got["loss"], reference)  # the weighting changes the loss
    assert depths[0] == steps and 0 < depths[K - 1] < depths[1] < steps  # deep states were verified, not all


def test_on_policy_loss_trains(fitted):
    target, head = fitted
    ids = torch.tensor([PROMPTS[1] + [3, 4, 5, 6, 7, 8, 9, 10]])
    feats = target.features(ids, torch.ones_like(ids), head.feature_layers)
    head.config.loss_weighting = "on_policy"
    try:
        head.zero_grad()
        head.loss(feats)["loss"].backward()
        assert head.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    finally:
        head.config.loss_weighting = "decay"
        head.zero_grad()


def test_on_policy_from_schedules_the_switch(fitted):
    """head.on_policy_from = s: the steps before s train with decay, s and after on-policy; the head
    reads the step from steps_done, which the trainer sets (the run test below)."""
    target, head = fitted
    ids = torch.tensor([PROMPTS[1] + [3, 4, 5, 6, 7, 8, 9, 10]])
    feats = target.features(ids, torch.ones_like(ids), head.feature_layers)
    c = head.config
    try:
        with torch.no_grad():
            decay = head.loss(feats)["loss"]
            c.loss_weighting = "on_policy"
            on_policy = head.loss(feats)["loss"]
            c.on_policy_from = 5
            for done, want in ((0, decay), (4, decay), (5, on_policy), (9, on_policy)):
                head.steps_done = done
                got = head.loss(feats)
                torch.testing.assert_close(got["loss"], want, rtol=0, atol=0, msg=f"steps_done={done}")
                assert ("roots" in got) == (done >= 5)
        assert not torch.isclose(decay, on_policy)
    finally:
        c.loss_weighting, c.on_policy_from, head.steps_done = "decay", 0, 0


def test_on_policy_from_without_on_policy_is_refused(fitted):
    from draftkit.heads.base import HeadError

    target, _ = fitted
    with pytest.raises(HeadError, match=r"head.on_policy_from=4 .*loss_weighting is 'decay'"):
        build_head({"type": "eagle3", "draft_vocab_size": 48, "on_policy_from": 4}, target)
    with pytest.raises(HeadError, match=r"head.on_policy_from: a training step >= 0, got -1"):
        build_head({"type": "eagle3", "draft_vocab_size": 48, "loss_weighting": "on_policy",
                    "on_policy_from": -1}, target)
