"""Export / import / inspect: every format round-trips to bit-identical draft logits, and bad input
is refused with a message that names the tensor, field or file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftkit.export import ExportError, export_head, import_head
from draftkit.export.cli_inspect import inspect_dir
from draftkit.heads import build_head, load_head
from tests.conftest import make_tiny_target

FAMILY_SETTINGS = {
    "eagle": {"type": "eagle", "num_layers": 2, "fc_bias": True},  # the EAGLE-1 reference's fc
    "eagle_nobias": {"type": "eagle"},  # draftkit's default: vLLM's llama_eagle fc has no bias
    "eagle_vocab": {"type": "eagle", "draft_vocab_size": 40},  # EAGLE-1 with a draft vocabulary (d2t / t2d)
    "eagle3": {"type": "eagle3", "draft_vocab_size": 64, "feature_layers": [1, 2, 3]},
    "medusa": {"type": "medusa", "num_heads": 3},
    "medusa_shared": {"type": "medusa", "num_heads": 3, "share_lm_head": True},
    "mtp": {"type": "mtp"},
}
ROUND_TRIPS = [
    ("eagle", "draftkit"), ("eagle_vocab", "draftkit"), ("eagle", "sglang"), ("eagle_nobias", "vllm"), ("eagle_nobias", "sglang"),
    ("eagle3", "draftkit"), ("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle3", "speculators"),
    ("medusa", "draftkit"), ("medusa", "vllm"), ("medusa_shared", "vllm"), ("mtp", "draftkit"),
]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target()


def make_head(kind: str, target, directory: Path, recipe_hash: str = "r-123") -> Path:
    head = build_head(dict(FAMILY_SETTINGS[kind]), target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():  # non-trivial weights everywhere (zero-init blocks included)
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(counts=torch.randint(0, 1000, (target.vocab_size,), generator=g))
    head.save_pretrained(directory, extra={"recipe_hash": recipe_hash})
    return directory


def draft_logits(head, target, k: int = 3) -> list[torch.Tensor]:
    """The logits every draft step samples from, on fixed inputs."""
    seen: list[torch.Tensor] = []

    def sample(logits):
        seen.append(logits.clone())
        return logits.argmax(-1), None

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, target.vocab_size, (2, 9), generator=g)
    feats = target.features(ids, None, head.feature_layers).hidden
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, -2:] = False
    head.draft(head.new_draft_state(2), feats[:, :-1], ids[:, 1:], valid, k, sample)
    return seen


@pytest.mark.parametrize("kind,fmt", ROUND_TRIPS)
def test_round_trip_bit_identical(kind, fmt, target, tmp_path):
    src = make_head(kind, target, tmp_path / "head")
    out = export_head(src, fmt, tmp_path / "export", target=target if kind == "medusa_shared" else None)
    cfg = json.loads((out / "config.json").read_text())
    contract = cfg["draftkit_contract"]
    assert contract["format"] == fmt and contract["recipe_hash"] == "r-123"
    assert contract["target"]["fingerprint"] == target.fingerprint
    assert contract["dtype"] == "float32" and contract["hidden_size"] == target.hidden_size
    back = import_head(out, fmt, tmp_path / "back", target=target)
    a, b = load_head(src, target), load_head(back, target)
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    for x, y in zip(draft_logits(a, target), draft_logits(b, target), strict=True):
        assert torch.equal(x, y)
    assert json.loads((back / "config.json").read_text())["recipe_hash"] == "r-123"
    assert inspect_dir(out, target=target)["problems"] == []


def test_engine_conventions_written(target, tmp_path):
    src = make_head("eagle3", target, tmp_path / "head")
    v = json.loads((export_head(src, "vllm", tmp_path / "v") / "config.json").read_text())
    s = json.loads((export_head(src, "sglang", tmp_path / "s") / "config.json").read_text())
    p = json.loads((export_head(src, "speculators", tmp_path / "p") / "config.json").read_text())
    assert v["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: captured before layer i
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer k
    assert s["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # what vLLM reads first
    assert p["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert p["norm_before_residual"] is False and p["draft_vocab_size"] == 64
    assert v["tie_word_embeddings"] is False and s["draft_vocab_size"] == 64
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert "d2t" in tensors and "draft_id_to_target_id" not in tensors and "embed_tokens.weight" not in tensors
    assert any(k.startswith("midlayer.") for k in tensors)
    assert any(k.startswith("layers.0.") for k in load_file(tmp_path / "p" / "model.safetensors"))


def test_refusals_name_what_is_missing(target, tmp_path):
    eagle = make_head("eagle", target, tmp_path / "eagle")
    with pytest.raises(ExportError, match="fc.bias"):  # vLLM's llama_eagle fc has no bias
        export_head(eagle, "vllm", tmp_path / "o1")
    with pytest.raises(ExportError, match="no EAGLE-1 model class"):
        export_head(eagle, "speculators", tmp_path / "o2")
    with pytest.raises(ExportError, match="unknown format 'tensorrt'"):
        export_head(eagle, "tensorrt", tmp_path / "o3")
    mtp = make_head("mtp", target, tmp_path / "mtp")
    with pytest.raises(ExportError, match="llama layer"):
        export_head(mtp, "vllm", tmp_path / "o4")
    shared = make_head("medusa_shared", target, tmp_path / "medusa")
    with pytest.raises(ExportError, match="--target"):  # vLLM needs the shared lm_head stored
        export_head(shared, "vllm", tmp_path / "o5")
    assert not any(p.name.startswith(".o") for p in tmp_path.iterdir())  # no temp dirs left behind


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle_draft_vocab_is_refused_or_dropped_explicitly(fmt, target, tmp_path, capsys, caplog):
    """vLLM's and SGLang's llama_eagle draft over the full vocabulary: d2t is never lost silently.
    vLLM's EAGLE-1 has no d2t at all, so there the common path (no flag) expands with a note;
    SGLang's takes a token map instead, so there it is refused unless --full-vocab."""
    from draftkit.cli import main

    src = make_head("eagle_vocab", target, tmp_path / "head")
    with pytest.raises(ExportError, match=r"d2t.*--full-vocab"):
        export_head(src, fmt, tmp_path / "o1", full_vocab=False)
    flag = [] if fmt == "vllm" else ["--full-vocab"]
    if fmt == "sglang":
        with pytest.raises(ExportError, match=r"d2t.*--full-vocab"):
            export_head(src, fmt, tmp_path / "o1")
        assert main(["export", str(src), "--format", fmt, "--out", str(tmp_path / "o2")]) == 1
        assert "d2t" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    with caplog.at_level("WARNING"):
        assert main(["export", str(src), "--format", fmt, "--out", str(tmp_path / "out"), *flag]) == 0
    if fmt == "vllm":  # the printed note says what happened and why
        assert any("draft_vocab_size=40" in r.message and "llama_eagle.py has no d2t" in r.message
                   for r in caplog.records), caplog.text
    out = tmp_path / "out"
    contract = json.loads((out / "config.json").read_text())["draftkit_contract"]
    assert contract["draft_vocab"].startswith("dropped: engine drafts over the full target vocabulary")
    assert contract["head"]["draft_vocab_size"] is None and contract["d2t_convention"].startswith("none")
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    report = inspect_dir(out, target=target)
    assert report["problems"] == [] and any("dropped" in line for line in report["lines"])
    # Import gives back what the engine runs: the same weights drafting over the full vocabulary.
    back = load_head(import_head(out, fmt, tmp_path / "back", target=target), target)
    a = load_head(src, target)
    full = build_head({"type": "eagle"}, target)
    full.load_state_dict({k: v for k, v in a.state_dict().items() if k not in ("d2t", "t2d")})
    assert back.config.draft_vocab_size is None
    for x, y in zip(draft_logits(full, target), draft_logits(back, target), strict=True):
        assert torch.equal(x, y)


