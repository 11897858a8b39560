"""The cost model (draftkit.inference.cost), on the property it rests on and on its choices.

1. Exactness: the steps, verify widths and output that `simulate` derives from a trace (the head's
   candidate pools and lookup's proposals at every position of an output) equal a real run of the
   loop with that shape, for trees cut from every topk's pool, hybrids with every lookup length (a
   shorter branch may follow another match), head-off rules and lookup alone; on a fitted head, so
   that drafts are accepted and the cut matters. At T = 0 the output is plain decoding's; at T > 0
   it is the sampled run's own (the walk's output is a plain sample, and a run accepts the longest
   prefix of its output in each step's tree).
2. Choices: nothing pays -> plain decoding (and eval reports it); a Medusa head's depth limit is
   respected (no HeadError); an inconsistent profile is said.
"""
from __future__ import annotations

import json

import pytest
import torch

from draftkit.heads import build_head
from draftkit.inference.cost import (Candidate, Costs, auto_draft, candidates, check_costs, choose, format_choice,
                                     measure_costs, predict, simulate, trace_prompt)
from draftkit.inference.decoder import SpecDecoder, plain_generate
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.evaluate import EvalSettings, evaluate
from draftkit.inference.sampling import SamplingParams
from tests.conftest import LOOP_PROMPTS, fit, make_tiny_target
from tests.test_spec_decoder import varied_target

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = LOOP_PROMPTS + [LOOP_PROMPTS[1] * 3]  # the repeat gives lookup matches of several lengths
TOPKS, DEPTH, NEW = (1, 2, 3), 4, 24


@pytest.fixture(scope="module")
def fitted():
    """A varied tiny target, an EAGLE head fitted on its greedy continuations of PROMPTS, the traces."""
    target = varied_target()
    head = build_head({"type": "eagle"}, target)
    ref, _, _ = plain_generate(target, PROMPTS, NEW, stop_ids=[])
    fit(head, target.features(torch.tensor([(p + r)[: NEW + 1] for p, r in zip(PROMPTS, ref)]), None,
                              head.feature_layers), steps=200, lr=2e-2)
    head.eval()
    traces = [trace_prompt(target, head, p, NEW, SamplingParams(), 0, TOPKS, DEPTH, stop_ids=[]) for p in PROMPTS]
    return target, head, traces


SHAPES = [Candidate(3, 4, 12), Candidate(3, 2, 3), Candidate(3, 1, 3), Candidate(3, 1, 2), Candidate(2, 2, 3),
          Candidate(2, 3, 4), Candidate(2, 4, 7), Candidate(3, 2, 8), Candidate(3, 2, 12), Candidate(2, 3, 10),
          Candidate(1, 4, 4), Candidate(1, 2, 2), Candidate(3, 3, 6, 4), Candidate(3, 3, 6, 10),
          Candidate(2, 2, 4, 6, 4), Candidate(1, 3, 3, 8, 2), Candidate(0, 0, 0, 4), Candidate(0, 0, 0, 10)]


def real_run(target, head, c: Candidate, prompt, params: SamplingParams | None = None, seed: int = 0):
    drafter, kw = c.settings(DraftSettings()).decoder_args(head)
    dec = SpecDecoder(target, drafter, stop_ids=[], **kw)
    seen = []  # per tree step: (tokens emitted, verify width)
    dec.observer = lambda tree, v: seen.append((int(v.num_accepted[0]) + 1, int((tree.tokens[0] >= 0).sum()) + 1))
    out, stats = dec.generate([prompt], NEW, params or SamplingParams(), [seed])
    return out[0], stats, seen


def assert_run_is_simulated(c: Candidate, out, stats, seen, trace):
    """The real run (output, stats, observed steps) is what `simulate` gives on the trace of its output."""
    steps = simulate(trace, c)
    assert out == trace.tokens and stats.steps == len(steps), (c.label(), stats.steps, len(steps))
    if c.topk:  # tree steps report to the observer (lookup alone runs the chain); the last step
        # may accept past the end, which the simulation cuts (the output is cut there too)
        assert [w for _, w in seen] == [w for _, w, _ in steps], c.label()
        assert [t for t, _ in seen][:-1] == [t for t, _, _ in steps][:-1], c.label()


