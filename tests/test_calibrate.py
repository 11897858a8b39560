"""Calibration (`draftkit eval --draft auto|calibrate`: inference/calibrate.py, cost.auto_draft) on a
deterministic clock: time.perf_counter moves only when a charged call runs (the target's forward
of T tokens costs 1 + T units, a head draft 2, the head reading positions 1), so every timing is
an exact binary fraction and a round can be made slow on purpose.

1. --calibration-budget cuts the cost rounds (the most that fit in a quarter of the budget, at
   least 3) and the warnings, and so the printed line and the report, say so.
2. The cost of each part is the minimum over the rounds: one slow round, wherever it falls, leaves
   every cost, the ranking and the choice as they were.
3. Plain decoding's step is timed with plain decoding itself (plain_generate), not through the
   speculative loop: the loop's own parts (ancestor mask, walk, commit) are charged and do not
   appear in it.
4. Breadth before length: when the traces' share of the budget cannot hold every prompt at
   max_new_tokens, every prompt is still traced for fewer tokens, and the warnings say so; when
   not all fit at the shortest length allowed, as many as fit are traced at it.
5. Per category: with prompts of several categories the best shape of each category's traces
   alone is reported beside the global choice (plain decoding where none pays there).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from draftkit.heads import build_head
from draftkit.inference import cost, timing
from draftkit.inference.cost import (Calibration, Candidate, Costs, Position, SearchSpace, Trace, auto_draft, choose,
                                     choose_per_category, format_choice, measure_costs, predict)
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.sampling import SamplingParams
from tests.conftest import LOOP_PROMPTS, make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

UNIT = 2.0 ** -10  # seconds per charged unit: binary fractions, so sums and minima are exact
PLAIN_TOKENS = 8  # measure_costs' default: its timed plain run generates 1 + PLAIN_TOKENS tokens
NEW = 6  # calibration's max_new_tokens here (not 1 + PLAIN_TOKENS: the traces' plain runs are not counted)


class Clock:
    """perf_counter that moves only inside charged calls; the rounds in `slow_rounds` (counted by
    the timed plain runs completed, one per round, the warm-up round being 0) are charged SLOW
    times over."""

    SLOW = 50.0

    def __init__(self):
        self.now, self.rounds_done, self.slow_rounds = 0.0, 0, ()

    def __call__(self) -> float:
        return self.now

    def charged(self, fn, units):
        def run(*a, **kw):
            out = fn(*a, **kw)
            self.now += UNIT * units(*a, **kw) * (self.SLOW if self.rounds_done in self.slow_rounds else 1.0)
            return out
        return run


@pytest.fixture
def clocked(monkeypatch):
    """A tiny target and EAGLE head on the Clock; timing.plain_generate counts the rounds' plain runs."""
    target = make_tiny_target()
    head = build_head({"type": "eagle"}, target).eval()
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(target, "decoder",
                        clock.charged(target.decoder, lambda *a, input_ids, **kw: 1 + input_ids.shape[1]))
    monkeypatch.setattr(head, "draft_tree", clock.charged(head.draft_tree, lambda *a, **kw: 2))
    monkeypatch.setattr(head, "tree_root", clock.charged(head.tree_root, lambda *a, **kw: 1))
    real = timing.plain_generate

    def counted(target_, prompts, n, *a, **kw):
        out = real(target_, prompts, n, *a, **kw)
        clock.rounds_done += n == 1 + PLAIN_TOKENS
        return out
    monkeypatch.setattr(timing, "plain_generate", counted)
    return target, head, clock


def calibrate_tiny(target, head, budget_s: float, rounds: int, prompts=(LOOP_PROMPTS[1],), categories=None):
    return auto_draft(target, head, list(prompts), topks=(2,), max_depth=2, max_new_tokens=NEW, rounds=rounds,
                      budget_s=budget_s, categories=categories)