def test_medusa_export_takes_the_recorded_target_when_none_is_given(tmp_path):
    """vLLM reads a shared Medusa lm_head from the file: without --target the export loads the head's
    recorded target from its verifier directory (fingerprint checked); where there is none the error
    names the recorded target and what is missing."""
    from draftkit.cli import main
    from draftkit.target import Target

    tiny = make_tiny_target()
    tiny.model.save_pretrained(tmp_path / "target")
    saved = Target(tiny.model, None, name=str(tmp_path / "target"))
    src = make_head("medusa_shared", saved, tmp_path / "head")
    assert main(["export", str(src), "--format", "vllm", "--out", str(tmp_path / "out")]) == 0
    stored = load_file(tmp_path / "out" / "model.safetensors")["lm_heads.0.weight"]
    assert torch.equal(stored, tiny.lm_head.weight.detach())
    back = load_head(import_head(tmp_path / "out", "vllm", tmp_path / "back", target=saved), saved)
    for x, y in zip(draft_logits(load_head(src, saved), saved), draft_logits(back, saved), strict=True):
        assert torch.equal(x, y)
    unsaved = make_head("medusa_shared", tiny, tmp_path / "head2")  # recorded target "tiny-llama-0": no directory
    with pytest.raises(ExportError, match=r"recorded target 'tiny-llama-0'.*not a local model directory.*--target"):
        export_head(unsaved, "vllm", tmp_path / "out2")