@pytest.mark.parametrize("c", SHAPES, ids=lambda c: c.label())
def test_simulated_steps_equal_a_real_run(fitted, c):
    target, head, traces = fitted
    for prompt, trace in zip(PROMPTS, traces):
        out, stats, seen = real_run(target, head, c, prompt)
        assert_run_is_simulated(c, out, stats, seen, trace)  # fp32 T = 0: every shape's output is plain decoding's


def test_the_traces_exercise_what_the_old_model_got_wrong(fitted):
    """The cut must matter: drafts are accepted and a shorter lookup branch follows another match
    than the 10-token one (the old model took the 10-token branch's prefix)."""
    _, _, traces = fitted
    positions = [p for tr in traces for p in tr.positions]
    assert any(p.branches[4] != p.branches[10][:4] for p in positions)
    tokens = sum(len(tr.tokens) - 1 for tr in traces)
    assert tokens / sum(len(simulate(tr, Candidate(3, 4, 12))) for tr in traces) > 2.0


@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_a_sampled_run_is_the_simulation_over_its_own_output(fitted, temperature):
    """T > 0: a real run of every shape at several seeds takes exactly the steps, verify widths and
    per-step tokens that `simulate` gives on the trace of that run's own output; so a plain-sampled
    trace is a real run's trajectory (same law) and the prediction over it unbiased. The model before
    (a renewal over each position's expected reach) gave expected steps, not a run's, and
    over-predicted tau by 0.10-0.12 on an AMX CPU at T = 1."""
    target, head, _ = fitted
    params, accepted = SamplingParams(temperature), 0
    for c in SHAPES:
        for s, prompt in enumerate(PROMPTS):
            out, stats, seen = real_run(target, head, c, prompt, params, 100 + s)
            trace = trace_prompt(target, head, prompt, NEW, params, 0, TOPKS, DEPTH, stop_ids=[], tokens=out)
            assert_run_is_simulated(c, out, stats, seen, trace)
            accepted += stats.new_tokens - stats.steps
    assert accepted > 100  # drafts were accepted at this temperature: deep nodes and lookup matches were checked


def costs(verify_slope: float, plain_ms: float = 10.0) -> Costs:
    verify = {w: 10.0 + verify_slope * w for w in (1, 2, 4, 8, 16, 32, 64)}
    draft = {(k, d): 1.0 * d for k in TOPKS for d in range(1, DEPTH + 1)}
    return Costs(verify, draft, consume_ms=0.5, plain_step_ms=plain_ms, plain_prefill_ms=5.0)


def test_choice_follows_the_costs_and_nothing_paying_is_plain(fitted):
    _, _, traces = fitted
    cands = candidates(TOPKS, DEPTH)
    cheap, rows = choose({0.0: traces}, {0.0: costs(0.0)}, cands)
    assert cheap is not None and rows[0]["speedup"] > 1.5
    # every extra verified token costs a plain step: no shape can pay
    none, rows = choose({0.0: traces}, {0.0: costs(10.0)}, cands)
    assert none is None and rows[0]["speedup"] < 1.0


def test_plain_choice_is_reported_by_eval(fitted):
    target, head, _ = fitted
    report = evaluate(target, head, PROMPTS[:2], EvalSettings(draft=DraftSettings(mode="plain"),
                                                              compare=("plain", "hybrid"), max_new_tokens=8))
    assert report["main"] == "plain" and report["speedup"] == 1.0 and report["tau"] == 1.0
    assert report["draft_description"] == "plain decoding (no drafting)"


def test_auto_on_a_machine_where_nothing_pays_says_plain_in_one_line(fitted, monkeypatch):
    import time

    target, head, _ = fitted
    forward = target.decoder

    def slow(*a, input_ids, **kw):  # a machine where every token fed beyond one costs 12 ms: nothing can pay,
        # and a loaded CPU (a plain step measured a few ms slow) cannot make it look as if it did
        time.sleep(0.012 * (input_ids.shape[1] - 1))
        return forward(*a, input_ids=input_ids, **kw)
    monkeypatch.setattr(target, "decoder", slow)
    chosen, cal = auto_draft(target, head, PROMPTS[:2], topks=(2,), max_depth=2, max_new_tokens=12, rounds=1)
    assert chosen.mode == "plain" and cal.choice is None
    line = format_choice(chosen).splitlines()[0]
    assert "plain decoding" in line and "plain step" in line and "verify" in line


