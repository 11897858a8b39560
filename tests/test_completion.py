"""Base models and raw text: completion mode (`data.format: text`), raw-text prompt files, streaming
`datasets` sources. A tiny random llama with the fixture tokenizer stripped of its chat template
stands in for a base model; nothing here reads ../shared or a real target."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftkit.config import DataConfig
from draftkit.distill import DataContext, GenerationSettings, PromptSource, load_prompts, prepare_samples, regenerate
from draftkit.distill.regenerate import Conversation
from draftkit.distill.sources import Prompt
from draftkit.distill.synthesize import magpie_prefix
from draftkit.distill.samples import tokenize_completion
from draftkit.distill.text import completion_ids, resolve_format
from draftkit.prompts import cut_text, read_text_prompts

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
FAST = GenerationSettings(max_new_tokens=6, temperature=0.0, batch_size=4)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def base_tokenizer():
    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    tok.chat_template = None  # a base model's tokenizer
    return tok


@pytest.fixture(scope="module")
def model(base_tokenizer):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(base_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=base_tokenizer.eos_token_id,
                      bos_token_id=base_tokenizer.bos_token_id, pad_token_id=base_tokenizer.pad_token_id)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "corpus"
    (d / "src").mkdir(parents=True)
    (d / "notes.txt").write_text("First paragraph\nstill first.\n\nSecond one.\n\n\n")
    (d / "src" / "ops.py").write_text(CODE)
    (d / ".hidden.txt").write_text("never read")
    (d / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")  # not UTF-8: skipped inside a directory
    return d


# ----------------------------------------------------------------------------- raw-text prompts

def test_read_text_prompts_paragraphs_code_files_directories(text_dir):
    got = read_text_prompts(text_dir)
    assert got == [("notes.txt:0", "First paragraph\nstill first."), ("notes.txt:1", "Second one."),
                   ("src/ops.py:0", CODE.rstrip())]
    assert read_text_prompts(text_dir / "src" / "ops.py") == [("ops:0", CODE.rstrip())]
    assert cut_text("line one\nline two\nline three", 20) == "line one\nline two"
    assert cut_text("no breaks at all", 5) == "no br"
    with pytest.raises(ValueError, match="blob.bin: not a UTF-8 text file"):
        read_text_prompts(text_dir / "blob.bin")
    empty = text_dir / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt: no raw-text prompts"):
        read_text_prompts(empty)


def test_sources_read_raw_text_and_text_records(text_dir, tmp_path):
    records = tmp_path / "docs.jsonl"
    records.write_text(json.dumps({"text": "A record of raw text."}) + "\n")
    got = load_prompts([PromptSource(str(text_dir)), PromptSource(str(records))], None, seed=0)
    texts = sorted(p.messages[-1]["content"] for p in got)
    assert texts == sorted(["First paragraph\nstill first.", "Second one.", CODE.rstrip(), "A record of raw text."])
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in got)


def test_streaming_source_is_read_lazily_and_mixed_by_weight(tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"streamed document {i}"}) + "\n" for i in range(200)))
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"local prompt {i}"}) + "\n" for i in range(30)))
    sources = [PromptSource(str(big), weight=3, streaming=True, shuffle_buffer=50), PromptSource(str(small))]
    got = load_prompts(sources, limit=12, seed=0)
    streamed = [p for p in got if p.messages[0]["content"].startswith("streamed")]
    assert len(got) == 12 and len(streamed) == 9  # weights 3 : 1
    assert got == load_prompts(sources, limit=12, seed=0)  # deterministic in the seed
    with pytest.raises(ValueError, match="big.jsonl: a streaming source needs a prompt count"):
        load_prompts(sources[:1], limit=None, seed=0)


# ----------------------------------------------------------------------------- the format

def test_resolve_format(base_tokenizer, caplog):
    chat_tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    assert resolve_format("auto", chat_tok, "chatty") == "chat"
    assert resolve_format("text", chat_tok, "chatty") == "text"
    with caplog.at_level(logging.WARNING):
        assert resolve_format("auto", base_tokenizer, "base-x") == "text"
    assert "base-x has no chat template: training in completion mode" in caplog.text
    with pytest.raises(ValueError, match="data.format: chat, but the tokenizer of target base-x has no chat "
                                         "template.*use data.format: text"):
        resolve_format("chat", base_tokenizer, "base-x")
    with pytest.raises(ValueError, match="data.format: 'json' is not one of auto, chat, text"):
        resolve_format("json", base_tokenizer, "base-x")


def test_magpie_refuses_a_base_model_naming_the_alternative(base_tokenizer):
    with pytest.raises(ValueError, match="needs a chat template.*data.sources with data.format: text.*--prompts"):
        magpie_prefix(base_tokenizer)


def test_completion_sample_masks_exactly_the_continuation(base_tokenizer):
    tok = base_tokenizer
    prompt = Prompt([{"role": "user", "content": "The quick brown fox"}], None, "p:0")
    ended = tokenize_completion(tok, Conversation(prompt, " jumps over", truncated=False, num_tokens=3))
    p_ids = tok("The quick brown fox")["input_ids"]
    r_ids = tok(" jumps over", add_special_tokens=False)["input_ids"]
    assert ended["input_ids"] == p_ids + r_ids + [tok.eos_token_id]
    assert ended["loss_mask"] == [0] * len(p_ids) + [1] * (len(r_ids) + 1)
    cut = tokenize_completion(tok, Conversation(prompt, " jumps over", truncated=True, num_tokens=2))
    assert cut["input_ids"] == p_ids + r_ids and cut["loss_mask"] == [0] * len(p_ids) + [1] * len(r_ids)


def test_regenerate_continues_the_raw_text(model, base_tokenizer, tmp_path, monkeypatch):
    """The target is fed exactly the tokenizer's encoding of the raw text (no template), and the
    response is its greedy continuation; the chat and text caches never mix."""
    seen, original = [], model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["input_ids"].clone())
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    prompts = [Prompt([{"role": "user", "content": "def add(a, b):"}], None, "c:0")]
    text = DataContext(model, base_tokenizer, tmp_path, "t", fmt="text", progress=False)
    convs = regenerate(text, prompts, FAST)
    ids = completion_ids(base_tokenizer, prompts[0].messages)
    assert seen[0][0].tolist() == ids
    ref = original(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                   max_new_tokens=FAST.max_new_tokens, do_sample=False,
                   eos_token_id=base_tokenizer.eos_token_id, pad_token_id=base_tokenizer.pad_token_id)
    new = ref[0, len(ids):].tolist()
    assert convs[0].response == base_tokenizer.decode(
        [t for t in new if t != base_tokenizer.eos_token_id], skip_special_tokens=True)
    regenerate(text, prompts, FAST)
    assert len(seen) == 1  # cached


def test_prepare_samples_in_completion_mode(model, base_tokenizer, tmp_path, text_dir):
    def in_text_mode(sources, holdout):
        data = DataConfig(sources=sources, holdout=holdout, max_length=64, responses=FAST)
        return prepare_samples(DataContext(model, base_tokenizer, tmp_path, "t", data, fmt="text", progress=False), 2)

    samples, holdout, stats = in_text_mode([PromptSource(str(text_dir))], holdout=1)
    assert len(holdout) == 1 and stats["kept"] == 2
    raw = [completion_ids(base_tokenizer, [{"role": "user", "content": t}]) for _, t in read_text_prompts(text_dir)]
    for s in samples:
        first = s["loss_mask"].index(1)
        assert s["input_ids"][:first] in raw  # the raw text's own tokens, no template around them
        assert all(s["loss_mask"][first:]) and not any(s["loss_mask"][:first])
    with pytest.raises(ValueError, match="data.sources is empty.*Magpie.*chat template.*data.format: text"):
        in_text_mode([], holdout=0)


def test_base_model_trains_end_to_end_from_a_text_file(model, base_tokenizer, tmp_path):
    """run.py on a saved base model (no chat template) and a .txt corpus: completion mode is
    detected, and a head comes out."""
    model_dir = tmp_path / "base-model"
    model.save_pretrained(model_dir)
    base_tokenizer.save_pretrained(model_dir)
    assert not (model_dir / "chat_template.jinja").exists()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i} about {w}." for i, w in enumerate("abcdefghijkl")))
    out = tmp_path / "run"
    args = [f"target.path={model_dir}", "target.dtype=float32", f"data.sources=[{{path: {corpus}}}]",
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", "data.holdout=2", "data.max_length=48",
            "data.responses.max_new_tokens=8", "train.micro_batch_size=2", "train.max_steps=3",
            "train.warmup_steps=1", "logging.wandb_project=null", "head.type=eagle", "head.draft_vocab_size=64"]
    env = {"DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": "/usr/bin:/bin"}  # the recipe's engine auto: hf, as vLLM's CPU attention cannot serve head_dim 8
    r = subprocess.run([sys.executable, "draftkit/train/run.py", "recipes/quick.yaml", *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "has no chat template: training in completion mode" in r.stderr + r.stdout
    assert "data.responses.engine auto -> hf: head_dim 8 not in vLLM CPU's supported sizes" in r.stderr + r.stdout
    assert (out / "head" / "model.safetensors").is_file()


def test_recipe_format_field():
    from draftkit.config import load_recipe
    from draftkit.schema import ConfigError

    assert load_recipe(None).data.format == "auto"
    assert load_recipe(None, ["data.format=text"]).data.format == "text"
    with pytest.raises(ConfigError, match="data.format"):
        load_recipe(None, ["data.format=txt"])
    src = load_recipe(None, ["data.sources=[{path: big.jsonl, streaming: true, weight: 2}]"]).data.sources[0]
    assert (src.path, src.streaming, src.weight, src.shuffle_buffer) == ("big.jsonl", True, 2.0, 10_000)
