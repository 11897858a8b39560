"""`draftkit eval --draft auto` (our loop, no engine) records SGLang's tree from its own calibration.

SGLang has no CPU path here, so its flags come from draftkit's loop: the calibration that chose the
loop's shape ranks every tree by predicted speedup, and the best one SGLang can serve as drafted (an
EAGLE-2 tree of topk k, d steps, at most k + (d - 1) k^2 draft tokens; topk 1 exactly d: its
server_args rule, restated here, not imported) is the `engine_draft.sglang` eval writes beside the
loop's draft.json, into the head with --save-draft, and what `draftkit inspect` prints of an export,
labelled not engine-measured. The calibration's ranking is read back from the run itself (a spy on
auto_draft), since costs are timed and differ between runs.
"""
from __future__ import annotations

import json

import pytest
import torch

from draftkit.cli import main as cli
from draftkit.heads import build_head
from tests.conftest import fit_on_greedy_continuations
from tests.test_evaluate import FIXTURES, chat_target

pytestmark = pytest.mark.usefixtures("one_thread")
PAYS = 1.05  # inference/cost.py's margin over plain decoding


def sglang_serves(topk: int, depth: int, budget: int) -> bool:
    """SGLang's EAGLE-2 tree (module doc), written out independently of export/serving.py."""
    return topk >= 1 and budget <= topk + (depth - 1) * topk * topk and (topk > 1 or budget == depth)


@pytest.fixture(scope="module")
def saved_fitted(tmp_path_factory):
    """A chat target directory and an EAGLE head fitted on its greedy continuations (its trees accept)."""
    root = tmp_path_factory.mktemp("auto")
    target = chat_target()
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    torch.manual_seed(0)
    head = build_head({"type": "eagle"}, target)
    fit_on_greedy_continuations(target, head, steps=100)
    head.save_pretrained(root / "head")
    return root