def test_lookup_alone_is_costed_with_its_own_loop_overhead(fitted):
    """Lookup alone runs the chain path, not the hybrid tree the overhead probe runs: auto measures
    its overhead with a lookup run and steps of lookup alone use it (trees keep the probe's)."""
    target, head, _ = fitted
    _, cal = auto_draft(target, head, PROMPTS[:1], topks=(2,), max_depth=2, max_new_tokens=8, rounds=1)
    c = cal.costs[0.0]
    assert c.lookup_overhead_ms is not None and c.lookup_overhead_ms != c.overhead_ms
    lookup, tree = Candidate(0, 0, 0, 4), Candidate(2, 2, 3)
    assert c.step(lookup, 5, False) - c.verify(5) == pytest.approx(c.lookup_ms + c.lookup_overhead_ms)
    assert c.step(tree, 4, True) - c.verify(4) == pytest.approx(c.draft_ms[(2, 2)] + c.overhead_ms)


class Clock:
    """A deterministic clock for the cost model's timings: time.perf_counter reads `now`, which only
    what a test charges advances, in units of 2^-10 s (binary fractions: every sum is exact)."""

    unit = 2.0 ** -10

    def __init__(self):
        self.now = 0.0

    def charge(self, units: float) -> None:
        self.now += self.unit * units

    def ms(self, units: float) -> float:
        return 1e3 * self.unit * units


@pytest.fixture
def clock(monkeypatch):
    import time

    c = Clock()
    monkeypatch.setattr(time, "perf_counter", lambda: c.now)
    return c


def loop_steps(target, head, cand: Candidate, clock: Clock, params=SamplingParams()) -> list[tuple[float, int]]:
    """(ms from one step's walk to the next's, verify width) of each step of a real run of cand on
    PROMPTS[-1], on the clock."""
    drafter, kw = cand.settings(DraftSettings()).decoder_args(head)
    dec = SpecDecoder(target, drafter, stop_ids=[], **kw)
    seen = []  # (time, verify width) at each step's walk
    dec.observer = lambda tree, v: seen.append((clock.now, int((tree.tokens[0] >= 0).sum()) + 1))
    dec.generate([PROMPTS[-1]], NEW, params, [0])
    return [(1e3 * (t1 - t0), w) for (t0, _), (t1, w) in zip(seen, seen[1:])]


def test_sampling_noise_is_priced_as_each_path_draws_it(fitted, clock, monkeypatch):
    """At T > 0 the tree walk draws k + 1 vocabulary rows of 1/Exp(1) noise every step (tree_noise),
    while lookup alone runs the chain path, whose rejection sampler draws one row (the recovered or
    bonus token's). On a clock where a row of noise costs one unit and nothing else takes time, every
    step of a real run of either path costs exactly what Costs.step charges it, and the loop overheads
    calibration measures beside the parts are 0. Priced at k + 1 rows on the chain path too, a lookup
    chain's step came out 5.3 ms (12%) cheaper than it ran on an AMX CPU, its overhead negative."""
    from draftkit.inference import sampling

    target, head, _ = fitted
    draw = sampling.standard_exponential  # every row of Exp(1) noise the loop draws comes from here

    def charged(shape, *a, **kw):
        out = draw(shape, *a, **kw)
        clock.charge(out.numel() / target.vocab_size)
        return out
    monkeypatch.setattr(sampling, "standard_exponential", charged)
    _, cal = auto_draft(target, head, PROMPTS[:1], temperatures=(1.0,), topks=(2,), max_depth=2, max_new_tokens=8,
                        rounds=1)
    c = cal.costs[1.0]
    assert c.noise_ms_per_row == clock.ms(1)
    assert c.overhead_ms == c.shallow_overhead_ms == c.lookup_overhead_ms == 0.0
    for cand in (Candidate(0, 0, 0, 4), Candidate(2, 2, 3, 6)):
        steps = loop_steps(target, head, cand, clock, SamplingParams(temperature=1.0))
        assert len(steps) >= 5 and any(w > 1 for _, w in steps)
        assert all(ms == c.step(cand, w, True) == clock.ms(cand.noise_rows) for ms, w in steps), cand.label()
    assert (Candidate(0, 0, 0, 4).noise_rows, Candidate(2, 2, 3, 6).noise_rows) == (1, 7)


