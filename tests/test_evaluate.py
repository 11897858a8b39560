"""`draftkit eval` and `evaluate()`: reports, prompt files, bad input, partial reports.

Tiny random llamas with the fixture ChatML tokenizer; the one test on the embedded SmolLM2 target
is marked `integration`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftkit.cli import main as cli
from draftkit.heads import build_head
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.errors import SpecError
from draftkit.inference.evaluate import EvalSettings, evaluate, read_prompt_file
from draftkit.inference.report import format_table, write_report
from tests.conftest import LOOP_PROMPTS, fit_on_greedy_continuations

FIXTURES = Path(__file__).parent / "fixtures"
KEYS = ("tau", "acceptance_per_position", "tokens_per_s", "baseline_tokens_per_s", "speedup",
        "greedy_mismatches", "num_prompts", "k", "temperature", "per_category")


pytestmark = pytest.mark.usefixtures("one_thread")


def chain(k: int | None = None, compare=("plain", "lookup"), **fields) -> EvalSettings:
    """EvalSettings of a chain of k (lookup's chain as long) beside `compare`; k None: the default hybrid."""
    draft = DraftSettings(mode="chain", k=k, lookup_len=k) if k is not None else DraftSettings()
    return EvalSettings(draft=draft, compare=tuple(compare), **fields)


def chat_target(seed=0):
    """A tiny llama sized to the fixture tokenizer (so text prompts and chat templates work)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draftkit.target import Target

    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.2)
    return Target(LlamaForCausalLM(cfg), tok, name=f"chat-llama-{seed}")


@pytest.fixture(scope="module")
def target():
    return chat_target()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target):
    """A target directory and a head directory trained (well, built) against it."""
    root = tmp_path_factory.mktemp("eval")
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    build_head({"type": "eagle"}, target).save_pretrained(root / "run" / "head")
    return root


@pytest.fixture(scope="module")
def fitted(target):
    """An EAGLE head trained on the target's greedy continuations of LOOP_PROMPTS (conftest): its
    drafts are accepted there (tau well above 1), so equality checks run where the loop commits
    accepted drafts and rolls back the rest."""
    torch.manual_seed(0)
    head = build_head({"type": "eagle"}, target)
    fit_on_greedy_continuations(target, head, steps=200)
    return head.eval()


def test_evaluate_report(target, tmp_path):
    prompts = read_prompt_file(FIXTURES / "data" / "mtbench.jsonl") + read_prompt_file(FIXTURES / "data" / "prompt.jsonl")
    head = build_head({"type": "eagle"}, target)
    rep = evaluate(target, head, prompts, chain(3, temperatures=(0.0, 0.7), max_new_tokens=12, batch_size=2))
    assert all(key in rep for key in KEYS)
    assert rep["status"] == "complete" and rep["num_prompts"] == 4 and rep["k"] == 3 and rep["temperature"] == 0.0
    assert rep["greedy_mismatches"] == 0 and rep["ngram_greedy_mismatches"] == 0
    hist = rep["accepted_length_histogram"]
    assert len(rep["acceptance_per_position"]) == 3 and len(hist) == 4
    # tau is the mean of the accepted-length histogram (+1 for the bonus), counted per row-step
    assert rep["tau"] == pytest.approx(sum((i + 1) * h for i, h in enumerate(hist)) / sum(hist))
    assert sum(hist) == rep["row_steps"] and rep["row_steps"] >= rep["steps"]  # batch 2: rows share steps
    assert set(rep["per_category"]) == {"writing", "math", "all"}
    assert rep["per_category"]["math"]["num_prompts"] == 1
    assert [r["temperature"] for r in rep["runs"]] == [0.0, 0.7] and rep["runs"][1]["greedy_mismatches"] is None
    # speedup is the ratio of the two tokens/s this report states, the main method's and lookup's alike
    assert rep["speedup"] == rep["tokens_per_s"] / rep["baseline_tokens_per_s"]
    lookup = rep["methods"]["lookup"]
    assert lookup["speedup"] == lookup["tokens_per_s"] / rep["baseline_tokens_per_s"] and rep["ngram"] == lookup
    paths = write_report(rep, tmp_path)
    names = {p.name for p in paths}
    assert {"report.json", "report.md"} <= names
    # matplotlib is a dev dependency: the plot must be there
    assert "acceptance.png" in names and (tmp_path / "acceptance.png").stat().st_size > 1000
    assert json.loads((tmp_path / "report.json").read_text())["tau"] == rep["tau"]
    assert "tau" in format_table(rep) and "| T |" in (tmp_path / "report.md").read_text()


def test_greedy_check_where_drafts_are_accepted(target, fitted, monkeypatch, tmp_path):
    """T = 0 with a fitted head: every method equals plain decoding while its drafts are accepted
    (tau > 1.5), and a wrong token in any method's output is reported as that method's mismatch
    at the position it was planted, outside the near-tie gap: a failure, said in report.md."""
    from draftkit.inference.decoder import SpecDecoder

    s = EvalSettings(draft=DraftSettings(mode="hybrid", topk=2, depth=3, budget=6, lookup_len=4), max_new_tokens=12)
    rep = evaluate(target, fitted, LOOP_PROMPTS, s)
    assert rep["status"] == "complete" and rep["main"] == "hybrid"
    for name in ("lookup", "head", "hybrid"):
        m = rep["methods"][name]
        assert m["greedy_mismatches"] == 0, name
        assert m["speedup"] == m["tokens_per_s"] / rep["baseline_tokens_per_s"], name
    assert rep["methods"]["head"]["tau"] > 1.5 and rep["methods"]["hybrid"]["tau"] > 1.5, rep["methods"]
    assert rep["greedy_failures"] == [] and rep["greedy_tie_gap"] == 1e-3  # fp32: nothing to excuse
    real = SpecDecoder.generate

    def one_wrong_token(self, *args, **kwargs):  # the 6th new token of every row is off by one (not the warm-up's 4)
        outs, stats = real(self, *args, **kwargs)
        return [o[:5] + [(o[5] + 1) % target.vocab_size] + o[6:] if len(o) > 5 else o for o in outs], stats
    monkeypatch.setattr(SpecDecoder, "generate", one_wrong_token)
    rep = evaluate(target, fitted, LOOP_PROMPTS, s)
    for name, prefix in (("hybrid", "greedy"), ("lookup", "ngram_greedy"), ("head", "head_greedy")):
        assert rep["methods"][name]["greedy_mismatches"] == len(LOOP_PROMPTS), name
        assert [d["index"] for d in rep[f"{prefix}_divergences"]] == [5] * len(LOOP_PROMPTS), name
        # a swap outside the near-tie gap is a failure, one line each, and report.md says it is a bug
        fails = rep[f"{prefix}_failures"]
        assert len(fails) == len(LOOP_PROMPTS) and all(" token 5: " in f and "nats below the top" in f for f in fails)
    assert rep["greedy_max_gap"] == max(d["gap"] for d in rep["greedy_divergences"]) > rep["greedy_tie_gap"]
    write_report(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert f"0 near-ties (both tokens within 0.001 nats of the float32 top on the shared prefix; largest gap " \
           f"{rep['greedy_max_gap']:.4f}), {len(LOOP_PROMPTS)} outside: a bug, acceptance is lossless." in md
    assert rep["greedy_failures"][0] in md


def test_cli_exits_1_when_a_lossless_t0_run_differs_from_plain_decoding(saved, target, fitted, monkeypatch, capsys, tmp_path):
    """draftkit eval at T = 0 with lossless acceptance: a difference from plain decoding outside the
    near-tie gap is a bug, so eval says so in one error line and exits 1 (the report is still
    written); the same run without the planted token exits 0."""
    from draftkit.inference.decoder import SpecDecoder

    fitted.save_pretrained(tmp_path / "head")
    args = ["eval", "--head", str(tmp_path / "head"), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "mtbench.jsonl"), "--limit", "2", "--max-new-tokens", "8", "--k", "2",
            "--dtype", "float32", "--out", str(tmp_path / "out")]
    assert cli(args) == 0
    capsys.readouterr()
    real = SpecDecoder.generate

    def one_wrong_token(self, *a, **kw):  # the 6th new token of every row off by one
        outs, stats = real(self, *a, **kw)
        return [o[:5] + [(o[5] + 1) % target.vocab_size] + o[6:] if len(o) > 5 else o for o in outs], stats
    monkeypatch.setattr(SpecDecoder, "generate", one_wrong_token)
    assert cli(args) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("draftkit eval: error:")]
    assert len(err) == 1 and "outside the near-tie gap" in err[0] and "a bug under lossless acceptance" in err[0], err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["greedy_failures"]


def test_training_time_mode_is_cheap(target):
    head = build_head({"type": "eagle"}, target)
    rep = evaluate(target, head, ["Say hi.", [5, 6, 7, 8]], chain(2, (), max_new_tokens=6))
    assert rep["status"] == "complete" and rep["num_prompts"] == 2
    assert list(rep["methods"]) == ["head"] and len(rep["acceptance_per_position"]) == 2
    assert rep["speedup"] is None and rep["greedy_mismatches"] is None and "ngram" not in rep


def test_prompt_files():
    d = FIXTURES / "data"
    mt = read_prompt_file(d / "mtbench.jsonl")
    assert [p.category for p in mt] == ["writing", "math"]
    assert mt[0].messages == [{"role": "user", "content": "Compose a travel blog post about Hawaii."}]
    alp = read_prompt_file(d / "alpaca.json")
    assert alp[0].messages[0]["content"] == "Translate to English.\n\nGuten Morgen"
    assert len(read_prompt_file(d / "prompt.jsonl")) == 2  # the blank prompt is dropped
    sg = read_prompt_file(d / "sharegpt.json")
    assert sg[0].messages[-1] == {"role": "user", "content": "Have a nice day!"} and sg[0].id.endswith("sg0")
    oa = read_prompt_file(d / "openai.jsonl")
    assert oa[0].messages[-1]["content"] == "Write a short poem about the sea." and oa[0].messages[0]["role"] == "system"
    with pytest.raises(SpecError, match="no usable prompts.*question"):
        read_prompt_file(d / "unknown.jsonl")


def test_eval_imports_without_the_trainer_stack():
    """`draftkit eval` runs on the core dependencies: no datasets, deepspeed or wandb, even for the
    Magpie synthesis it borrows from draftkit.distill. A module set to None in sys.modules is one
    that is not installed: importing it raises ImportError, importlib.util.find_spec gives None."""
    code = ("import sys\n"
            "sys.modules.update(dict.fromkeys(['datasets', 'deepspeed', 'wandb']))\n"
            "import draftkit.inference, draftkit.inference.evaluate, draftkit.prompts, draftkit.distill.synthesize\n"
            "try:\n    import datasets\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('datasets not blocked')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_bad_input(target, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SpecError, match="empty"):
        read_prompt_file(empty)
    head = build_head({"type": "eagle"}, target)
    long_prompt = list(range(3, 250))
    rep = evaluate(target, head, [long_prompt, "Hello there."], chain(2, (), max_new_tokens=8))
    assert rep["num_prompts"] == 1 and "too long" in rep["skipped"][0]["reason"]
    with pytest.raises(SpecError, match="no prompt fits"):
        evaluate(target, head, [long_prompt], chain(2, max_new_tokens=8))
    with pytest.raises(SpecError, match="draft.k must be an integer >= 1"):
        evaluate(target, head, ["Hi"], chain(0))
    with pytest.raises(SpecError, match="settings must be an EvalSettings"):
        evaluate(target, head, ["Hi"], {"k": 2})  # the keyword form is gone; a dict is refused, named


def test_failure_midway_leaves_a_partial_report(target, tmp_path):
    head = build_head({"type": "eagle"}, target)
    calls = {"n": 0}
    real_draft = head.draft

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 12:
            raise RuntimeError("out of memory (simulated)")
        return real_draft(*args, **kwargs)

    head.draft = flaky
    prompts = [[5, 6, 7, 8 + i] for i in range(6)]
    rep = evaluate(target, head, prompts, chain(2, max_new_tokens=4, raise_errors=False))
    assert rep["status"] == "partial" and "simulated" in rep["error"]
    assert 0 < rep["runs"][0]["done_prompts"] < 6 and rep["steps"] > 0
    paths = write_report(rep, tmp_path)
    assert json.loads(paths[0].read_text())["status"] == "partial"
    with pytest.raises(RuntimeError):
        calls["n"] = 0
        evaluate(target, head, prompts, chain(2, max_new_tokens=4))


def test_cli(saved, tmp_path, capsys):
    args = ["eval", "--head", str(saved / "run"), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "mtbench.jsonl"), "--k", "2", "--dtype", "float32", "--max-new-tokens", "6", "--out", str(tmp_path / "a")]
    assert cli(args) == 0
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["status"] == "complete" and rep["greedy_mismatches"] == 0 and rep["num_prompts"] == 2
    assert "speedup" in capsys.readouterr().out
    # k larger than the head supports / k <= 0, an empty prompt file: clear errors, exit code 2
    assert cli(args[:-4] + ["--k", "0", "--out", str(tmp_path / "b")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    bad = list(args)
    bad[bad.index("--prompts") + 1] = str(empty)
    assert cli(bad) == 2
    assert "empty" in capsys.readouterr().err


def test_cli_refuses_a_head_of_another_target(saved, tmp_path, capsys):
    other = chat_target(seed=1)
    other.model.save_pretrained(tmp_path / "other")
    other.tokenizer.save_pretrained(tmp_path / "other")
    args = ["eval", "--head", str(saved / "run" / "head"), "--target", str(tmp_path / "other"), "--prompts",
            str(FIXTURES / "data" / "prompt.jsonl"), "--k", "2", "--dtype", "float32", "--max-new-tokens", "4", "--no-ngram",
            "--out", str(tmp_path / "o")]
    assert cli(args) == 2
    assert "fingerprint" in capsys.readouterr().err
    assert cli(args + ["--force"]) == 0


@pytest.mark.integration
def test_eval_on_the_embedded_target(tmp_path):
    """fp32 SmolLM2-135M: a random EAGLE head loses nothing; the n-gram drafter too."""
    from draftkit.target import load_target

    target = load_target(None, dtype="float32")
    build_head({"type": "eagle"}, target).save_pretrained(tmp_path / "head")
    out = tmp_path / "eval"
    rc = cli(["eval", "--head", str(tmp_path / "head"), "--prompts", str(FIXTURES / "data" / "prompt.jsonl"),
              "--k", "3", "--dtype", "float32", "--max-new-tokens", "16", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["greedy_mismatches"] == 0 and rep["ngram_greedy_mismatches"] == 0 and rep["num_prompts"] == 2
    assert (out / "report.md").is_file()


def test_ngram_only_without_a_head(target):
    rep = evaluate(target, None, ["Repeat: a b c a b c a b c", "Count to five."], chain(3, max_new_tokens=10))
    assert rep["drafter"] == "ngram" and rep["greedy_mismatches"] == 0 and list(rep["methods"]) == ["lookup"]
    assert rep["main"] == "lookup" and rep["num_prompts"] == 2
    with pytest.raises(SpecError, match="nothing to evaluate"):
        evaluate(target, None, ["Hi"], chain(None, ("plain",)))


def test_synthesized_prompts_are_user_turns(target, monkeypatch):
    """eval's Magpie path: what the target writes after the user-turn prefix, cut at its end of turn,
    becomes the prompts (a random tiny target never ends a turn, so its sampling is scripted here)."""
    from draftkit.inference.evaluate import synthesize_prompts

    tok = target.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = ["Tell me about cats.", "How do tides work?", "Tell me about cats.", "Name three rivers."]
    scripted = [tok.encode(t, add_special_tokens=False) + [end] for t in turns] + [[5, 6]] * 6  # then unfinished

    queue = iter(scripted)

    def generate(input_ids, max_new_tokens, **_):  # the next scripted turns, one per row
        rows = [next(queue) for _ in range(input_ids.shape[0])]
        width = max(map(len, rows))
        return torch.cat([input_ids, torch.tensor([r + [end] * (width - len(r)) for r in rows])], 1)
    monkeypatch.setattr(target.model, "generate", generate)
    prompts = synthesize_prompts(target, 3, seed=0, max_tokens=64)
    assert [p.messages for p in prompts] == [[{"role": "user", "content": t}] for t in
                                             ("Tell me about cats.", "How do tides work?", "Name three rivers.")]
    assert {p.category for p in prompts} == {"synthesized"}  # the duplicate turn was dropped


def test_typical_acceptance_is_reported_as_lossy(target, tmp_path, capsys):
    """--acceptance typical: the report names the rule and says LOSSY; the T = 0 check still runs."""
    head = build_head({"type": "medusa", "num_heads": 3}, target)
    prompts = ["Say hi.", [5, 6, 7, 8]]
    rep = evaluate(target, head, prompts, chain(3, ("plain",), temperatures=(0.0, 0.7), max_new_tokens=8,
                                                acceptance="typical", typical_epsilon=0.1, typical_delta=0.25))
    assert rep["status"] == "complete" and rep["acceptance"] == "typical (lossy, eps=0.1, delta=0.25)"
    assert rep["lossless"] is False and rep["greedy_mismatches"] is not None  # reported, whatever it is
    write_report(rep, tmp_path / "typ")
    md = (tmp_path / "typ" / "report.md").read_text()
    assert "typical (lossy, eps=0.1, delta=0.25)" in md and "LOSSY" in md and "not a bug" in md
    table = format_table(rep)
    assert "typical (lossy" in table and "LOSSY" in table
    assert json.loads((tmp_path / "typ" / "report.json").read_text())["acceptance"].startswith("typical (lossy")
    # the default: lossless rejection sampling, said so
    rep = evaluate(target, head, prompts, chain(3, (), max_new_tokens=8))
    assert rep["acceptance"] == "rejection (lossless)" and rep["lossless"] is True
    assert "rejection (lossless)" in format_table(rep) and "LOSSY" not in format_table(rep)
    with pytest.raises(SpecError, match="acceptance must be one of"):
        evaluate(target, head, prompts, chain(acceptance="lossy"))


def test_cli_acceptance(saved, tmp_path, capsys):
    args = ["eval", "--head", str(saved / "run"), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "prompt.jsonl"), "--k", "2", "--dtype", "float32", "--max-new-tokens", "4", "--no-ngram",
            "--acceptance", "typical", "--typical-epsilon", "0.05", "--out", str(tmp_path / "t")]
    assert cli(args) == 0
    rep = json.loads((tmp_path / "t" / "report.json").read_text())
    assert rep["acceptance"] == "typical (lossy, eps=0.05, delta=0.3)" and rep["lossless"] is False
    captured = capsys.readouterr()
    assert "typical (lossy" in captured.out and "not the target's distribution" in captured.err
    assert cli(args[:-2] + ["--typical-delta", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "typical_delta" in capsys.readouterr().err


def test_side_by_side_head_lookup_hybrid(target, fitted, tmp_path):
    """One interleaved run of plain, lookup, the head's tree and the hybrid: every method lossless
    at T = 0 with a fitted head whose drafts are accepted, per category too, accepted tokens
    attributed to their source, the plot drawn."""
    head = fitted
    prompts = read_prompt_file(FIXTURES / "data" / "mtbench.jsonl") + [[5, 6, 7, 5, 6, 7, 5, 6]] + LOOP_PROMPTS
    s = EvalSettings(draft=DraftSettings(mode="hybrid", topk=2, depth=3, budget=6, lookup_len=4),
                     temperatures=(0.0, 0.7), max_new_tokens=12)
    rep = evaluate(target, head, prompts, s)
    assert rep["main"] == "hybrid" and rep["methods_measured"] == ["hybrid", "plain", "lookup", "head"]
    for name in ("lookup", "head", "hybrid"):
        m = rep["methods"][name]
        assert m["greedy_mismatches"] == 0, name
        accepted = sum(i * h for i, h in enumerate(m["accepted_length_histogram"]))
        assert sum(m["accepted_by_source"].values()) == accepted, name  # every accepted token has a source
    assert set(rep["methods"]["lookup"]["accepted_by_source"]) <= {"lookup"}
    assert set(rep["methods"]["head"]["accepted_by_source"]) <= {"head"}
    assert set(rep["per_category"]["math"]["methods"]) == {"lookup", "head", "hybrid"}
    assert rep["per_category"]["all"]["methods"]["hybrid"]["tau"] > 1.5  # LOOP_PROMPTS: drafts accepted
    assert rep["methods"]["head"]["accepted_by_source"].get("head", 0) > 10  # the fitted head's, not lookup's
    assert rep["runs"][1]["methods"]["hybrid"]["tau"] == rep["runs"][1]["tau"]
    paths = write_report(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Side by side" in md and "hybrid *" in md and "tree topk=2 depth=3 budget=6" in md
    assert (tmp_path / "acceptance.png").stat().st_size > 1000 and len(paths) == 3


def block_writes_under(monkeypatch, root: Path) -> None:
    """Make `root` read-only for this process, as a hub snapshot is, even for root (who ignores
    chmod): every open for writing, os.open with a write flag, and rename onto a path under it
    raises PermissionError; chmod too, for everyone else (the caller makes it writable again)."""
    import builtins
    import io
    import os

    root = Path(root).resolve()

    def inside(p) -> bool:
        return isinstance(p, (str, os.PathLike)) and Path(os.fspath(p)).resolve().is_relative_to(root)

    def refuse(p):
        raise PermissionError(13, "Permission denied (read-only directory, simulated)", str(p))

    real_open, real_os_open, real_replace, real_rename = builtins.open, os.open, os.replace, os.rename

    def guarded_open(file, mode="r", *args, **kwargs):
        return refuse(file) if any(c in mode for c in "wax+") and inside(file) else real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        return refuse(path) if writing and inside(path) else real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: refuse(b) if inside(b) else real_replace(a, b, **kw))
    monkeypatch.setattr(os, "rename", lambda a, b, **kw: refuse(b) if inside(b) else real_rename(a, b, **kw))
    for p in [root, *root.iterdir()]:
        p.chmod(0o555 if p.is_dir() else 0o444)


def snapshot(directory: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(Path(directory).iterdir())}


@pytest.fixture
def head_without_draft(saved, tmp_path):
    """A copy of the saved head with no `draft:` section (nothing measured yet)."""
    import shutil

    head_dir = tmp_path / "head"
    shutil.copytree(saved / "run" / "head", head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg.pop("draft", None)
    (head_dir / "config.json").write_text(json.dumps(cfg))
    yield head_dir
    for p in [head_dir, *head_dir.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def test_cli_draft_auto_never_writes_into_the_head(saved, head_without_draft, tmp_path, capsys, monkeypatch):
    """--draft auto on a read-only head: measures, writes the choice to --out/draft.json, reuses it
    from there; --draft-from reuses another eval's; the head directory is never written, and
    --save-draft on it fails clearly (exit 2) until it is writable, then writes it atomically."""
    head_dir = head_without_draft
    before = snapshot(head_dir)
    with monkeypatch.context() as blocked:
        block_writes_under(blocked, head_dir)
        args = ["eval", "--head", str(head_dir), "--target", str(saved / "target"), "--prompts",
                str(FIXTURES / "data" / "mtbench.jsonl"), "--max-new-tokens", "6", "--calibration-prompts", "1",
                "--compare", "plain", "--dtype", "float32", "--out", str(tmp_path / "a")]
        assert cli(args) == 0
        err = capsys.readouterr().err
        assert "draft auto: " in err and "measured: " in err  # calibration ran and said what it chose
        record = json.loads((tmp_path / "a" / "draft.json").read_text())
        draft = record["draft"]
        assert draft["chosen_by"].startswith("measured") and draft["measured"]["costs"]["0"]["verify_ms"]
        assert record["head_dir"] == str(head_dir.resolve()) and record["dtype"] == "float32"
        assert "not the shape a serving engine should use" in record["about"]
        rep = json.loads((tmp_path / "a" / "report.json").read_text())
        assert rep["draft"] == draft and rep["draft_source"].startswith("measured now")
        if draft["mode"] != "plain":  # an untrained head may be measured not to pay: then plain decoding runs alone
            assert rep["greedy_mismatches"] == 0
        # the same --out: the choice is reused from its draft.json, nothing measured
        assert cli(args) == 0
        assert "draft auto: " not in capsys.readouterr().err  # nothing measured
        rep = json.loads((tmp_path / "a" / "report.json").read_text())
        assert rep["draft"] == draft and rep["draft_source"] == str(tmp_path / "a" / "draft.json")
        # another --out reuses it when told where (an eval directory, or its report.json)
        for source in (tmp_path / "a", tmp_path / "a" / "report.json"):
            assert cli(args[:-1] + [str(tmp_path / "c"), "--draft-from", str(source)]) == 0
            assert "draft auto: " not in capsys.readouterr().err  # nothing measured
            assert json.loads((tmp_path / "c" / "report.json").read_text())["draft"] == draft
        assert cli(args[:-1] + [str(tmp_path / "d"), "--draft-from", str(tmp_path / "nowhere")]) == 2
        assert "--draft-from" in capsys.readouterr().err
        assert cli(args[:-1] + [str(tmp_path / "e"), "--draft-from", str(tmp_path / "a"), "--save-draft"]) == 2
        err = capsys.readouterr().err
        assert "--save-draft: cannot write" in err and str(head_dir / "config.json") in err
        assert snapshot(head_dir) == before  # not one byte, not one new file
    for p in [head_dir, *head_dir.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    assert cli(args[:-1] + [str(tmp_path / "f"), "--draft-from", str(tmp_path / "a"), "--save-draft"]) == 0
    assert json.loads((head_dir / "config.json").read_text())["draft"] == draft
    assert not [p for p in head_dir.iterdir() if p.name.startswith(".")]  # the temporary file is gone
    assert cli(args[:-1] + [str(tmp_path / "g")]) == 0  # a fresh --out: the head's saved choice
    assert "draft auto: " not in capsys.readouterr().err  # nothing measured
    assert json.loads((tmp_path / "g" / "report.json").read_text())["draft_source"] == str(head_dir / "config.json")


def parse(*flags: str):
    import argparse

    from draftkit.inference.cli_eval import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(flags))


def test_size_flags_are_kept_exactly_and_imply_the_mode():
    """Any size flag given decides the mode (--k chain, --tree-* tree, --lookup-len/--head-off-at
    hybrid) and keeps its value; nothing is measured then; an explicit value equal to the default
    counts as given."""
    from draftkit.inference.cli_eval import draft_from_flags, search_space
    from draftkit.inference.drafters import DraftSettingsError

    saved = DraftSettings(mode="hybrid", topk=8, depth=1, budget=8, lookup_len=10, lookup_ngram=2,
                          chosen_by="measured: ...", measured={"verify_ms": {"1": 1.0}})
    for base in (None, saved):
        d, measure = draft_from_flags(parse("--tree-topk", "2", "--tree-depth", "3"), base)
        assert (d.mode, d.topk, d.depth, d.chosen_by, measure) == ("tree", 2, 3, "user", False)
        assert d.budget == (base or DraftSettings()).budget and d.measured == {}
    cases = {("--k", "3"): ("chain", {"k": 3}),
             ("--k", "3", "--lookup-len", "5"): ("chain", {"k": 3, "lookup_len": 5}),
             ("--lookup-len", "5"): ("hybrid", {"lookup_len": 5}),
             ("--head-off-at", "4", "--tree-budget", "6"): ("hybrid", {"head_off_at": 4, "budget": 6}),
             ("--draft", "lookup", "--lookup-len", "6"): ("lookup", {"lookup_len": 6}),
             ("--draft", "tree", "--ngram-n", "3"): ("tree", {"lookup_ngram": 3})}
    for flags, (mode, values) in cases.items():
        d, measure = draft_from_flags(parse(*flags), saved)
        assert d.mode == mode and not measure, flags
        assert {k: getattr(d, k) for k in values} == values, flags
    # --ngram-n alone implies no mode: the saved choice stays, with the user's n (3 = the default, still kept)
    d, measure = draft_from_flags(parse("--ngram-n", "3"), saved)
    assert (d.mode, d.topk, d.lookup_ngram, measure) == ("hybrid", 8, 3, False)
    d, measure = draft_from_flags(parse("--ngram-n", "3"), None)
    assert measure and d.lookup_ngram == 3  # calibration starts from the user's n
    with pytest.raises(DraftSettingsError, match="--k is a chain's length but depth"):
        draft_from_flags(parse("--k", "3", "--tree-depth", "2"), None)
    # --draft calibrate measures, searching only what the flags left unset (tests/test_cost.py runs it);
    # --k fixes a whole chain: nothing left to measure
    args = parse("--draft", "calibrate", "--tree-topk", "2", "--ngram-n", "3")
    d, measure = draft_from_flags(args, None)
    assert measure and (d.topk, d.lookup_ngram) == (2, 3)
    space = search_space(args)
    assert (space.fixed, space.mode) == ({"topk": 2}, "tree")
    assert (search_space(parse("--draft", "calibrate")).fixed, search_space(parse("--draft", "calibrate")).mode) == ({}, None)
    d, measure = draft_from_flags(parse("--draft", "calibrate", "--k", "3"), None)
    assert (d.mode, d.k, measure) == ("chain", 3, False)


def test_cli_tree_flags_without_draft_are_not_calibrated_away(saved, head_without_draft, tmp_path, monkeypatch):
    """The issue's case end to end: --tree-topk 2 --tree-depth 3 on a head with nothing saved runs
    that tree, exactly, and never calibrates."""
    import draftkit.inference.cli_eval as cli_eval

    def no_calibration(*a, **k):
        raise AssertionError("calibration ran although the user gave the draft shape")
    monkeypatch.setattr(cli_eval, "calibrate", no_calibration)
    args = ["eval", "--head", str(head_without_draft), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "prompt.jsonl"), "--tree-topk", "2", "--tree-depth", "3", "--max-new-tokens", "4",
            "--compare", "none", "--dtype", "float32", "--out", str(tmp_path / "t")]
    assert cli(args) == 0
    rep = json.loads((tmp_path / "t" / "report.json").read_text())
    assert {k: rep["draft"][k] for k in ("mode", "topk", "depth", "chosen_by")} == {
        "mode": "tree", "topk": 2, "depth": 3, "chosen_by": "user"}
    assert rep["draft_source"] == "flags" and rep["methods_measured"] == ["head"]
    assert not (tmp_path / "t" / "draft.json").exists()  # nothing measured, nothing to reuse
    assert cli(args[:-2] + ["--out", str(tmp_path / "u"), "--k", "2"]) == 2  # chain or tree? said, not guessed
    assert cli(args[:-2] + ["--out", str(tmp_path / "v"), "--tree-topk", "0"]) == 2


def test_compare_flag():
    """--compare alone or unset = every method; none = only the main one; names = those."""
    from draftkit.inference.cli_eval import compare_methods
    from draftkit.inference.evaluate import METHODS

    assert compare_methods(parse()) == METHODS == compare_methods(parse("--compare")) == compare_methods(
        parse("--compare", "all"))
    assert compare_methods(parse("--compare", "none")) == ()
    assert compare_methods(parse("--compare", "plain", "hybrid")) == ("plain", "hybrid")
    assert compare_methods(parse("--compare", "--no-baseline", "--no-ngram")) == ("head", "hybrid")
    with pytest.raises(SpecError, match="stand alone"):
        compare_methods(parse("--compare", "none", "plain"))


def test_help_version_and_defaults(capsys):
    """Every eval flag has help and shows its default; sampling's --top-k and tree drafting's
    --tree-topk say which they are; `draftkit --help` says what the tool is; --version is the
    installed package's."""
    import argparse
    import importlib.metadata

    from draftkit.inference.cli_eval import HELP_FORMATTER, add_arguments

    p = argparse.ArgumentParser(prog="draftkit eval", formatter_class=HELP_FORMATTER)
    add_arguments(p)
    fmt = HELP_FORMATTER("draftkit eval")
    for action in p._actions:
        if action.dest != "help":
            assert action.help and ("default" in fmt._get_help_string(action)
                                    or "unset" in action.help), action.option_strings
    text = " ".join(p.format_help().split())
    assert "--top-k TOP_K sampling:" in text and "--tree-topk TREE_TOPK tree drafting:" in text
    assert "(default: auto)" in text and "(default: 128)" in text
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"draftkit {importlib.metadata.version('draftkit')}"
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train speculative-decoding draft heads" in out and "thin shells" not in out


def test_dtype_auto_follows_the_device(monkeypatch):
    """auto = bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), else float32;
    a forced dtype is kept; the why names the CPU flags; recipes and the target config say auto."""
    from draftkit.config import TargetConfig, load_recipe
    from draftkit.target import TargetError, resolve_dtype

    for amx, avx512_bf16, want in ((False, False, "float32"), (False, True, "bfloat16"), (True, False, "bfloat16")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        dtype, why = resolve_dtype("auto", "cpu")
        assert dtype == want and why.startswith(f"dtype auto -> {want} (cpu flags: ")
        assert "torch cpu capability" in why
        assert resolve_dtype("float32", "cpu") == ("float32", "dtype float32 (forced)")
        assert resolve_dtype("bfloat16", "cpu")[0] == "bfloat16"
    with pytest.raises(TargetError, match="target.dtype: 'fp8'"):
        resolve_dtype("fp8")
    assert TargetConfig().dtype == "auto"
    for recipe in sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml")):
        assert load_recipe(str(recipe)).target.dtype == "auto", recipe.name


def test_cli_dtype_auto(saved, tmp_path, caplog):
    """eval's default dtype is auto: the report's dtype is the rule's choice for this machine, and
    the choice with its CPU flags is printed and recorded. Where bf16 is not native (an AVX2-only CPU)
    the decode dtype is measured (draftkit/device.py): the choice is then the per-stage line, and the
    loop's dtype is bf16 exactly when the measurement says bf16 is 10% faster at every stage."""
    from draftkit.device import DECODE_MARGIN
    from draftkit.target import resolve_dtype

    args = ["eval", "--head", str(saved / "run"), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "prompt.jsonl"), "--k", "2", "--max-new-tokens", "4", "--compare", "none",
            "--out", str(tmp_path / "a")]
    with caplog.at_level("INFO", logger="draftkit.target"):
        assert cli(args) == 0
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    batched, why = resolve_dtype("auto", "cpu")
    assert f"target {why}" in caplog.messages  # the load's line: the batched stages' dtype
    stages = rep["dtype_stages"]
    assert stages["batched"] == batched and rep["dtype"] == stages["decode"]
    if stages["decode_ms"] is None:  # native bf16 (or not a CPU): one dtype, resolve_dtype's
        choice = why
        assert stages["decode"] == batched
    else:  # measured: the per-stage line, and the decode dtype follows the measured figures
        choice = stages["line"]
        faster = all(stages[m]["bfloat16"] < (1 - DECODE_MARGIN) * stages[m]["float32"]
                     for m in ("decode_ms", "prefill_ms", "verify_ms"))
        assert stages["decode"] == ("bfloat16" if faster else "float32"), stages
    assert rep["dtype_choice"] == choice and "cpu flags:" in choice
    assert choice in (tmp_path / "a" / "report.md").read_text()


def test_a_saved_choice_is_reused_only_for_the_setup_it_was_measured_on(target, tmp_path):
    """--out/draft.json is reused for the same head directory, target (fingerprint), dtype and
    device only; any of them different means it was measured for something else."""
    from draftkit.inference.cli_eval import draft_record, same_setup

    rec = json.loads(json.dumps(draft_record(DraftSettings(), tmp_path / "head", target)))
    assert same_setup(rec, tmp_path / "head", target) and same_setup(rec, tmp_path / "x" / ".." / "head", target)
    assert not same_setup(rec, tmp_path / "other-head", target)
    for key, value in (("dtype", "float16"), ("device", "cuda:0"), ("target", {"fingerprint": "0" * 16})):
        assert not same_setup({**rec, key: value}, tmp_path / "head", target), key


def test_calibration_prompts_are_spread_over_the_list_in_turn_from_each_category():
    """--calibration-prompts N (help: 'spread evenly over the prompt list, in turn from each
    category'): every category is drawn in turn, each category's picks spread over its own prompts
    (not its first ones), `skip` is honoured, and a category holding fewer prompts than its share
    gives each of them once (never a repeat while another is left out)."""
    from draftkit.inference.calibrate import calibration_prompts

    items = [{"ids": [c, i], "category": c} for c, n in ((1, 6), (2, 2), (3, 1)) for i in range(n)]
    assert calibration_prompts(items, 4) == [[1, 0], [2, 0], [3, 0], [1, 3]]  # category 1: 2 picks of 6, at 0 and 3
    assert calibration_prompts(items, 3, skip={(1, 0), (3, 0)}) == [[1, 1], [2, 0], [1, 3]]  # 2 categories left
    one = [{"ids": [i], "category": "all"} for i in range(10)]
    assert calibration_prompts(one, 3) == [[0], [3], [6]]  # one category: spread over the list
    three = [{"ids": [i], "category": "all"} for i in range(3)]
    assert calibration_prompts(three, 4) == [[0], [1], [2]]  # fewer than asked: each once, none repeated


def test_calibration_profiles_at_the_temperatures_eval_runs(target, fitted, capsys):
    """Eval's calibration (the issue: 'profiling is always greedy, whatever --temperature says')
    traces and times at each requested temperature: at T = 1 the traces are sampled (another output
    than the greedy one, the sampling noise timed), at T = 0 they are greedy, and the printed
    prediction is of that run."""
    from draftkit.inference.calibrate import calibrate
    from draftkit.inference.evaluate import as_prompts

    s = EvalSettings(temperatures=(0.0, 1.0), max_new_tokens=8)
    chosen, cal = calibrate(target, fitted, as_prompts(LOOP_PROMPTS), s, n=1, budget_s=20, progress=False)
    assert set(cal.traces) == set(cal.costs) == {0.0, 1.0}
    greedy, sampled = cal.traces[0.0][0], cal.traces[1.0][0]
    assert greedy.temperature == 0.0 and sampled.temperature == 1.0 and sampled.tokens != greedy.tokens
    assert cal.costs[1.0].temperature == 1.0 and cal.costs[1.0].noise_ms_per_row > 0 == cal.costs[0.0].noise_ms_per_row
    assert "draft auto: " in capsys.readouterr().err and chosen.measured["calibration_prompts"] == 1
