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
from draftkit.inference.errors import SpecError
from draftkit.inference.evaluate import evaluate, read_prompt_file
from draftkit.inference.report import format_table, write_report

FIXTURES = Path(__file__).parent / "fixtures"
KEYS = ("tau", "acceptance_per_position", "tokens_per_s", "baseline_tokens_per_s", "speedup",
        "greedy_mismatches", "num_prompts", "k", "temperature", "per_category")


pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_evaluate_report(target, tmp_path):
    prompts = read_prompt_file(FIXTURES / "data" / "mtbench.jsonl") + read_prompt_file(FIXTURES / "data" / "prompt.jsonl")
    head = build_head({"type": "eagle"}, target)
    rep = evaluate(target, head, prompts, k=3, temperatures=(0.0, 0.7), max_new_tokens=12, batch_size=2)
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
    assert rep["speedup"] > 0 and rep["ngram"] == rep["methods"]["lookup"]
    paths = write_report(rep, tmp_path)
    names = {p.name for p in paths}
    assert {"report.json", "report.md"} <= names
    # matplotlib is a dev dependency: the plot must be there
    assert "acceptance.png" in names and (tmp_path / "acceptance.png").stat().st_size > 1000
    assert json.loads((tmp_path / "report.json").read_text())["tau"] == rep["tau"]
    assert "tau" in format_table(rep) and "| T |" in (tmp_path / "report.md").read_text()


def test_training_time_mode_is_cheap(target):
    head = build_head({"type": "eagle"}, target)
    rep = evaluate(target, head, ["Say hi.", [5, 6, 7, 8]], k=2, max_new_tokens=6, baseline=False, ngram=False)
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
    rep = evaluate(target, head, [long_prompt, "Hello there."], k=2, max_new_tokens=8, baseline=False, ngram=False)
    assert rep["num_prompts"] == 1 and "too long" in rep["skipped"][0]["reason"]
    with pytest.raises(SpecError, match="no prompt fits"):
        evaluate(target, head, [long_prompt], k=2, max_new_tokens=8)
    with pytest.raises(SpecError, match="k"):
        evaluate(target, head, ["Hi"], k=0)


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
    rep = evaluate(target, head, prompts, k=2, max_new_tokens=4, raise_errors=False)
    assert rep["status"] == "partial" and "simulated" in rep["error"]
    assert 0 < rep["runs"][0]["done_prompts"] < 6 and rep["steps"] > 0
    paths = write_report(rep, tmp_path)
    assert json.loads(paths[0].read_text())["status"] == "partial"
    with pytest.raises(RuntimeError):
        calls["n"] = 0
        evaluate(target, head, prompts, k=2, max_new_tokens=4)


def test_cli(saved, tmp_path, capsys):
    args = ["eval", "--head", str(saved / "run"), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "mtbench.jsonl"), "--k", "2", "--max-new-tokens", "6", "--out", str(tmp_path / "a")]
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
            str(FIXTURES / "data" / "prompt.jsonl"), "--k", "2", "--max-new-tokens", "4", "--no-ngram",
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
              "--k", "3", "--max-new-tokens", "16", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["greedy_mismatches"] == 0 and rep["ngram_greedy_mismatches"] == 0 and rep["num_prompts"] == 2
    assert (out / "report.md").is_file()


def test_ngram_only_without_a_head(target):
    rep = evaluate(target, None, ["Repeat: a b c a b c a b c", "Count to five."], k=3, max_new_tokens=10)
    assert rep["drafter"] == "ngram" and rep["greedy_mismatches"] == 0 and list(rep["methods"]) == ["lookup"]
    assert rep["main"] == "lookup" and rep["num_prompts"] == 2
    with pytest.raises(SpecError, match="nothing to evaluate"):
        evaluate(target, None, ["Hi"], ngram=False)


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
    rep = evaluate(target, head, prompts, k=3, temperatures=(0.0, 0.7), max_new_tokens=8, ngram=False,
                   acceptance="typical", typical_epsilon=0.1, typical_delta=0.25)
    assert rep["status"] == "complete" and rep["acceptance"] == "typical (lossy, eps=0.1, delta=0.25)"
    assert rep["lossless"] is False and rep["greedy_mismatches"] is not None  # reported, whatever it is
    write_report(rep, tmp_path / "typ")
    md = (tmp_path / "typ" / "report.md").read_text()
    assert "typical (lossy, eps=0.1, delta=0.25)" in md and "LOSSY" in md and "not a bug" in md
    table = format_table(rep)
    assert "typical (lossy" in table and "LOSSY" in table
    assert json.loads((tmp_path / "typ" / "report.json").read_text())["acceptance"].startswith("typical (lossy")
    # the default: lossless rejection sampling, said so
    rep = evaluate(target, head, prompts, k=3, max_new_tokens=8, baseline=False, ngram=False)
    assert rep["acceptance"] == "rejection (lossless)" and rep["lossless"] is True
    assert "rejection (lossless)" in format_table(rep) and "LOSSY" not in format_table(rep)
    with pytest.raises(SpecError, match="acceptance must be one of"):
        evaluate(target, head, prompts, acceptance="lossy")