def test_loop_overhead_is_priced_by_the_heads_depth(fitted, clock, monkeypatch):
    """The loop's residual beyond the timed parts grows with the head's depth (AMX, bf16, T = 1: about 3
    ms a step for depth-1 trees, 6-10 for depth-3 hybrids); priced at one mid-size probe, every depth-1
    tree came out 2-5 ms a step dearer than it ran. On a clock where the only time is 1 + 2 d units
    per draft of depth d inside a real loop run (none in the timed parts), calibration's depth-1 and
    depth-3 probes measure 3 and 7 units, and every real step of trees of depth 1, 2 and 3 costs
    exactly what Costs.step charges it: 3, 5 and 7 units."""
    target, head, _ = fitted
    in_loop = [False]
    draft_tree, generate = head.draft_tree, SpecDecoder.generate

    def charged(state, feats, next_tokens, valid, shape):
        clock.charge(1 + 2 * shape.depth if in_loop[0] else 0)
        return draft_tree(state, feats, next_tokens, valid, shape)

    def looping(self, *a, **kw):
        in_loop[0] = True
        try:
            return generate(self, *a, **kw)
        finally:
            in_loop[0] = False
    monkeypatch.setattr(head, "draft_tree", charged)
    monkeypatch.setattr(SpecDecoder, "generate", looping)
    _, cal = auto_draft(target, head, PROMPTS[:1], topks=(2,), max_depth=3, max_new_tokens=8, rounds=1)
    c = cal.costs[0.0]
    assert (c.shallow_overhead_ms, c.overhead_ms, c.overhead_depth) == (clock.ms(3), clock.ms(7), 3)
    for cand in (Candidate(2, 1, 2), Candidate(2, 2, 3), Candidate(2, 3, 4), Candidate(2, 2, 3, 6)):
        steps = loop_steps(target, head, cand, clock)
        assert len(steps) >= 5
        assert all(ms == c.step(cand, w, True) == clock.ms(1 + 2 * cand.depth) for ms, w in steps), cand.label()


def test_calibrated_verify_is_what_the_loops_verify_step_costs(fitted, clock, monkeypatch):
    """verify(w), what the model charges a step of width w, is the time the loop's verify timer
    takes at that width (SpecDecoder.verify_step), not a forward beside it: on a deterministic
    clock where the target's forward of T tokens costs 1 + T units and the rest of the loop's verify
    step, the ancestor mask, the walk and the commit, 3, 5 and 7, every step of a real hybrid run
    took exactly the calibrated verify(w) of its width."""
    from draftkit.inference import cache, decoder, tree as tree_mod

    target, head, _ = fitted

    def charged(fn, units):
        def run(*a, **kw):
            out = fn(*a, **kw)
            clock.charge(units(*a, **kw))
            return out
        return run
    monkeypatch.setattr(target, "decoder", charged(target.decoder, lambda *a, input_ids, **kw: 1 + input_ids.shape[1]))
    monkeypatch.setattr(tree_mod.DraftTree, "ancestor_mask", charged(tree_mod.DraftTree.ancestor_mask, lambda *a: 3))
    monkeypatch.setattr(decoder, "accept_tree", charged(decoder.accept_tree, lambda *a, **kw: 5))
    monkeypatch.setattr(cache.TargetCache, "commit_path", charged(cache.TargetCache.commit_path, lambda *a: 7))

    drafter, kw = Candidate(3, 2, 4, 6).settings(DraftSettings()).decoder_args(head)
    dec = SpecDecoder(target, drafter, stop_ids=[], **kw)
    steps = []  # (verify width, ms the loop's verify timer took)
    dec.on_step = lambda tree, draft_s, verify_s: steps.append((int(tree.num_nodes[0]) + 1, 1e3 * verify_s,
                                                                tree.tokens.shape[1] + 1))
    dec.generate([PROMPTS[-1]], NEW)
    assert all(w == fed for w, _, fed in steps)  # batch 1: every node fed is a node of the tree
    widths = sorted({w for w, _, _ in steps})
    assert len(widths) >= 3
    costs = measure_costs(target, head, PROMPTS[-1], (2,), 1, SamplingParams(), rounds=1, widths=tuple(widths))
    assert [(w, ms) for w, ms, _ in steps] == [(w, costs.verify(w)) for w, _, _ in steps]
    assert costs.verify(widths[0]) == clock.ms(1 + widths[0] + 3 + 5 + 7)


