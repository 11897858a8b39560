"""Teacher-forced agreement (draftkit/inference/agreement.py, benchmarks/acceptance_gap.py).

1. Depth 1 equals a hand computation: one parallel forward of the EAGLE head over the whole
   sequence with the target's features (as head.loss runs it), argmax / top-k against the
   continuation and against the target's own top-1 at every position.
2. The loop and the teacher-forced drafts agree step for step at T = 0 in fp32: at every root
   the loop visited, its accepted count equals the teacher-forced leading-agreement count (depth
   d fed the head's own drafts and features), and the replayed SpecStats equal the loop's exactly.
3. Tally's counts on a hand-built Agreement; the benchmark's verdicts follow their own figures;
   the benchmark end to end on a tiny chat target.
"""
from __future__ import annotations

import pytest
import torch

from draftkit.heads import build_head
from draftkit.heads.layers import causal_mask
from draftkit.inference.agreement import loop_trace, replay, teacher_forced, training_features
from draftkit.inference.decoder import SpecDecoder
from tests.conftest import fit_on_greedy_continuations, make_arch_target

pytestmark = pytest.mark.usefixtures("one_thread")

K, NEW = 4, 24
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 33], [30, 31, 40, 41, 42]]


@pytest.fixture(scope="module")
def setup():
    """A tiny target whose greedy output varies, and an EAGLE head (48-token draft vocabulary)
    fitted on its continuations so that drafts are accepted at every depth."""
    target = make_arch_target("llama")
    torch.manual_seed(0)
    head = build_head({"type": "eagle", "draft_vocab_size": 48}, target)
    fit_on_greedy_continuations(target, head, steps=80, prompts=PROMPTS, new_tokens=NEW + K + 1, length=None)
    return target, head.eval()


def test_depth1_equals_a_parallel_forward(setup):
    target, head = setup
    prompt = PROMPTS[1]
    cont = loop_trace(SpecDecoder(target, head, k=K, stop_ids=[]), prompt, NEW).continuation
    feats, top1, prob = training_features(target, head.feature_layers, prompt + cont)
    a = teacher_forced(head, prompt, cont, feats, top1, K, topk=3, top1_prob=prob)
    seq = torch.tensor([prompt + cont])  # (1, T)
    T, L = seq.shape[1], len(prompt)
    f = target.features(seq, torch.ones_like(seq), head.feature_layers)
    with torch.no_grad():
        pred = head(f.hidden[:, :-1], seq[:, 1:], torch.arange(T - 1)[None], causal_mask(torch.ones(1, T - 1)))
        logits = head._logits(pred)[0]  # (T-1, V): root r predicts x_{r+2}
    guess, top3 = logits.argmax(-1), logits.topk(3, dim=-1).indices
    want = seq[0, 2:]  # (T-2,)
    rows = torch.arange(L - 1, T - 2)  # continuation roots with a next token to check
    assert a.hits[:, 0][: len(rows)].tolist() == (guess[rows] == want[rows]).tolist()
    assert a.in_topk[:, 0][: len(rows)].tolist() == (top3[rows] == want[rows, None]).any(-1).tolist()
    assert not a.known[-1, 0] and a.known[: len(rows), 0].all()
    probs = target.logits(f.final_hidden[0]).float().softmax(-1)  # (T, V)
    top1 = probs.argmax(-1)
    assert a.context_hits.tolist() == (guess == top1[1:]).tolist()
    assert torch.allclose(a.target_top1_prob, probs.max(-1).values, rtol=1e-5, atol=0)  # the target's confidence
    assert 0 < int(a.hits[:, 0].sum()) < len(rows)  # neither vacuous nor trivial