def test_engine_draft_travels_with_the_head_into_export_contract_and_inspect(target, tmp_path):
    """eval --engine vllm --save-draft puts engine_draft into the head; export copies it into the
    contract (not into contract.head), import keeps it, and inspect prints the measured vLLM flags."""
    from draftkit.engines.vllm_auto import SweepSettings, set_config_key, vllm_record

    rows = [{"k": k, "speedup": sp, "by_temperature": {"T=0": {"tok_s": 20 * sp, "speedup": sp, "tau": 1 + sp / 2,
                                                              "alpha": [0.5] * k, "counters": {}}}}
            for k, sp in ((1, 0.9), (2, 1.2), (3, 1.1))]
    rec = vllm_record("eagle3", {"vllm_version": "0.32.0", "plain": {"T=0": 20.0}, "rows": rows}, SweepSettings(), 4)
    assert (rec["choice"], rec["num_speculative_tokens"], rec["tok_s"]) == ("chain", 2, 24.0)  # the fastest chain
    src = make_head("eagle3", target, tmp_path / "head")
    set_config_key(src, {"vllm": rec})
    out = export_head(src, "vllm", tmp_path / "out")
    contract = json.loads((out / "config.json").read_text())["draftkit_contract"]
    assert contract["engine_draft"]["vllm"]["num_speculative_tokens"] == 2 and "engine_draft" not in contract["head"]
    lines = inspect_dir(out)["lines"]
    flags = next(ln for ln in lines if ln.startswith("vLLM: speculative_config"))
    assert json.loads(flags.split("speculative_config ", 1)[1]) == {"method": "eagle3", "model": str(out),
                                                                     "num_speculative_tokens": 2}
    assert any("measured in vLLM 0.32.0: 24.0 tok/s (tau 1.600) vs plain 20.0 tok/s" in ln for ln in lines), lines
    back = import_head(out, "vllm", tmp_path / "back", target=target)
    assert json.loads((back / "config.json").read_text())["engine_draft"]["vllm"] == contract["engine_draft"]["vllm"]
    slow = [{**r, "speedup": 1.03} for r in rows]  # nothing beats plain by the margin (1.05): plain
    plain = vllm_record("eagle3", {"vllm_version": "0.32.0", "plain": {"T=0": 20.0}, "rows": slow}, SweepSettings(), 4)
    assert plain["choice"] == "plain" and plain["num_speculative_tokens"] is None and plain["margin"] == 1.05


LOOP_CHOICES = {  # the loop's draft: choice -> what inspect must say for vLLM and for SGLang
    "hybrid": ({"mode": "hybrid", "topk": 8, "depth": 1, "budget": 8, "lookup_len": 8, "chosen_by": "measured"},
               "no measured shape", "no measured flags"),
    "hybrid_beside_a_tree": ({"mode": "hybrid", "topk": 8, "depth": 1, "budget": 8, "lookup_len": 8, "chosen_by": "m",
                              "measured": {"top_candidates": [{"shape": "tree 8x1 b8 + lookup 8", "speedup": 1.3},
                                                              {"shape": "tree 4x2 b6", "speedup": 1.2}]}},
                             "no measured shape", "--speculative-num-steps 2 --speculative-eagle-topk 4 "
                             "--speculative-num-draft-tokens 7"),
    "chain": ({"mode": "chain", "k": 3, "chosen_by": "measured", "draft_sampling": "greedy"},
              '"num_speculative_tokens": 3', "--speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4"),
    "tree": ({"mode": "tree", "topk": 4, "depth": 3, "budget": 8, "chosen_by": "measured"},
             "no measured shape", "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 9"),
}