def test_calibration_budget_cuts_the_rounds_and_says_so(clocked):
    """Rounds measured (timed plain runs less the warm-up): all 8 asked for on a large budget, with
    no word; 3 (the floor) on a tiny one; on a budget whose quarter holds 5.5 rounds, 5; each cut
    is a warning naming the budget and the rounds, printed by the choice's line and kept in
    measured["warnings"] (the report's draft)."""
    target, head, clock = clocked
    chosen, cal = calibrate_tiny(target, head, 1e6, rounds=8)
    assert clock.rounds_done - 1 == 8
    assert not any("calibration budget" in w for w in cal.warnings)
    c = cal.costs[0.0]  # every round times alike on this clock: one round of the timed parts, in seconds
    one_round = 1e-3 * (sum(c.verify_ms.values()) + sum(c.draft_ms.values()) + c.plain_run_ms + c.plain_prefill_ms)
    for budget, want in ((1e-6, 3), (4 * 5.5 * one_round, 5)):
        clock.rounds_done = 0
        chosen, cal = calibrate_tiny(target, head, budget, rounds=8)
        assert clock.rounds_done - 1 == want, budget
        said = f"T=0: calibration budget ({budget:.0f} s): costs measured in {want} of 8 rounds"
        assert said in cal.warnings and said in chosen.measured["warnings"]
        assert f"draft auto: warning: {said}" in format_choice(chosen).splitlines()


def test_a_small_budget_traces_every_prompt_for_fewer_tokens(clocked, monkeypatch):
    """Six prompts, 24 new tokens each. A share that holds about half of six whole traces: all six
    are traced, each for fewer tokens (the first by the rate the measured costs predict, the rest
    by the rate seen), within the share, and the warning names how many were cut and to what
    length. A share of about three traces of the shortest length allowed: as many as fit are traced
    at that length (not one, then nothing). Smaller than one: only the first, and the warning says
    1 of 6."""
    target, head, clock = clocked
    monkeypatch.setattr(cost, "MIN_TRACE_TOKENS", 4)
    prompts = LOOP_PROMPTS + [LOOP_PROMPTS[0] + [50], LOOP_PROMPTS[1][:3]]
    space = SearchSpace(topks=(2,), max_depth=2)
    axes, cands = space.axes(2), space.candidates(2)
    bar = SimpleNamespace(update=lambda n=1: None)
    run = cost._Calibrating(target, head, prompts, prompts[0], DraftSettings(), axes, cands, 3, 0, 24, 100.0, bar)
    costs = run.costs(SamplingParams(), 1e6)[0]

    def traced(share):
        start = clock.now
        traces, said = run.traces(SamplingParams(), share, costs)
        return traces, said, clock.now - start

    whole, said, whole_s = traced(1e6)
    assert [len(tr.tokens) for tr in whole] == [24] * 6 and said == []
    traces, said, took = traced(whole_s / 2)
    lens = [len(tr.tokens) for tr in traces]
    assert len(traces) == 6 and all(4 <= n < 24 for n in lens), lens
    assert took <= whole_s / 2 * 1.1, (took, whole_s)
    assert said == [f"calibration budget (100 s): 6 prompts traced for {min(lens)}-{max(lens)} of 24 new tokens"]
    traces, said, took = traced(whole_s / 6 * 4 / 24 * 3)  # about three 4-token traces
    n = len(traces)
    assert 2 <= n < 6 and [len(tr.tokens) for tr in traces] == [4] * n and took <= whole_s / 6 * 4 / 24 * 3 * 1.5
    assert said == [f"calibration budget (100 s): traced {n} of 6 prompts",
                    f"calibration budget (100 s): {n} prompts traced for 4-4 of 24 new tokens"]
    traces, said, _ = traced(whole_s / 6 * 4 / 24 / 2)  # less than one 4-token trace
    assert [len(tr.tokens) for tr in traces] == [4] and said[0] == "calibration budget (100 s): traced 1 of 6 prompts"
    # The default budget (the user set none: not bounded) leaves no prompt out: all six at the shortest
    # length, however long that takes, and the warnings say how far over the share it went.
    run.bounded = False
    traces, said, took = traced(whole_s / 6 * 4 / 24 / 2)
    assert [len(tr.tokens) for tr in traces] == [4] * 6
    assert said[0] == (f"calibration: tracing every prompt for at least 4 new tokens took {took:.0f} s, "
                       f"{took - whole_s / 6 * 4 / 24 / 2:.0f} s over this temperature's share of the default budget "
                       "(100 s); --calibration-budget bounds it, with fewer prompts")