def test_loop_steps_equal_teacher_forced_leading_agreement(setup):
    target, head = setup
    dec = SpecDecoder(target, head, k=K, stop_ids=[])
    total, deep = 0, 0
    for prompt in PROMPTS:
        trace = loop_trace(dec, prompt, NEW)
        feats, top1, _ = training_features(target, head.feature_layers, prompt + trace.continuation)
        a = teacher_forced(head, prompt, trace.continuation, feats, top1, K, context=False)
        assert trace.feature_error(feats, len(prompt)) < 1e-5  # the loop's verify features are the training ones
        rows = [r - len(prompt) + 1 for r in trace.roots(len(prompt))]
        assert trace.accepted == [a.leading(i, K) for i in rows]
        stats, accepted = replay(a, K, NEW, [])
        assert accepted == trace.accepted
        for name in ("reached", "accepted_at", "accepted_hist", "emitted", "row_steps", "new_tokens"):
            assert getattr(stats, name) == getattr(trace.stats, name), name
        total += len(rows)
        deep += trace.stats.accepted_at[1]
    assert deep >= 5 and total >= 20  # depth 2+ was accepted: the own-draft feeding was exercised


def test_tally_counts_a_hand_built_agreement():
    """Conditional alpha, its true-feature control, position buckets, the max_length split, oov."""
    from draftkit.inference.agreement import Agreement, Tally

    L, k = 300, 2
    seq = list(range(L)) + [7, 8, 9, 7, 8]  # continuation: roots 299..303, depth d predicts seq[r + 1 + d]
    hits = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0], [0, 0]], dtype=torch.bool)
    known = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    ctx = torch.zeros(len(seq) - 1, dtype=torch.bool)
    ctx[:100] = True  # roots 0..99 (drafted tokens at positions 2..101) agree with the target's top-1
    a = Agreement(L, seq, hits, hits & known, known, ctx, torch.tensor(seq[1:] + [0]))
    t = Tally(k, max_length=256)
    t.add(a, vocab={7, 8})
    d = t.to_dict()
    assert d["tf_top1"] == [2 / 4, 2 / 3] and d["tf_reached"] == [4, 2]
    # depth 2 is reached from rows 0 and 2 (depth 1 hit, depth 2 known) and hit from row 0; the same
    # tokens drafted at depth 1 from rows 1 and 3 (true features) are both missed
    assert d["tf_alpha"] == [2 / 4, 1 / 2] and d["tf_alpha_true_features"] == [2 / 4, 0.0]
    assert d["by_position"] == {"256-512": {"n": 4, "top1": 2 / 4}}
    assert d["context_by_position"]["0-256"] == {"n": 254, "top1": 100 / 254}
    assert d["context_split"]["n_before"] == 254 and d["context_split"]["top1_from"] == 0.0
    assert d["outside_draft_vocab"] == 1 / 5 and d["target_top1_differs_from_continuation"] == 0.0
    assert d["by_target_confidence"] == {}  # no probabilities given


def test_tally_splits_depth1_by_the_targets_confidence_in_the_drafted_token():
    """Row i drafts x_{L+1+i}, whose probability the target gives after position L+i: the bins count
    each known depth-1 draft once, at that probability (not the one of the pending token before it)."""
    from draftkit.inference.agreement import Agreement, Tally

    L = 3
    seq = [1, 2, 3, 4, 5, 6, 7, 8]  # rows 0..4: roots 2..6 draft x_4..x_8 (row 4: nothing left to check)
    hits = torch.tensor([[1], [0], [1], [1], [0]], dtype=torch.bool)
    known = torch.tensor([[1], [1], [1], [1], [0]], dtype=torch.bool)
    prob = torch.tensor([0.1, 0.1, 0.1, 0.95, 0.2, 0.6, 0.4, 0.99])  # after positions 0..7
    a = Agreement(L, seq, hits, hits, known, None, torch.tensor(seq[1:] + [0]), prob)
    t = Tally(1, max_length=512)
    t.add(a, vocab=None)
    d = t.to_dict()  # drafted x_4..x_7 at probabilities prob[3..6] = .95 .2 .6 .4
    assert d["by_target_confidence"] == {"0.0-0.3": {"n": 1, "top1": 0.0}, "0.3-0.5": {"n": 1, "top1": 1.0},
                                         "0.5-0.7": {"n": 1, "top1": 1.0}, "0.9-1.0": {"n": 1, "top1": 1.0}}
    assert d["mean_target_confidence"] == pytest.approx((0.95 + 0.2 + 0.6 + 0.4) / 4)