@pytest.mark.parametrize("choice", list(LOOP_CHOICES))
def test_inspect_translates_the_loop_choice_honestly(choice, target, tmp_path):
    """Without engine_draft the flags come from the loop's choice, labelled NOT engine-measured; a
    shape vLLM's chains cannot serve (a tree, a lookup branch) gets no num_speculative_tokens (the
    issue: hybrid topk 8 / depth 1 had become num_speculative_tokens=1), and SGLang's flags are an
    SGLang-valid tree or say why there is none."""
    from draftkit.export.serving import serving_lines

    draft, vllm_says, sglang_says = LOOP_CHOICES[choice]
    lines = serving_lines({"family": "eagle", "format": "vllm", "draft": draft, "head": {}}, "/x")
    vllm = " ".join(ln for ln in lines if ln.startswith("vLLM") or ln.startswith("  NOT"))
    sglang = " ".join(ln for ln in lines if "SGLang" in ln)
    assert vllm_says in vllm and ("NOT engine-measured" in vllm or "no measured shape" in vllm), lines
    assert bool(re.search(r'num_speculative_tokens"?[=:] ?\d', vllm)) == (choice == "chain"), lines  # a value only for a chain
    assert sglang_says in sglang and "not engine-measured (SGLang has no CPU path here)" in sglang, lines
    if choice.startswith("hybrid"):
        assert "lookup branch" in vllm and "lookup branch" in sglang


def test_sglang_valid_trees_follow_sglangs_rule():
    from draftkit.export.serving import sglang_invalid

    assert sglang_invalid(1, 3, 3) is None and "chain" in sglang_invalid(1, 3, 2)  # topk 1: steps + 1 tokens
    assert sglang_invalid(2, 2, 6) is None and "exceed" in sglang_invalid(2, 2, 7)  # 2 + 1 * 4 candidates
    assert sglang_invalid(8, 1, 8) is None and "exceed" in sglang_invalid(8, 1, 9)