def test_only_a_budget_the_user_set_leaves_prompts_out(clocked, monkeypatch):
    """auto_draft bounds the traces (leaves prompts out) only when budget_s was given."""
    target, head, _ = clocked
    seen = []
    real = cost._Calibrating.traces

    def spy(self, *a, **kw):
        seen.append(self.bounded)
        return real(self, *a, **kw)
    monkeypatch.setattr(cost._Calibrating, "traces", spy)
    for budget in (None, 1e6):
        auto_draft(target, head, [LOOP_PROMPTS[1]], max_new_tokens=6, topks=(1,), max_depth=1, budget_s=budget, rounds=1)
    assert seen == [False, True]


@pytest.mark.parametrize("slow", [(1,), (2,), (3,), (1, 2), (1, 3), (2, 3)], ids=str)
def test_a_slow_round_does_not_move_the_costs(clocked, slow):
    """Three timed rounds (the first decides how many more fit, the other two follow); one or two
    of them charged 50x over (another process shared the CPU then): every cost, the ranking and
    the chosen shape are those of the undisturbed run (the minimum needs one calm round; a mean of
    a later stretch would not do). Prompts of two categories: the global choice is the
    one made without categories, and the per-category choice is reported beside it."""
    target, head, clock = clocked
    prompts, cats = (LOOP_PROMPTS[1], LOOP_PROMPTS[0]), ["a", "b"]
    calm, cal0 = calibrate_tiny(target, head, 1e6, rounds=3, prompts=prompts)
    calm_s = clock.now
    clock.now, clock.rounds_done, clock.slow_rounds = 0.0, 0, slow
    chosen, cal = calibrate_tiny(target, head, 1e6, rounds=3, prompts=prompts, categories=cats)
    assert clock.rounds_done == 4 and clock.now > calm_s + 10 * (calm_s / 6)  # the slow round was charged
    assert cal.costs == cal0.costs
    assert [(r["label"], r["speedup"]) for r in cal.rows] == [(r["label"], r["speedup"]) for r in cal0.rows]
    assert chosen.describe() == calm.describe() and cal.choice == cal0.choice
    assert [tr.category for tr in cal.traces[0.0]] == cats and cal0.per_category == {}
    assert set(cal.per_category) == set(cats) and chosen.measured["per_category"] == cal.per_category


def test_plain_step_is_timed_by_plain_decoding(clocked, monkeypatch):
    """plain_step_ms is one step of plain_generate: one forward of one token (2 units), whatever the
    loop's own parts cost; the loop's verify step of width 1 pays them (ancestor mask 3, walk 5,
    commit 7), so a plain step timed through the loop would read more."""
    from draftkit.inference import cache, decoder, tree as tree_mod

    target, head, clock = clocked
    monkeypatch.setattr(tree_mod.DraftTree, "ancestor_mask",
                        clock.charged(tree_mod.DraftTree.ancestor_mask, lambda *a: 3))
    monkeypatch.setattr(decoder, "accept_tree", clock.charged(decoder.accept_tree, lambda *a, **kw: 5))
    monkeypatch.setattr(cache.TargetCache, "commit_path", clock.charged(cache.TargetCache.commit_path, lambda *a: 7))
    ctx = LOOP_PROMPTS[1] * 2
    c = measure_costs(target, head, ctx, (2,), 1, SamplingParams(), rounds=1, widths=(1, 2, 4))
    ms = 1e3 * UNIT
    assert c.plain_prefill_ms == ms * (1 + len(ctx))
    assert c.plain_step_ms == ms * 2
    assert c.verify(1) == ms * (2 + 3 + 5 + 7)