def test_tally_splits_depth1_by_whether_the_context_holds_the_bigram():
    """x_t counts as seen when (x_{t-1}, x_t) occurs in x_0..x_{t-1}: in the prompt, or earlier in the
    continuation; a bigram of the continuation is seen only after it was written."""
    from draftkit.inference.agreement import Agreement, Tally

    L = 3
    seq = [4, 5, 6, 4, 5, 9, 4, 5, 9]  # rows 0..5 draft x_4..x_9
    hits = torch.tensor([[1], [0], [1], [0], [1], [0]], dtype=torch.bool)
    known = torch.tensor([[1], [1], [1], [1], [1], [0]], dtype=torch.bool)
    a = Agreement(L, seq, hits, hits, known, None, torch.tensor(seq[1:] + [0]))
    t = Tally(1, max_length=512)
    t.add(a, vocab=None)
    # x_4 (4,5) seen: hit; x_5 (5,9) new: miss; x_6 (9,4) new: hit; x_7 (4,5) seen: miss; x_8 (5,9) seen: hit
    assert t.to_dict()["by_copy"] == {"seen bigram": {"n": 3, "top1": 2 / 3}, "new bigram": {"n": 2, "top1": 1 / 2}}


def test_confidence_split_decomposes_the_gap():
    """gap = (reference - expected) + (expected - group), expected = the reference's rate per bin on
    the group's mix; the verdict is confirmed exactly when the first part reaches EFFECT."""
    from benchmarks import acceptance_gap as gap

    held = {"by_target_confidence": {"0.0-0.3": {"n": 20, "top1": 0.2}, "0.9-1.0": {"n": 80, "top1": 0.8}},
            "mean_target_confidence": 0.8}
    spec = {"by_target_confidence": {"0.0-0.3": {"n": 60, "top1": 0.1}, "0.9-1.0": {"n": 40, "top1": 0.7}},
            "mean_target_confidence": 0.5}
    s = gap.confidence_split(spec, held)
    assert s["reference depth-1 top-1"] == pytest.approx(0.68) and s["depth-1 top-1"] == pytest.approx(0.34)
    assert s["expected"] == pytest.approx(0.6 * 0.2 + 0.4 * 0.8)  # 0.44
    assert s["from the target's confidence"] == pytest.approx(0.24)
    assert s["at equal confidence"] == pytest.approx(0.10)
    res = {"headline": "bf16", "configs": {"bf16": {"loop": {gap.SPEC: spec, gap.HELD: held, "qa": spec}}}}
    assert gap.verdict_uncertainty(res)["verdict"] == "confirmed"
    same_mix = {**spec, "by_target_confidence": {"0.0-0.3": {"n": 20, "top1": 0.1}, "0.9-1.0": {"n": 80, "top1": 0.5}}}
    res["configs"]["bf16"]["loop"][gap.SPEC] = same_mix  # the same mix of confidence: the head's shortfall alone
    v = gap.verdict_uncertainty(res)
    assert v["verdict"] == "ruled out" and v["figures"][gap.SPEC]["at equal confidence"] == pytest.approx(0.26)


def _group(tf1=0.5, loop_a1=0.5, replay_a1=0.5, oov=0.02, before=0.5, after=0.5, own=0.4, true=0.4):
    """The figures of one group as the benchmark's verdicts read them."""
    return {"tf_top1": [tf1], "loop_alpha": [loop_a1], "replay_alpha": [replay_a1], "steps_differing": 0.0,
            "loop_feature_rel_error": 0.0, "outside_draft_vocab": oov, "tf_alpha": [tf1, own, own],
            "tf_alpha_true_features": [tf1, true, true], "by_position": {"0-256": {"n": 10, "top1": tf1}},
            "context_split": {"max_length": 512, "n_before": 10, "top1_before": before, "n_from": 10,
                              "top1_from": after}}


