"""T = 0 outputs vs plain decoding, the teacher-forced near-tie criterion (draftkit.inference.stats).

1. A true near-tie is excused: a tiny target whose top two log-probabilities at one prefix are set
   0.05 nats apart; the swap is excused with a gap above that and is a failure below it.
2. A planted swap outside the gap (the least likely token) fails, named in "failures".
3. bf16 verify forwards round differently from 1-token steps: every divergence of real drafters
   on a bf16 target is excused, scored on the float32 copy, made once and only when needed.
"""
from __future__ import annotations

import pytest
import torch

from draftkit.heads import build_head
from draftkit.inference.decoder import SpecDecoder, plain_generate
from draftkit.inference.ngram import NgramDrafter
from draftkit.inference.stats import TeacherForced, compare_greedy, tie_gap
from tests.conftest import make_arch_target, make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 30, 40]]


def set_runner_up(target, prefix: list[int], gap: float) -> tuple[int, int]:
    """Make the token ranked below the top at `prefix` exactly `gap` nats below it: its lm_head row
    becomes the top token's minus gap * h / |h|^2 (h the final hidden state there). The token is one
    absent from the prefix, so its (tied) embedding change leaves h as it was. Returns (top, runner-up)."""
    with torch.no_grad():
        out = target.model(torch.tensor([prefix]), output_hidden_states=True)
        h = out.hidden_states[-1][0, -1]  # (H,) final norm output
        order = out.logits[0, -1].argsort(descending=True).tolist()
        top = order[0]
        runner = next(t for t in order[1:] if t not in prefix)
        w = target.model.lm_head.weight
        w[runner] = w[top] - gap * h / h.dot(h)
    return top, runner


def test_a_true_near_tie_is_excused_and_only_within_the_gap():
    target = make_tiny_target()
    ref, _, _ = plain_generate(target, PROMPTS, 8, stop_ids=[])
    i = 3  # row 0 swaps its 4th token
    top, runner = set_runner_up(target, PROMPTS[0] + ref[0][:i], 0.05)
    ref, _, _ = plain_generate(target, PROMPTS, 8, stop_ids=[])
    assert ref[0][i] == top
    swapped = [ref[0][:i] + [runner] + ref[0][i + 1:]] + ref[1:]
    scorer = TeacherForced(target)
    ok = compare_greedy(swapped, ref, PROMPTS, scorer, names=["a", "b", "c"], gap=0.1)
    assert ok["mismatches"] == 1 and ok["near_ties"] == 1 and ok["failures"] == []
    d = ok["divergences"][0]
    assert (d["prompt"], d["index"], d["got"], d["expected"]) == ("a", i, runner, top)
    assert d["gap_expected"] == 0.0 and d["gap_got"] == pytest.approx(0.05, abs=1e-4)
    assert ok["max_gap"] == d["gap"] and ok["tolerance"] == 0.1
    tight = compare_greedy(swapped, ref, PROMPTS, scorer, names=["a", "b", "c"], gap=0.01)
    assert tight["near_ties"] == 0 and len(tight["failures"]) == 1 and "prompt a token 3" in tight["failures"][0]
    # fp32's default gap is 1e-3 nats: a 0.05-nat swap is not fp32 rounding
    assert compare_greedy(swapped, ref, PROMPTS, scorer)["near_ties"] == 0 and tie_gap(torch.float32) == 1e-3


def test_a_planted_swap_outside_the_gap_fails():
    target = make_arch_target("llama", seed=1)
    ref, _, _ = plain_generate(target, PROMPTS, 10, stop_ids=[])
    scorer = TeacherForced(target)
    worst = int(scorer.logprobs(PROMPTS[1] + ref[1][:5]).argmin())
    bad = [ref[0], ref[1][:5] + [worst] + ref[1][6:], ref[2]]
    res = compare_greedy(bad, ref, PROMPTS, scorer, gap=0.5)
    assert res["mismatches"] == 1 and res["near_ties"] == 0
    assert res["failures"] == [f"prompt 1 token 5: got {worst}, expected {ref[1][5]} "
                               f"({res['max_gap']:.3f} nats below the top > 0.5)"]
    assert res["max_gap"] > 2.0
    assert compare_greedy(ref, ref, PROMPTS, scorer) == {"mismatches": 0, "near_ties": 0, "failures": [],
                                                         "max_gap": None, "tolerance": 1e-3, "divergences": []}
    short = compare_greedy([ref[0][:4]] + ref[1:], ref, PROMPTS, scorer)  # a row that ended early
    assert short["failures"] == [f"prompt 0 token 4: got None, expected {ref[0][4]} (not scored)"]
    assert compare_greedy(bad, ref, PROMPTS, None)["near_ties"] == 0  # no scorer: nothing is excused


def test_bf16_divergences_are_near_ties():
    """Real drafters on a bf16 target: every divergence from plain decoding is within the gap of
    the float32 top, and the float32 copy is made once, only when there is a divergence to score."""
    target = make_arch_target("llama", seed=1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (6, 9, 12, 7, 10, 5)]
    ref, _, _ = plain_generate(target, prompts, 24, stop_ids=[])
    scorer = TeacherForced(target)
    assert compare_greedy(ref, ref, prompts, scorer)["mismatches"] == 0 and scorer._model is None
    torch.manual_seed(0)
    head = build_head({"type": "eagle"}, target).to(torch.bfloat16).eval()
    seen = 0
    for drafter in (head, NgramDrafter()):
        out, _ = SpecDecoder(target, drafter, 5, stop_ids=[]).generate(prompts, 24)
        res = compare_greedy(out, ref, prompts, scorer)
        assert res["failures"] == [], res
        seen += res["mismatches"]
    assert seen > 0  # there were divergences to excuse
    copy = scorer.model
    assert copy is not target.model and next(copy.parameters()).dtype == torch.float32 and scorer.model is copy