def test_plain_decoding_is_priced_as_a_real_plain_run_pays_it(fitted, clock, monkeypatch):
    """The loop's steps are priced at their parts' minima plus the median residual of a real loop run
    (overhead_ms); plain decoding's step must be priced the same way, or the machine's spread lands on
    one side only (every shape 7-18% pessimistic on a noisy VM). On a clock where two of every three
    target forwards are slowed by 8 units, the minimum-based plain_step_ms is below what a real plain
    run pays per step; the calibrated plain_step() is the median step of a real plain run, and
    predict prices plain decoding at it."""
    from draftkit.inference import cost

    target, head, _ = fitted
    calls, forward = [0], target.decoder

    def noisy(*a, input_ids, **kw):
        out = forward(*a, input_ids=input_ids, **kw)
        calls[0] += 1
        clock.charge(1 + input_ids.shape[1] + (8 if calls[0] % 3 else 0))
        return out
    monkeypatch.setattr(target, "decoder", noisy)
    _, cal = auto_draft(target, head, PROMPTS[:2], topks=(2,), max_depth=2, max_new_tokens=12, rounds=1)
    c = cal.costs[0.0]
    seen = []
    plain_generate(target, [cost._context(PROMPTS[:2], 12)], 33, stop_ids=[], on_step=lambda: seen.append(clock.now))
    gaps = sorted(1e3 * (b - a) for a, b in zip(seen, seen[1:]))
    assert gaps[len(gaps) // 2] == clock.ms(1 + 1 + 8)  # a real run's median step: a slowed forward
    assert c.plain_step() == clock.ms(10)
    assert c.plain_step_ms < c.plain_step()  # the minimum-based step alone would price plain too cheap
    tr, lookup = cal.traces[0.0][0], Candidate(0, 0, 0, 4)
    n = len(tr.tokens) - 1
    plain = tr.prefill_ms + n * c.plain_step()
    assert predict([tr], c, lookup)["speedup"] == pytest.approx(
        plain / (tr.prefill_ms + n * predict([tr], c, lookup)["ms_per_step"] / predict([tr], c, lookup)["tau"]))


def test_others_meter_counts_only_other_processes(monkeypatch):
    """The CPU other processes took over a stretch, in cores: the machine's busy time less this
    process's own, per second of wall time (a timing beside them is said to include them)."""
    import time

    from draftkit.inference import cost

    own, busy = cost.machine_cpu_s()  # the real /proc: the machine's busy time includes this process's
    assert 0 < own <= busy
    readings = iter([(10.0, 100.0), (13.0, 104.5)])  # (own, machine busy) CPU seconds: 3 ours, 1.5 others'
    clock = iter([50.0, 53.0])  # 3 s of wall time
    monkeypatch.setattr(cost, "machine_cpu_s", lambda: next(readings))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    assert cost.others_meter()() == 0.5


def test_auto_respects_a_medusa_heads_depth():
    target = make_tiny_target()
    head = build_head({"type": "medusa", "num_heads": 2}, target).eval()
    chosen, cal = auto_draft(target, head, PROMPTS[:1], max_depth=5, topks=(2,), max_new_tokens=8, rounds=1)
    assert {r["candidate"].depth for r in cal.rows if r["candidate"].topk} == {1, 2}
    assert chosen.depth <= 2  # whatever the mode: eval's head/hybrid comparisons draft with it


def test_inconsistent_profile_is_warned():
    ok = costs(0.1)
    ok.overhead_ms = 0.5
    assert check_costs(ok) == []
    busy = costs(0.1, plain_ms=10.0)
    busy.overhead_ms = 150.0  # a step overhead far above a plain step: another process shared the CPU
    assert any("step overhead" in w for w in check_costs(busy))  # nobody knows whether others ran
    assert any("step overhead" in w for w in check_costs(busy, others_cores=1.0))  # they did
    assert not check_costs(busy, others_cores=0.0)  # a quiet machine: the overhead is the loop's own
    wobbly = costs(0.1)
    wobbly.verify_ms[16] = 0.5 * wobbly.verify_ms[8]
    assert any("verify cost falls" in w for w in check_costs(wobbly))


# ---------------------------------------------------------------------------------------------
# Calibration searches only what the user left unset (draftkit eval --draft calibrate + size flags)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
    """A saved tiny chat target (text prompts work) and an EAGLE head built against it."""
    from tests.test_evaluate import chat_target

    target, root = chat_target(), tmp_path_factory.mktemp("calibrate")
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    build_head({"type": "eagle"}, target).save_pretrained(root / "head")
    return root


def eval_cli(root, out, *flags):
    from draftkit.cli import main as cli
    from tests.test_evaluate import FIXTURES

    return cli(["eval", "--head", str(root / "head"), "--target", str(root / "target"), "--prompts",
                str(FIXTURES / "data" / "mtbench.jsonl"), "--max-new-tokens", "6", "--calibration-prompts", "1",
                "--calibration-budget", "20", "--compare", "none", "--dtype", "float32", "--out", str(out), *flags])


@pytest.mark.parametrize("flags, fixed, mode", [
    (("--tree-topk", "2"), {"topk": 2}, "tree"),
    (("--lookup-len", "6", "--tree-depth", "2"), {"lookup_len": 6, "depth": 2}, "hybrid"),
    (("--tree-budget", "5", "--head-off-at", "4"), {"budget": 5, "head_off_at": 4}, "hybrid"),
], ids=["topk", "lookup+depth", "budget+head_off"])
def test_calibration_searches_only_the_fields_the_user_left_unset(chat_dirs, tmp_path, capsys, monkeypatch,
                                                                    flags, fixed, mode):
    """Every candidate simulated and every trace has the fixed values (and the implied mode); the
    choice printed, written to draft.json and run is the ranking's first row, and its printed and
    saved prediction is that row's (not another shape's with the flags pasted on afterwards)."""
    from draftkit.inference import calibrate as calibrate_module, cost

    seen, cals = [], []
    real_predict, real_auto = cost.predict, calibrate_module.auto_draft
    monkeypatch.setattr(cost, "predict", lambda tr, co, c, n=None: seen.append(c) or real_predict(tr, co, c, n))
    monkeypatch.setattr(calibrate_module, "auto_draft",
                        lambda *a, **k: (lambda out: cals.append(out[1]) or out)(real_auto(*a, **k)))
    assert eval_cli(chat_dirs, tmp_path, "--draft", "calibrate", *flags) == 0
    err = capsys.readouterr().err
    assert seen and len(cals) == 1
    for c in seen:
        assert {f: getattr(c, f) for f in fixed} == fixed, c
        assert c.topk > 0 and (c.lookup_len > 0) == (mode == "hybrid"), c
    for tr in (t for trs in cals[0].traces.values() for t in trs):
        for pos in tr.positions:
            assert "topk" not in fixed or set(pos.ranked) == {fixed["topk"]}
            assert "lookup_len" not in fixed or set(pos.branches) == {fixed["lookup_len"]}
    best = cals[0].rows[0]
    assert cals[0].choice == best["candidate"]  # a fixed mode never falls back to plain decoding
    draft = json.loads((tmp_path / "draft.json").read_text())["draft"]
    want = best["candidate"].settings(DraftSettings())
    assert {f: draft[f] for f in ("mode", "topk", "depth", "budget", "head_off_at")} == \
           {f: getattr(want, f) for f in ("mode", "topk", "depth", "budget", "head_off_at")}
    assert mode != "hybrid" or draft["lookup_len"] == want.lookup_len
    assert draft["mode"] == mode and {f: draft[f] for f in fixed} == fixed
    assert draft["measured"]["predicted"] == best["by_temperature"]
    assert draft["measured"]["fixed"] == {**fixed, "mode": mode}
    line = next(ln for ln in err.splitlines() if ln.startswith("draft auto: ") and "(measured: " in ln)
    p = best["by_temperature"]["0"]
    assert line.startswith(f"draft auto: {DraftSettings.from_dict(draft).describe()}  (measured: predicted "
                           f"T=0: tau {p['tau']:.2f}, {p['speedup']:.2f}x")
    assert json.loads((tmp_path / "report.json").read_text())["draft"] == draft  # what ran


def test_calibration_prompts_default_is_16_for_the_loop_and_4_for_the_vllm_sweep(chat_dirs, tmp_path, capsys,
                                                                                 monkeypatch):
    """Unset, --calibration-prompts traces 16 prompts in our loop (4 left lookup 10's tau 13.5% off on
    Spec-Bench) and sweeps vLLM on 4 (an engine per candidate, no budget); given, it is what both use;
    below 1 it is refused by name."""
    from types import SimpleNamespace

    from draftkit.cli import main as cli
    from draftkit.engines import vllm_eval
    from draftkit.inference import calibrate as cal_mod, cli_eval
    from draftkit.inference.evaluate import EvalPrompt
    from draftkit.target import load_target
    from tests.test_evaluate import FIXTURES

    class Stop(Exception):
        pass

    asked = []

    def record(target, head, prompts, settings, n, *a, **k):
        asked.append(n)
        raise Stop
    monkeypatch.setattr(cli_eval, "calibrate", record)
    base = ["eval", "--head", str(chat_dirs / "head"), "--target", str(chat_dirs / "target"), "--prompts",
            str(FIXTURES / "data" / "mtbench.jsonl"), "--max-new-tokens", "6", "--compare", "none", "--dtype",
            "float32", "--draft", "calibrate"]
    for given, want in ((None, 16), (3, 3)):
        flags = [] if given is None else ["--calibration-prompts", str(given)]
        with pytest.raises(Stop):
            cli(base + ["--out", str(tmp_path / f"loop{given}"), *flags])
        assert asked[-1] == want
    assert cli(base + ["--out", str(tmp_path / "zero"), "--calibration-prompts", "0"]) == 2
    assert "--calibration-prompts must be >= 1, got 0" in capsys.readouterr().err

    target = load_target(str(chat_dirs / "target"), dtype="float32")
    prompts = [EvalPrompt(messages=[{"role": "user", "content": f"prompt number {i}"}], category=None, id=str(i))
               for i in range(6)]

    def spread(items, n, skip=None):
        asked.append(n)
        raise Stop
    monkeypatch.setattr(cal_mod, "calibration_prompts", spread)
    for given, want in ((None, 4), (5, 5)):
        args = SimpleNamespace(calibration_prompts=given, engine_k=[1, 2], max_new_tokens=8, temperature=[0.0],
                               batch_size=1, top_k=None, top_p=None, seed=0)
        with pytest.raises(Stop):
            vllm_eval.measure_engine_draft(args, target, tmp_path, {}, prompts, tmp_path / "engine", "python")
        assert asked[-1] == want


def test_calibration_with_nothing_left_to_choose(chat_dirs, tmp_path, capsys, monkeypatch):
    """--k fixes a whole chain: nothing is measured and the chain runs; an impossible combination
    of fixed fields fails before measuring, naming them."""
    from draftkit.inference import cli_eval

    monkeypatch.setattr(cli_eval, "calibrate", lambda *a, **k: pytest.fail("calibration ran"))
    assert eval_cli(chat_dirs, tmp_path / "k", "--draft", "calibrate", "--k", "3") == 0
    rep = json.loads((tmp_path / "k" / "report.json").read_text())
    assert (rep["draft"]["mode"], rep["draft"]["k"]) == ("chain", 3) and "nothing to calibrate" in rep["draft_source"]
    monkeypatch.undo()
    assert eval_cli(chat_dirs, tmp_path / "x", "--draft", "calibrate", "--tree-topk", "2", "--tree-depth", "1",
                    "--tree-budget", "5") == 2
    assert "no draft shape has topk=2, depth=1, budget=5 in mode tree" in capsys.readouterr().err
