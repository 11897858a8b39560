"""Every export names the verifier the head was trained against (draftkit/export/verifier.py): the
target's directory or hub id by default, the converted safetensors directory for a GGUF or the
embedded target, or --verifier; fingerprinted and refused when it is another model."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from draftkit.export import ExportError, export_head
from draftkit.export.contract import describe
from draftkit.heads import build_head
from draftkit.target import EMBEDDED_NAME, Target, load_target
from tests.conftest import make_tiny_target

FIXTURES = Path(__file__).parent / "fixtures"
E3 = {"type": "eagle3", "draft_vocab_size": 64, "feature_layers": [1, 2, 3]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two saved tiny targets: the one heads are trained on, and another one."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("verifiers")
    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    for seed in (0, 1):
        make_tiny_target(seed=seed).model.save_pretrained(root / f"model{seed}")
        tok.save_pretrained(root / f"model{seed}")
    return root / "model0", root / "model1"


def head_on(target, directory):
    build_head(dict(E3), target).save_pretrained(directory)
    return directory


def exported(out):
    cfg = json.loads((out / "config.json").read_text())
    return cfg, cfg["draftkit_contract"]["verifier"]


def test_default_verifier_is_the_target_directory(model_dirs, tmp_path):
    target = load_target(str(model_dirs[0]), dtype="float32")
    src = head_on(target, tmp_path / "head")
    cfg, v = exported(export_head(src, "speculators", tmp_path / "spec"))
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(model_dirs[0].resolve())
    assert v == {"name_or_path": str(model_dirs[0].resolve()), "fingerprint": target.fingerprint,
                 "checked": True, "note": None}
    _, v = exported(export_head(src, "vllm", tmp_path / "vllm"))  # every format names it
    assert v["checked"] and v["fingerprint"] == target.fingerprint
    assert f"verifier: {model_dirs[0].resolve()} (checked: fingerprint {target.fingerprint})" in describe(
        json.loads((tmp_path / "vllm" / "config.json").read_text())["draftkit_contract"])


def test_verifier_of_another_model_is_refused(model_dirs, tmp_path):
    target = load_target(str(model_dirs[0]), dtype="float32")
    src = head_on(target, tmp_path / "head")
    with pytest.raises(ExportError, match=r"model1 has embedding/lm_head fingerprint \w+, but the head was "
                                          rf"trained against .*model0 \({target.fingerprint}\)"):
        export_head(src, "speculators", tmp_path / "spec", verifier=str(model_dirs[1]))
    with pytest.raises(ExportError, match="'/no/such/model' is neither a model directory nor a hub id"):
        export_head(src, "speculators", tmp_path / "spec", verifier="/no/such/model")
    cfg, v = exported(export_head(src, "speculators", tmp_path / "spec", verifier=str(model_dirs[0])))
    assert v["checked"] and cfg["speculators_config"]["verifier"]["name_or_path"] == str(model_dirs[0].resolve())


def test_hub_id_not_downloaded_warns_loudly(model_dirs, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    tiny = make_tiny_target()
    src = head_on(Target(tiny.model, None, name="some-org/some-model"), tmp_path / "head")
    with caplog.at_level(logging.WARNING):
        cfg, v = exported(export_head(src, "speculators", tmp_path / "spec"))
    assert "VERIFIER NOT CHECKED: some-org/some-model" in caplog.text
    assert v == {"name_or_path": "some-org/some-model", "fingerprint": None, "checked": False, "note": None}
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "some-org/some-model"
    assert "NOT CHECKED" in describe(cfg["draftkit_contract"])[-1]


def test_embedded_and_gguf_targets_name_their_converted_directory(model_dirs, tmp_path, monkeypatch):
    """The embedded default (and any .gguf target) is served from the safetensors directory
    draftkit converts it into; here a saved tiny model stands in for that conversion."""
    import draftkit.target as tgt

    converted = []
    monkeypatch.setattr(tgt, "embedded_gguf_path", lambda: tmp_path / "embedded.gguf")
    monkeypatch.setattr(tgt, "gguf_model_dir", lambda gguf, name=None: converted.append((gguf, name)) or model_dirs[0])
    tiny = make_tiny_target()
    src = head_on(Target(tiny.model, None, name=EMBEDDED_NAME), tmp_path / "head")
    cfg, v = exported(export_head(src, "speculators", tmp_path / "spec"))
    assert converted == [(tmp_path / "embedded.gguf", EMBEDDED_NAME)]
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(model_dirs[0].resolve())
    assert v["checked"] and "hub's HuggingFaceTB/SmolLM2-135M-Instruct weights differ" in v["note"]
    gguf = tmp_path / "model-q4.gguf"
    gguf.write_bytes(b"GGUF")
    src = head_on(Target(tiny.model, None, name=str(gguf)), tmp_path / "head-gguf")
    _, v = exported(export_head(src, "vllm", tmp_path / "vllm"))
    assert converted[-1] == (gguf, None) and v["checked"] and v["note"] == f"converted from the GGUF file {gguf}"


def test_cli_verifier_flag(model_dirs, tmp_path, capsys):
    from draftkit.cli import main

    target = load_target(str(model_dirs[0]), dtype="float32")
    src = head_on(target, tmp_path / "head")
    args = ["export", str(src), "--format", "speculators", "--out", str(tmp_path / "s")]
    assert main(args + ["--verifier", str(model_dirs[1])]) == 1
    assert "but the head was trained against" in capsys.readouterr().err
    assert main(args + ["--verifier", str(model_dirs[0])]) == 0