# ---------------------------------------------------------------------------------------------
# Per category: fake measurements (hand-made traces and costs)
# ---------------------------------------------------------------------------------------------


def fake_trace(category: str, lookup: bool, head: bool, n: int = 17) -> Trace:
    """A T = 0 trace of n tokens where lookup's 4-token branch is always right (lookup), the head's
    pool of topk 2 holds the next two tokens as a chain (head), or neither proposes anything."""
    y = [3 + (7 * i) % 50 for i in range(n)]
    positions = []
    for i in range(n - 1):
        fut = y[i + 1:]
        pool = [(tuple(fut[:d]), d) for d in (1, 2) if d <= len(fut)] if head else []
        positions.append(Position({4: fut[:4] if lookup else []}, {2: pool}))
    return Trace(4, y, 0.0, positions, prefill_ms=5.0, head_prefill_ms=1.0, category=category)


FAKE_COSTS = Costs({1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}, {(2, 1): 1.0, (2, 2): 2.0}, consume_ms=0.5, plain_step_ms=10.0,
                   plain_prefill_ms=5.0, lookup_ms=0.5, overhead_ms=0.5)
TREE, LOOKUP, HYBRID = Candidate(2, 2, 2), Candidate(0, 0, 0, 4), Candidate(2, 2, 2, 4)


def test_best_shape_per_category_beside_the_global_choice():
    """Lookup's category is won by lookup alone, the head's by the tree, and where nothing is
    accepted no shape pays: plain decoding. The global choice (all prompts pooled, unchanged) is
    the hybrid, which wins neither category; the one-line message, measured["per_category"] and
    the report's per-category table say each category's pick."""
    from draftkit.inference.report import format_markdown, format_table

    traces = [fake_trace("lookup", True, False), fake_trace("head", False, True), fake_trace("none", False, False)]
    by_cat = {tr.category: tr for tr in traces}
    cands = [TREE, LOOKUP, HYBRID]
    per = choose_per_category({0.0: traces}, {0.0: FAKE_COSTS}, cands)
    assert list(per) == ["head", "lookup", "none"]
    assert {cat: r["shape"] for cat, r in per.items()} == {"lookup": "lookup 4", "head": "tree 2x2 b2",
                                                           "none": "plain decoding"}
    for cat, cand in (("lookup", LOOKUP), ("head", TREE)):
        assert per[cat]["speedup"] == round(predict([by_cat[cat]], FAKE_COSTS, cand)["speedup"], 4) > 1.5
        assert per[cat]["choice"]["topk"] == cand.topk and per[cat]["choice"]["lookup_len"] == cand.lookup_len
    assert per["none"]["choice"] is None and per["none"]["speedup"] == 1.0 and per["none"]["best_speedup"] < 1.0
    glob, rows = choose({0.0: traces}, {0.0: FAKE_COSTS}, cands)
    assert glob == HYBRID

    cal = Calibration({0.0: traces}, {0.0: FAKE_COSTS}, rows, glob, [], 1.0, per)
    target = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    chosen = cost._settings(DraftSettings(), cal, target, SearchSpace())
    assert chosen.mode == "hybrid" and chosen.measured["per_category"] == per
    line = format_choice(chosen).splitlines()[0]
    assert (f"per category: head: tree 2x2 b2 {per['head']['speedup']:.2f}x, lookup: lookup 4 "
            f"{per['lookup']['speedup']:.2f}x, none: plain decoding;") in line
    report = {"draft": chosen.to_dict(), "draft_description": chosen.describe(), "runs": []}
    md = format_markdown(report)
    assert "## Draft shape per category (calibration)" in md
    assert f"| none | 1 | plain decoding | 1.00x | {per['none']['best']} | {per['none']['best_speedup']:.2f}x |" in md
    assert f"| lookup | 1 | lookup 4 | {per['lookup']['speedup']:.2f}x |" in md
    assert "Draft shape per category" in format_table(report)
    one = choose_per_category({0.0: [fake_trace("x", True, False), fake_trace("x", False, True)]}, {0.0: FAKE_COSTS},
                              cands)
    assert one == {}  # one category: the global choice is the whole story