def test_bad_input(target, tmp_path):
    src = make_head("eagle", target, tmp_path / "head")
    export_head(src, "sglang", tmp_path / "out")
    with pytest.raises(ExportError, match="already exists"):
        export_head(src, "sglang", tmp_path / "out")
    export_head(src, "sglang", tmp_path / "out", overwrite=True)
    # a truncated safetensors file
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:300])
    with pytest.raises(ExportError, match="truncated"):
        export_head(bad, "sglang", tmp_path / "o1")
    # a config that disagrees with the tensors
    cfg = json.loads((src / "config.json").read_text())
    lie = tmp_path / "lie"
    lie.mkdir()
    (lie / "config.json").write_text(json.dumps({**cfg, "num_layers": 3}))
    (lie / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(ExportError, match="missing"):
        export_head(lie, "sglang", tmp_path / "o2")
    # an export someone added a tensor to: the engine would skip it silently
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    save_file({**tensors, "layers.0.extra.weight": torch.zeros(2)}, tmp_path / "out" / "model.safetensors")
    with pytest.raises(ExportError, match="layers.0.extra.weight"):
        import_head(tmp_path / "out", "sglang", tmp_path / "o3")
    assert "layers.0.extra.weight" in " ".join(inspect_dir(tmp_path / "out")["problems"])


def test_inspect_checks_the_target(target, tmp_path):
    src = make_head("eagle3", target, tmp_path / "head")
    out = export_head(src, "sglang", tmp_path / "out")
    report = inspect_dir(out, target=target)
    assert report["problems"] == [] and report["family"] == "eagle3" and report["format"] == "sglang"
    text = "\n".join(report["lines"])
    assert "[0, 1, 2]" in text and "[1, 2, 3]" in text and "offset" in text
    other = make_tiny_target(seed=1)
    assert any("fingerprint" in p for p in inspect_dir(out, target=other)["problems"])
    with pytest.raises(ExportError, match="fingerprint"):
        import_head(out, "sglang", tmp_path / "back", target=other)
    wider = make_tiny_target(hidden=48)
    assert any("hidden_size" in p for p in inspect_dir(out, target=wider)["problems"])


def test_import_published_layouts(target, tmp_path):
    """Official release layouts: dims and target info come from --target; stored embeddings are checked."""
    head = load_head(make_head("eagle", target, tmp_path / "native"), target)
    sd = {k: v for k, v in head.state_dict().items()}
    official = tmp_path / "eagle-official"
    official.mkdir()
    save_file({**sd, "embed_tokens.weight": target.embed_tokens.weight.detach().clone()},
              official / "model.safetensors")
    cfg = {"architectures": ["LlamaForCausalLM"], **{k: v for k, v in target.config.to_dict().items()
                                                      if k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                               "num_key_value_heads", "rms_norm_eps", "vocab_size")},
           "num_hidden_layers": 2, "hidden_act": "silu"}
    (official / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="--target"):
        import_head(official, "eagle-official", tmp_path / "x")
    back = load_head(import_head(official, "eagle-official", tmp_path / "imported", target=target), target)
    for x, y in zip(draft_logits(head, target), draft_logits(back, target), strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ExportError, match="embed_tokens.weight"):
        import_head(official, "eagle-official", tmp_path / "y", target=make_tiny_target(seed=2))

    # Medusa-1 release: {i}.{j}.linear.*, {i}.{L}.weight, config with medusa_num_heads only
    med = load_head(make_head("medusa", target, tmp_path / "med"), target)
    rel = tmp_path / "medusa-official"
    rel.mkdir()
    save_file({k.removeprefix("medusa_head."): v for k, v in med.state_dict().items()},
              rel / "medusa_lm_head.safetensors")
    (rel / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    back = load_head(import_head(rel, "medusa-official", tmp_path / "med-imported", target=target), target)
    for x, y in zip(draft_logits(med, target), draft_logits(back, target), strict=True):
        assert torch.equal(x, y)

    # EAGLE-3 release: no aux ids (engine default 2, N//2, N-3 of the target), t2d present. An 8-layer
    # target: on 4 layers that default is (2, 2, 1), which no engine can serve (export refuses it).
    target = make_tiny_target(layers=8)
    e3 = build_head({"type": "eagle3", "draft_vocab_size": 64}, target)
    e3.save_pretrained(tmp_path / "e3")
    vout = export_head(tmp_path / "e3", "vllm", tmp_path / "e3v")
    cfg = json.loads((vout / "config.json").read_text())
    for k in ("eagle_aux_hidden_state_layer_ids", "draftkit_contract"):
        cfg.pop(k)
    (vout / "config.json").write_text(json.dumps(cfg))
    back = load_head(import_head(vout, "eagle3-official", tmp_path / "e3-imported", target=target), target)
    assert back.feature_layers == e3.feature_layers
    for x, y in zip(draft_logits(e3, target), draft_logits(back, target), strict=True):
        assert torch.equal(x, y)


def test_cli(target, tmp_path, capsys):
    from draftkit.cli import main

    src = make_head("eagle3", target, tmp_path / "head")
    assert main(["export", str(src), "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    assert main(["export", str(src), "--format", "vllm", "--out", str(tmp_path / "v")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "v"), "--format", "vllm", "--out", str(tmp_path / "back")]) == 0
    assert main(["inspect", str(tmp_path / "v")]) == 0
    out = capsys.readouterr().out
    assert "llama_eagle3.py" in out and "OK" in out
    with pytest.raises(SystemExit):  # argparse: invalid choice, listing the formats
        main(["export", str(src), "--format", "nope", "--out", str(tmp_path / "n")])


def test_layer_zero_cannot_be_captured_by_vllm(target, tmp_path):
    head = build_head({"type": "eagle3", "draft_vocab_size": 64, "feature_layers": [0, 2, 3]}, target)
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ExportError, match="layer 0"):
        export_head(tmp_path / "head", "vllm", tmp_path / "v")
    with pytest.raises(ExportError, match="layer 0"):  # SGLang too (tests/test_export_sglang.py)
        export_head(tmp_path / "head", "sglang", tmp_path / "s")


@pytest.mark.integration
def test_speculators_package_loads_export(tmp_path):
    """benchmarks/check_speculators_load.py in speculators' own venv (~1 min; ~6 min more to create it)."""
    import os
    import subprocess
    import sys

    from benchmarks.check_speculators_load import SKIP, default_venv

    venv = Path(os.environ.get("DRAFTKIT_SPECULATORS_VENV", default_venv()))
    if not (venv / "bin" / "python").exists() and os.environ.get("DRAFTKIT_CHECK_SPECULATORS") != "1":
        pytest.skip(f"no speculators venv at {venv}: set DRAFTKIT_CHECK_SPECULATORS=1 to create it (~6 min)")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "check_speculators_load.py"
    r = subprocess.run([sys.executable, script, "--venv", venv, "--keep", tmp_path / "work"],
                       capture_output=True, text=True)
    if r.returncode == SKIP and os.environ.get("DRAFTKIT_CHECK_SPECULATORS") != "1":
        pytest.skip(r.stdout.strip().splitlines()[-1])  # asked for (CI): a missing index fails below
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