def test_verdicts_follow_the_figures():
    """Each hypothesis is confirmed exactly when its own figure crosses the threshold."""
    from benchmarks import acceptance_gap as gap

    def verdicts(spec=None, held=None, cat=None, train_tf1=0.5):
        groups = {"qa": cat or _group(), gap.SPEC: spec or _group(), gap.HELD: held or _group()}
        res = {"headline": "bfloat16", "configs": {"bfloat16": {
            "loop": groups, "train": {gap.SPEC: {"tf_top1": [train_tf1]}}, "autocast": "bfloat16"}}}
        return {name: v["verdict"] for name, v in (
            ("mismatch", gap.verdict_mismatch(res)), ("long", gap.verdict_long_context(res)),
            ("compounding", gap.verdict_compounding(res)), ("shift", gap.verdict_shift(res)))}

    out = "ruled out"
    assert verdicts() == {"mismatch": out, "long": out, "compounding": out, "shift": out}
    assert verdicts(spec=_group(loop_a1=0.3, replay_a1=0.5))["mismatch"] == "confirmed"
    assert verdicts(train_tf1=0.6)["mismatch"] == "confirmed"
    assert verdicts(spec=_group(oov=0.2))["mismatch"] == "confirmed"
    assert verdicts(spec=_group(before=0.5, after=0.3)) == {"mismatch": out, "long": "confirmed",
                                                             "compounding": out, "shift": out}
    assert verdicts(spec=_group(own=0.3, true=0.6))["compounding"] == "confirmed"
    assert verdicts(cat=_group(tf1=0.2))["shift"] == "confirmed"


def test_benchmark_runs_end_to_end(tmp_path):
    """benchmarks/acceptance_gap.py on a tiny chat target: the loop it reports is the one its
    teacher-forced replay reproduces (fp32), every verdict is computed; the held-aside prompts come from
    the data the run names (prepared.json), which no recipe key finds here."""
    import json

    from benchmarks.acceptance_gap import main
    from draftkit.distill.shards import shard_name, write_manifest, write_shard
    from tests.test_evaluate import FIXTURES, chat_target

    target = chat_target()
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    run = tmp_path / "run"
    head = build_head({"type": "eagle", "draft_vocab_size": 64}, target)
    head.save_pretrained(run / "head", extra={"training_dtype": "float32"})  # as the trainer writes it
    recipe = {"target": {"path": str(tmp_path / "target"), "dtype": "auto"}, "head": {"type": "eagle"},
              "data": {"max_length": 16}}
    (run / "recipe.json").write_text(json.dumps(recipe))
    prep = tmp_path / "prepared"
    prep.mkdir()
    row = {"id": "h0", "category": None, "messages": [{"role": "user", "content": "Say hello."}], "target_text": [],
           "response": "", "truncated": False, "num_tokens": 0, "input_ids": [5, 6], "loss_mask": [0, 1]}
    entry = write_shard(prep / shard_name("holdout", 0, 1), [row])
    write_manifest(prep, {"fingerprint": "x", "splits": {"train": [], "holdout": [entry]}, "stats": {}})
    (run / "prepared.json").write_text(json.dumps({"directory": str(prep)}))  # as the trainer names its data
    out = tmp_path / "gap.json"
    assert main(["--run", str(run), "--prompts", str(FIXTURES / "data" / "mtbench.jsonl"),
                 "--max-new-tokens", "6", "--dtypes", "float32", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    loop = res["configs"]["float32"]["loop"]
    assert set(loop) == {"writing", "math", "spec-bench", "held-aside"} and loop["held-aside"]["prompts"] == 1
    spec = loop["spec-bench"]
    assert spec["steps_differing"] == 0 and spec["replay_alpha"] == spec["loop_alpha"]
    assert res["configs"]["float32"]["train"]["spec-bench"]["prompts"] == 2  # the head as trained: fp32 here
    assert {v["verdict"] for v in res["verdict"].values()} <= {"confirmed", "ruled out", "not measured"}
    assert res["verdict"]["target_uncertainty"]["verdict"] != "not measured"  # probabilities reach the tallies
    assert sum(v["n"] for v in spec["by_target_confidence"].values()) == 2 * 5  # 6 tokens each: 5 drafted at depth 1