def test_a_cut_trace_predicts_the_run_the_user_asked_for(monkeypatch):
    """A trace cut short by the budget (15 new tokens) predicts, for a run of 65, the speedup and
    tau of the whole 65-token trace: its steps stand for the run's tokens at its own rate, so the
    prefill weighs what it will weigh in the run. auto_draft ranks for its run_tokens (default:
    max_new_tokens, the traces' longest)."""
    whole, cut = fake_trace("x", True, False, n=66), fake_trace("x", True, False, n=16)  # lookup: 5 tokens a step
    for cand in (LOOKUP, HYBRID, TREE):
        full = predict([whole], FAKE_COSTS, cand)
        assert predict([cut], FAKE_COSTS, cand, new_tokens=66) == pytest.approx(full, rel=1e-12)
        assert predict([whole], FAKE_COSTS, cand, new_tokens=66) == pytest.approx(full, rel=1e-12)
    assert predict([cut], FAKE_COSTS, LOOKUP)["speedup"] < 0.95 * predict([whole], FAKE_COSTS, LOOKUP)["speedup"]
    seen = []
    real = cost.choose
    monkeypatch.setattr(cost, "choose", lambda *a: seen.append(a[-1]) or real(*a))
    target = make_tiny_target()
    torch.manual_seed(0)
    head = build_head({"type": "eagle"}, target).eval()
    auto_draft(target, head, [LOOP_PROMPTS[1]], max_new_tokens=9, topks=(1,), max_depth=1, budget_s=30.0, rounds=1)
    assert seen and set(seen) == {9}
    seen.clear()
    _, cal = auto_draft(target, head, [LOOP_PROMPTS[1]], max_new_tokens=9, topks=(1,), max_depth=1, budget_s=30.0,
                        rounds=1, run_tokens=40)
    assert seen and set(seen) == {40} and max(len(tr.tokens) for tr in cal.traces[0.0]) <= 9


def test_calibrate_passes_each_prompts_category(monkeypatch):
    """calibrate() hands auto_draft each picked prompt's category, aligned with its ids (prompts
    without one are the uncategorized "all"), and eval's max_new_tokens as the length of the runs
    predicted (the traces stay at most MAX_CALIBRATION_TOKENS)."""
    from draftkit.inference import calibrate as calibrate_module
    from draftkit.inference.evaluate import EvalPrompt, EvalSettings

    seen = {}

    def fake_auto(target, head, prompts, base, **kw):
        seen.update(prompts=prompts, categories=kw["categories"], tokens=(kw["max_new_tokens"], kw["run_tokens"]))
        return DraftSettings(mode="plain", chosen_by="measured: fake"), None
    monkeypatch.setattr(calibrate_module, "auto_draft", fake_auto)
    prompts = [EvalPrompt(None, "a", "p0", [5, 6, 7]), EvalPrompt(None, "a", "p1", [8, 9]),
               EvalPrompt(None, "b", "p2", [10, 11]), EvalPrompt(None, None, "p3", [12, 13, 14])]
    calibrate_module.calibrate(make_tiny_target(), None, prompts, EvalSettings(max_new_tokens=8), n=3, progress=False)
    assert list(zip(seen["prompts"], seen["categories"])) == [([5, 6, 7], "a"), ([10, 11], "b"), ([12, 13, 14], "all")]
    calibrate_module.calibrate(make_tiny_target(), None, prompts, EvalSettings(max_new_tokens=300), n=3, progress=False)
    assert seen["tokens"] == (calibrate_module.MAX_CALIBRATION_TOKENS, 300)  # traced short, predicted for the run