def test_cli_acceptance(saved, tmp_path, capsys):
    args = ["eval", "--head", str(saved / "run"), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "prompt.jsonl"), "--k", "2", "--max-new-tokens", "4", "--no-ngram",
            "--acceptance", "typical", "--typical-epsilon", "0.05", "--out", str(tmp_path / "t")]
    assert cli(args) == 0
    rep = json.loads((tmp_path / "t" / "report.json").read_text())
    assert rep["acceptance"] == "typical (lossy, eps=0.05, delta=0.3)" and rep["lossless"] is False
    captured = capsys.readouterr()
    assert "typical (lossy" in captured.out and "not the target's distribution" in captured.err
    assert cli(args[:-2] + ["--typical-delta", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "typical_delta" in capsys.readouterr().err


def test_side_by_side_head_lookup_hybrid(target, tmp_path):
    """One interleaved run of plain, lookup, the head's tree and the hybrid: every method lossless
    at T = 0, per category too, accepted tokens attributed to their source, the plot drawn."""
    from draftkit.inference.drafters import DraftSettings
    from draftkit.inference.evaluate import EvalSettings

    head = build_head({"type": "eagle"}, target).eval()
    prompts = read_prompt_file(FIXTURES / "data" / "mtbench.jsonl") + [[5, 6, 7, 5, 6, 7, 5, 6]]
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
    assert rep["runs"][1]["methods"]["hybrid"]["tau"] == rep["runs"][1]["tau"]
    paths = write_report(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Side by side" in md and "hybrid *" in md and "tree topk=2 depth=3 budget=6" in md
    assert (tmp_path / "acceptance.png").stat().st_size > 1000 and len(paths) == 3


def test_cli_draft_auto_measures_once_and_writes_the_choice(saved, tmp_path, capsys):
    head_dir = saved / "run" / "head"
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg.pop("draft", None)
    (head_dir / "config.json").write_text(json.dumps(cfg))
    args = ["eval", "--head", str(head_dir), "--target", str(saved / "target"), "--prompts",
            str(FIXTURES / "data" / "mtbench.jsonl"), "--max-new-tokens", "6", "--calibration-prompts", "1",
            "--compare", "plain", "--out", str(tmp_path / "a")]
    assert cli(args) == 0
    err = capsys.readouterr().err
    assert "measuring verify/draft cost" in err and "verify ms by width" in err
    draft = json.loads((head_dir / "config.json").read_text())["draft"]
    assert draft["chosen_by"].startswith("measured") and draft["measured"]["verify_ms"]
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["draft"] == draft and rep["greedy_mismatches"] == 0
    # the second run reuses the saved choice; flags override it without touching the file
    assert cli(args[:-1] + [str(tmp_path / "b")]) == 0
    assert "measuring" not in capsys.readouterr().err
    assert cli(args[:-2] + ["--draft", "tree", "--tree-topk", "3", "--tree-budget", "5", "--out", str(tmp_path / "c")]) == 0
    rep = json.loads((tmp_path / "c" / "report.json").read_text())
    assert rep["draft"]["mode"] == "tree" and rep["draft"]["topk"] == 3 and rep["draft"]["budget"] == 5
    assert rep["draft"]["chosen_by"] == "user" and rep["greedy_mismatches"] == 0
    assert json.loads((head_dir / "config.json").read_text())["draft"] == draft
    assert cli(args[:-2] + ["--draft", "tree", "--tree-topk", "0", "--out", str(tmp_path / "d")]) == 2
    assert "draft.topk" in capsys.readouterr().err