@pytest.mark.parametrize("margin", [PAYS, 0.0])
def test_loop_draft_auto_records_the_sglang_tree_it_measured(margin, saved_fitted, tmp_path, monkeypatch, capsys):
    """margin: eval's own (on this tiny target no tree pays: plain), and 0, so that the best tree is
    chosen whatever the machine timed (the tree's flags are then what inspect prints)."""
    import shutil

    from draftkit.export import export_head
    from draftkit.export.cli_inspect import inspect_dir
    from draftkit.inference import calibrate as cal_mod, cli_eval

    monkeypatch.setattr(cli_eval, "PAYS", margin)
    seen = []
    real = cal_mod.auto_draft
    monkeypatch.setattr(cal_mod, "auto_draft", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    head_dir = tmp_path / "head"
    shutil.copytree(saved_fitted / "head", head_dir)
    out = tmp_path / "eval"
    assert cli(["eval", "--head", str(head_dir), "--target", str(saved_fitted / "target"), "--prompts",
                str(FIXTURES / "data" / "mtbench.jsonl"), "--max-new-tokens", "8", "--calibration-prompts", "2",
                "--calibration-budget", "20", "--compare", "plain", "--dtype", "float32", "--out", str(out),
                "--save-draft"]) == 0
    err = capsys.readouterr().err
    (_, cal), = seen  # one calibration ran
    rec = json.loads((out / "draft.json").read_text())["engine_draft"]["sglang"]

    # the first row of the loop's own ranking that SGLang serves as drafted: no lookup branch, its tree rule
    best = next(r for r in cal.rows if not r["candidate"].lookup_len
                and sglang_serves(r["candidate"].topk, r["candidate"].depth, r["candidate"].budget))
    c = best["candidate"]
    assert not rec["engine_measured"] and rec["engine"] == "sglang" and rec["margin"] == margin
    assert rec["predicted_speedup"] == round(best["speedup"], 4)
    assert rec["temperatures"] == [0.0] and rec["dtype"] == "float32" and rec["batch_size"] == 1
    if best["speedup"] > margin:
        assert (rec["choice"], rec["algorithm"], rec["speculative_num_steps"], rec["speculative_eagle_topk"],
                rec["speculative_num_draft_tokens"]) == ("tree", "EAGLE", c.depth, c.topk, c.budget + 1), (rec, best)
        assert rec["by_temperature"] == best["by_temperature"]
        want = (f"SGLang: --speculative-algorithm EAGLE --speculative-num-steps {c.depth} "
                f"--speculative-eagle-topk {c.topk} --speculative-num-draft-tokens {c.budget + 1}")
    else:
        assert (rec["choice"], rec["best_tree"]) == ("plain", best["label"]), (rec, best)
        want = f"SGLang: plain decoding predicted fastest: no SGLang-valid tree beat plain by {margin}x"
    assert "measured in draftkit's loop, not engine-measured" in err
    # the same record in the report, in the head (--save-draft) and, through export, in inspect's lines
    assert json.loads((out / "report.json").read_text())["engine_draft"]["sglang"] == rec
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["engine_draft"] == {"sglang": rec} and cfg["draft"]["mode"] == json.loads(
        (out / "draft.json").read_text())["draft"]["mode"]
    lines = inspect_dir(export_head(head_dir, "sglang", tmp_path / "export"))["lines"]
    i = next(i for i, ln in enumerate(lines) if ln.startswith("SGLang:"))
    assert lines[i].startswith(want), lines
    assert "not engine-measured (SGLang has no CPU path here)" in " ".join(lines[i:i + 2]), lines


def test_a_fixed_search_records_no_sglang_tree(saved_fitted, tmp_path, monkeypatch):
    """--tree-topk fixes the search to some trees: its ranking is not SGLang's best, so none is recorded."""
    out = tmp_path / "eval"
    assert cli(["eval", "--head", str(saved_fitted / "head"), "--target", str(saved_fitted / "target"), "--prompts",
                str(FIXTURES / "data" / "mtbench.jsonl"), "--max-new-tokens", "6", "--calibration-prompts", "1",
                "--calibration-budget", "10", "--draft", "calibrate", "--tree-topk", "2", "--compare", "none",
                "--dtype", "float32", "--out", str(out)]) == 0
    assert "engine_draft" not in json.loads((out / "draft.json").read_text())


def test_sglang_record_takes_the_first_tree_sglang_serves_as_drafted():
    """A ranking whose faster rows SGLang cannot serve as drafted (a lookup branch, topk 1 that is not
    a chain, more draft tokens than an EAGLE tree of that topk and depth has): the first that it can."""
    from draftkit.export.serving import sglang_record
    from draftkit.inference.cost import Candidate

    ranked = [(Candidate(0, 0, 0, 4), 1.9), (Candidate(8, 1, 8, 8), 1.6), (Candidate(1, 3, 2), 1.5),
              (Candidate(2, 3, 12), 1.4), (Candidate(4, 2, 6), 1.3), (Candidate(2, 2, 4), 1.2)]
    rows = [{"candidate": c, "label": c.label(), "speedup": sp, "by_temperature": {"0": {"speedup": sp}}}
            for c, sp in ranked]
    assert [sglang_serves(c.topk, c.depth, c.budget) and not c.lookup_len for c, _ in ranked] == [False] * 4 + [True] * 2
    rec = sglang_record(rows, "eagle3", PAYS, {"dtype": "float32"})
    assert (rec["choice"], rec["algorithm"], rec["speculative_num_steps"], rec["speculative_eagle_topk"],
            rec["speculative_num_draft_tokens"], rec["predicted_speedup"]) == ("tree", "EAGLE3", 2, 4, 7, 1.3)
    assert rec["dtype"] == "float32" and not rec["engine_measured"]
    plain = sglang_record(rows, "eagle", 1.35, {})
    assert (plain["choice"], plain["best_tree"], plain["predicted_speedup"]) == ("plain", "tree 4x2 b6", 1.3)
    assert sglang_record(rows, "medusa", PAYS, {}) is None  # SGLang has no Medusa drafter


@pytest.mark.parametrize("temperatures, fix", [((0.0,), False), ((0.0, 1.0), True)])
def test_the_engine_sweep_at_t_gt_0_serves_with_vllm_cpus_sampler_corrected(temperatures, fix, tmp_path):
    """vLLM CPU 0.32.0 applies an uninitialised temperature at T > 0 (vllm_worker.fix_cpu_rejection_sampler):
    a sweep that times chains at T > 0 must ask the worker for the correction, as engine_eval does."""
    from draftkit.engines.vllm_auto import SweepSettings, sweep_request

    req = sweep_request("m", [[1, 2]], tmp_path, "eagle", [1, 3], SweepSettings(temperatures=temperatures), [2])
    assert req.to_json()["cpu_sampler_fix"] is fix


def test_a_reused_draft_shape_brings_its_sglang_record_into_the_report_and_the_head(saved_fitted, tmp_path,
                                                                                    monkeypatch, capsys):
    """--draft-from an earlier eval whose draft.json kept engine_draft.sglang beside the loop's shape:
    nothing is measured, and that record goes into report.json (engine_draft_source naming the file)
    and, with --save-draft, into the head; a later auto run reusing the head's draft: brings it from there."""
    import shutil

    from draftkit.export.serving import sglang_record
    from draftkit.inference import calibrate as cal_mod
    from draftkit.inference.cli_eval import DRAFT_FILE, draft_record
    from draftkit.inference.cost import Candidate
    from draftkit.inference.drafters import DraftSettings
    from draftkit.target import load_target

    monkeypatch.setattr(cal_mod, "auto_draft", lambda *a, **kw: pytest.fail("a reused shape measured again"))
    head_dir, earlier = tmp_path / "head", tmp_path / "earlier"
    shutil.copytree(saved_fitted / "head", head_dir)
    earlier.mkdir()
    target = load_target(str(saved_fitted / "target"), dtype="float32")
    rows = [{"candidate": Candidate(4, 2, 6), "label": "tree 4x2 b6", "speedup": 1.3,
             "by_temperature": {"0": {"speedup": 1.3}}}]
    rec = sglang_record(rows, "eagle", PAYS, {"dtype": "float32", "prompts": 2})  # what the earlier eval measured
    shape = DraftSettings(mode="chain", k=2, chosen_by="measured: earlier")
    (earlier / DRAFT_FILE).write_text(json.dumps(draft_record(shape, head_dir, target, rec)))

    def run(out, *flags):
        assert cli(["eval", "--head", str(head_dir), "--target", str(saved_fitted / "target"), "--prompts",
                    str(FIXTURES / "data" / "mtbench.jsonl"), "--limit", "1", "--max-new-tokens", "4", "--compare",
                    "none", "--dtype", "float32", "--out", str(out), *flags]) == 0
        return json.loads((out / "report.json").read_text()), capsys.readouterr().err

    report, err = run(tmp_path / "reuse", "--draft-from", str(earlier), "--save-draft")
    assert report["engine_draft"] == {"sglang": rec} and report["draft_source"] == str(earlier / DRAFT_FILE)
    assert report["engine_draft_source"] == {"sglang": str(earlier / DRAFT_FILE)}
    assert f"engine draft: SGLang's record from {earlier / DRAFT_FILE}" in err, err
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["engine_draft"] == {"sglang": rec} and (cfg["draft"]["mode"], cfg["draft"]["k"]) == ("chain", 2)
    report, _ = run(tmp_path / "again")  # auto: the head's draft: (written above), and its SGLang record
    assert report["engine_draft"] == {"sglang": rec}
    assert report["engine_draft_source"] == {"sglang": str(head_dir / "config.json")}
