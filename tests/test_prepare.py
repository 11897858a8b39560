"""`draftkit prepare`: stage 1 as shards with a manifest, read back by the trainer; faults survived.

In-process tests run one rank on the tiny random target of test_train; the launcher test starts
real `python` / `torchrun` processes (two ranks, one SIGKILLed run) and compares the shards' bytes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from draftkit.config import load_recipe
from draftkit.distill.shards import MANIFEST, ShardError, file_sha256, read_manifest
from draftkit.train.distributed import Dist
from tests.test_train import (FIXTURES, ROOT, VENV_BIN, launch, prompt_file, recipe_args,  # noqa: F401
                              tiny_model_dir)

pytestmark = pytest.mark.usefixtures("one_thread")
ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def small(tiny_model_dir, prompt_file, tmp_path, *extra):
    return recipe_args(tiny_model_dir, prompt_file, tmp_path / "run", tmp_path / "cache",
                       "data.num_prompts=10", "data.shard_size=4", *extra)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    from draftkit.target import load_target

    return load_target(str(tiny_model_dir), dtype="float32")


def count_generate(target, monkeypatch) -> list[int]:
    rows, original = [], target.model.generate

    def counting(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(target.model, "generate", counting)
    return rows


@torch.no_grad()
def independent_sample(target, messages: list[dict], max_new_tokens: int, max_length: int) -> dict:
    """What stage 1 must produce for one prompt, from the tokenizer and transformers alone: the chat
    template's text for the prompt, greedy `generate` of one unpadded row until <|im_end|>, the
    conversation's text re-tokenised, the loss on the response and its closing <|im_end|> (not on
    the template's header or what follows; a cut response has no closing token in the loss)."""
    tok, model = target.tokenizer, target.model
    end = tok.convert_tokens_to_ids("<|im_end|>")
    render = lambda msgs, gen: tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen),  # noqa: E731
                                   add_special_tokens=False)["input_ids"]
    prompt = render(messages, True)
    new = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=end, pad_token_id=end)[0, len(prompt):].tolist()
    truncated = end not in new
    response = tok.decode(new if truncated else new[: new.index(end)], skip_special_tokens=True)
    ids = render(messages + [{"role": "assistant", "content": response}], False)
    close = ids.index(end, len(prompt))  # the <|im_end|> closing the response
    mask = [int(len(prompt) <= i < close + (0 if truncated else 1)) for i in range(len(ids))]
    return {"response": response, "truncated": truncated, "input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def test_prepare_writes_shards_the_trainer_reads_without_preparing_again(target, tiny_model_dir, prompt_file,
                                                                          tmp_path, monkeypatch):
    import datasets

    from draftkit.distill import DataContext, prepare_samples
    from draftkit.distill.prepare import load_prepared, prepare
    from draftkit.train.loop import prepare_data

    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path))
    generated = count_generate(target, monkeypatch)
    out = prepare(recipe, target, ONE, 10)
    assert sum(generated) == 12  # 10 training prompts and the 2 held aside, each answered once
    manifest = read_manifest(out)
    assert [e["file"] for e in manifest["splits"]["train"]] == [
        "train-00000-of-00003.parquet", "train-00001-of-00003.parquet", "train-00002-of-00003.parquet"]
    assert [e["rows"] for e in manifest["splits"]["train"]] == [4, 4, 2]
    assert manifest["splits"]["holdout"][0]["rows"] == 2 and manifest["num_samples"] == 10
    for e in manifest["splits"]["train"]:
        assert e["sha256"] == file_sha256(out / e["file"]) and e["bytes"] == (out / e["file"]).stat().st_size
    # the same samples the in-memory path builds, in the same order
    want, holdout, _ = prepare_samples(DataContext(target.model, target.tokenizer, tmp_path / "cache",
                                                   f"{target.name}:{target.fingerprint}", recipe.data,
                                                   progress=False), 10)
    got = load_prepared(out)
    assert got.train == want and len(want) == 10
    assert [p.messages for p in got.holdout_prompts] == [p.messages for p in holdout]
    assert manifest["stats"]["kept"] == 10 and manifest["stats"]["loss_tokens"] == sum(sum(s["loss_mask"]) for s in want)
    # loadable with `datasets`, the very same rows
    ds = datasets.load_dataset("parquet", data_files=str(out / "train-*.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert ds["input_ids"] == [s["input_ids"] for s in want] and ds["loss_mask"] == [s["loss_mask"] for s in want]
    # the trainer finds the finished directory: no generation, the same data
    generated.clear()
    data = prepare_data(recipe, target, ONE, 10)
    assert generated == [] and data.train == want and len(data.holdout_samples) == 2
    # other settings are another directory (here: the loss mask), which reuses the cached responses
    other = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path, "data.loss_on=all"))
    all_out = prepare(other, target, ONE, 10)
    assert all_out != out and generated == []
    assert all(sum(a["loss_mask"]) > sum(r["loss_mask"]) for a, r in zip(load_prepared(all_out).train, want))


@pytest.fixture(scope="module")
def varied_model_dir(tmp_path_factory) -> Path:
    """test_train's tiny target with init std 0.2: its greedy answers depend on the prompt (the
    default init answers every prompt alike, so a response given to the wrong prompt would pass)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, initializer_range=0.2)
    out = tmp_path_factory.mktemp("varied-target")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_shards_hold_what_the_target_says_computed_independently(varied_model_dir, prompt_file, tmp_path):
    """Each shard row against a sample computed here without draftkit's code path or its response
    cache: the prompt (one of the file's) rendered by the chat template, decoded greedily on its own
    by transformers' generate, the conversation re-tokenised, the loss mask on the response."""
    import datasets

    from draftkit.distill.prepare import prepare
    from draftkit.target import load_target

    target = load_target(str(varied_model_dir), dtype="float32")
    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", small(varied_model_dir, prompt_file, tmp_path))
    out = prepare(recipe, target, ONE, 10)
    rows = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train",
                                 cache_dir=str(tmp_path / "hf"))
    prompts_in_file = {json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()}
    responses = set()
    for row in rows:  # the 10 training samples and the 2 held aside
        messages = json.loads(row["messages"])  # stored as JSON text
        assert len(messages) == 1 and messages[0]["content"] in prompts_in_file, messages
        expect = independent_sample(target, messages, max_new_tokens=12, max_length=64)
        assert {k: row[k] for k in expect} == expect, messages
        responses.add(expect["response"])
    assert len(rows) == 12 and len(responses) >= 6  # answers differ by prompt: a swap would show


def test_corrupt_or_truncated_shard_is_named_then_rewritten(target, tiny_model_dir, prompt_file, tmp_path, caplog):
    from draftkit.distill.prepare import load_prepared, prepare

    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path))
    out = prepare(recipe, target, ONE, 10)
    shard = out / "train-00001-of-00003.parquet"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ShardError, match=r"train-00001-of-00003.parquet: truncated, corrupt or missing"):
        load_prepared(out)
    shard.write_bytes(good[:-9] + bytes(b ^ 1 for b in good[-9:]))  # same size, flipped bits
    with pytest.raises(ShardError, match=r"train-00001-of-00003.parquet: truncated, corrupt or missing"):
        load_prepared(out)
    with caplog.at_level("INFO", logger="draftkit.prepare"):
        assert prepare(recipe, target, ONE, 10) == out  # regenerated, never read as it was
    assert "train-00001-of-00003.parquet: corrupt (sha256 differs" in caplog.text
    assert shard.read_bytes() == good and len(load_prepared(out).train) == 10
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(ShardError, match=r"manifest.json: corrupt manifest"):
        load_prepared(out)
    assert prepare(recipe, target, ONE, 10) == out and read_manifest(out)["splits"]["train"][1]["rows"] == 4


def test_prepared_dir_of_another_recipe_is_refused(target, tiny_model_dir, prompt_file, tmp_path):
    from draftkit.distill.prepare import prepare

    mine = tmp_path / "prepared"
    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path,
                                                                f"data.prepared_dir={mine}"))
    assert prepare(recipe, target, ONE, 10) == mine
    with pytest.raises(ShardError, match=r"data.prepared_dir: .*prepared for another recipe, target or size"):
        prepare(recipe, target, ONE, 8)
    bad = load_recipe(None, small(tiny_model_dir, prompt_file, tmp_path, "data.shard_size=0"))
    with pytest.raises(ShardError, match=r"data.shard_size: conversations per shard must be >= 1, got 0"):
        prepare(bad, target, ONE, 10)


def shard_hashes(directory) -> dict[str, str]:
    m = read_manifest(directory)
    return {e["file"]: e["sha256"] for es in m["splits"].values() for e in es}


@pytest.mark.integration
def test_two_ranks_and_a_killed_run_write_the_same_shards_as_one(tiny_model_dir, prompt_file, tmp_path):
    def prepare_cmd(launcher: list[str], cache: str) -> list[str]:
        return [*launcher, "draftkit/distill/prepare.py", "recipes/quick.yaml",
                *recipe_args(tiny_model_dir, prompt_file, tmp_path / "run", tmp_path / cache,
                             "data.num_prompts=12", "data.shard_size=4", "data.responses.batch_size=4")]

    torchrun = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29541"]
    one = launch(prepare_cmd([sys.executable], "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    (one_dir,) = (tmp_path / "one" / "prepared").iterdir()
    assert f"prepared data in {one_dir}" in one.stdout
    killed = launch(prepare_cmd(torchrun, "two"), env_extra={"DRAFTKIT_FAULT_KILL_AFTER_BATCH": "1"})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr + killed.stdout
    (two_dir,) = (tmp_path / "two" / "prepared").iterdir()
    assert not (two_dir / MANIFEST).exists()
    cached = sum(1 for _ in (tmp_path / "two").glob("responses-*/*.jsonl"))
    assert cached >= 1  # the killed ranks left finished batches for the rerun
    rerun = launch(prepare_cmd(torchrun, "two"))
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    assert two_dir.name == one_dir.name  # same data fingerprint, prepared by 2 ranks instead of 1
    assert shard_hashes(two_dir) == shard_hashes(one_dir) and len(shard_hashes(one_dir)) == 4
    for name in shard_hashes(one_dir):
        assert (two_dir / name).read_bytes() == (one_dir / name).read_bytes()
    m1, m2 = read_manifest(one_dir), read_manifest(two_dir)
    assert m1["stats"]["kept"] == m2["stats"]["kept"] == 12
    assert json.dumps(m1["splits"], sort_keys=True) == json.dumps(m2["splits"], sort_keys=True)


def test_stage_two_fills_the_trainers_feature_cache(target, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    from draftkit.distill.prepare import load_prepared, prepare, prepare_features
    from draftkit.heads import build_head
    from draftkit.train.data import feature_store

    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path,
                                                                "head.type=eagle3", "head.feature_layers=[1,2,3]",
                                                                "train.feature_storage=float8"))
    out = prepare(recipe, target, ONE, 10)
    said = prepare_features(recipe, target, ONE, out, batch_size=3)
    layers = build_head(recipe.head, target).feature_layers
    store = feature_store(recipe, target, layers)
    assert f"{store.bytes_per_token()} bytes/token" in said and store.dir.name.endswith("1_2_3-float8")
    data = load_prepared(out)
    assert len(list(store.dir.glob("*.safetensors"))) == len(data.train) + len(data.holdout_samples) == 12
    calls = []
    monkeypatch.setattr(target, "features", lambda *a, **k: calls.append(1))
    feats = store.batch(data.train[:4], pad_id=0)  # the trainer's read: no target forward
    assert calls == [] and store.computed == 0 and feats.hidden.shape[-1] == 3 * target.hidden_size
    again = prepare_features(recipe, target, ONE, out)  # a rerun has nothing to do
    assert calls == [] and again.split(" = ")[0] == said.split(" = ")[0]
    online = load_recipe(None, small(tiny_model_dir, prompt_file, tmp_path, "train.features=online"))
    with pytest.raises(ValueError, match="train.features: online"):
        prepare_features(online, target, ONE, out)


@pytest.mark.integration
def test_sigkill_of_one_rank_in_training_resumes_to_the_uninterrupted_weights(tiny_model_dir, prompt_file, tmp_path):
    from tests.test_train import head_weights

    def train(out: str, port: int, **env):
        args = recipe_args(tiny_model_dir, prompt_file, tmp_path / out, tmp_path / "cache", "train.max_steps=6",
                           "train.save_every=2", "train.epochs=2", "deepspeed={zero_optimization: {stage: 1}}")
        return launch([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port),
                       "draftkit/train/run.py", "recipes/quick.yaml", *args], timeout=600, env_extra=env)

    full = train("full", 29551)
    assert full.returncode == 0, (full.stdout + full.stderr)[-3000:]
    killed = train("res", 29552, DRAFTKIT_FAULT_KILL_AFTER_STEP="3", DRAFTKIT_FAULT_KILL_RANK="1")
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr
    assert (tmp_path / "res" / "checkpoints" / "LATEST").read_text() == "step2"
    resumed = train("res", 29553)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    a, b = head_weights(tmp_path / "full"), head_weights(tmp_path / "res")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)


# ---- offline training without the target's transformer ----
def test_target_without_its_transformer_has_no_decoder_layers_and_is_the_same_target(tmp_path):
    from transformers import AutoTokenizer

    from draftkit.heads import build_head
    from draftkit.target import TargetError, load_target
    from tests.conftest import ARCHITECTURES, make_arch_target
    from tests.test_train import FIXTURES

    for arch in ARCHITECTURES:  # llama, qwen2, qwen3, gemma3 (per-layer rope and layer types), mistral
        d = tmp_path / arch
        make_arch_target(arch).model.save_pretrained(d)
        AutoTokenizer.from_pretrained(FIXTURES / "tokenizer").save_pretrained(d)
        full, shell = load_target(str(d), dtype="float32"), load_target(str(d), dtype="float32", transformer=False)
        assert len(shell.decoder.layers) == 0 and len(full.decoder.layers) == 4, arch
        assert shell.num_layers == 4 and not shell.has_transformer and full.has_transformer
        assert shell.info() == full.info() and shell.config.to_dict() == full.config.to_dict(), arch
        for name in ("embed_tokens", "lm_head", "final_norm"):
            assert all(torch.equal(a, b) for a, b in zip(getattr(shell, name).state_dict().values(),
                                                          getattr(full, name).state_dict().values())), (arch, name)
        ids = torch.tensor([[5, 6, 7]])
        assert torch.equal(shell.embed_tokens(ids), full.embed_tokens(ids))  # Gemma's scaled embedding too
        torch.manual_seed(0)
        a = build_head({"type": "eagle3", "draft_vocab_size": 64}, shell)
        torch.manual_seed(0)
        b = build_head({"type": "eagle3", "draft_vocab_size": 64}, full)
        assert a.config == b.config and all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
        with pytest.raises(TargetError, match=r"without its transformer .*0 of 4 decoder layers.*prepare --features"):
            shell.features(ids, None, (1, 2, 3))


def test_the_trainer_needs_the_transformer_until_every_samples_features_are_stored(target, tiny_model_dir,
                                                                                  prompt_file, tmp_path):
    from draftkit.distill.prepare import load_prepared, prepare, prepare_features
    from draftkit.target import TargetError, load_target
    from draftkit.train.data import feature_store
    from draftkit.train.loop import unstored_features

    recipe = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path,
                                                                "head.type=eagle3", "head.feature_layers=[1,2,3]",
                                                                "train.target_topk=8", "train.eval_every=0"))
    shell = load_target(str(tiny_model_dir), dtype="float32", transformer=False)
    assert unstored_features(recipe, shell, 10) == ("stage 1 (draftkit prepare) is not finished for this recipe", None)
    with pytest.raises(ShardError, match="loaded without its transformer, which cannot generate"):
        prepare(recipe, shell, ONE, 10)
    out = prepare(recipe, target, ONE, 10)
    why, found = unstored_features(recipe, shell, 10)
    assert why.startswith("features of 12 samples are not stored in ")
    assert found == load_prepared(out) and len(found.train) + len(found.holdout_samples) == 12
    store = feature_store(recipe, shell, (1, 2, 3))
    with pytest.raises(TargetError, match=r"offline features of 4 samples are missing .*prepare --features"):
        store.batch([{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}] * 4, pad_id=0)
    said = prepare_features(recipe, target, ONE, out, batch_size=4)
    assert "(target, top-8 log-probs): " + f"{3 * 32 * 4 + 8 * 6} bytes/token" in said
    why, found = unstored_features(recipe, shell, 10)
    assert why is None and found == load_prepared(out)  # the trainer reuses it instead of reading stage 1 again
    eagle = load_recipe(ROOT / "recipes" / "quick.yaml", small(tiny_model_dir, prompt_file, tmp_path,
                                                               "train.target_topk=8"))
    from draftkit.heads import HeadError

    with pytest.raises(HeadError, match="train.target_topk: 8 .* the eagle head reads that state as its input"):
        prepare_features(eagle, target, ONE, out)


@pytest.mark.integration
def test_training_on_stored_features_without_the_transformer_gives_the_full_targets_weights(tiny_model_dir,
                                                                                          prompt_file, tmp_path):
    from tests.test_train import head_weights, python_run

    args = recipe_args(tiny_model_dir, prompt_file, tmp_path / "unused", tmp_path / "cache", "data.num_prompts=10",
                       "head.type=eagle3", "head.feature_layers=[1,2,3]", "head.ttt_steps=2",
                       "train.target_topk=8", "train.feature_storage=float8", "train.max_steps=4", "train.epochs=2")
    prep = launch([sys.executable, "draftkit/distill/prepare.py", "recipes/quick.yaml", *args, "--features"])
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert "(float8, top-8 log-probs): " + f"{3 * 32 + 3 * 4 + 8 * 6} bytes/token" in prep.stdout
    shell = python_run([*args, f"output_dir={tmp_path / 'shell'}", "train.eval_every=0"])
    assert shell.returncode == 0, shell.stderr[-3000:]
    assert "loaded without its transformer (embeddings, final norm, lm_head; 0 of 4 decoder layers)" in shell.stderr
    # eval_every beyond max_steps: never evaluates, but asks for the full target
    full = python_run([*args, f"output_dir={tmp_path / 'full'}", "train.eval_every=100"])
    assert full.returncode == 0, full.stderr[-3000:]
    assert "full target loaded (4 decoder layers): train.eval_every runs the draft-verify loop" in full.stderr
    a, b = head_weights(tmp_path / "shell"), head_weights(tmp_path / "full")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [[json.loads(line) for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]
            for run in ("shell", "full")]
    assert [e["loss"] for e in logs[0]] == [e["loss"] for e in logs[1]] and len(logs[0]) == 2


def test_prepare_throughput_benchmark_measures_each_layout_from_its_files(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "bench.json"
    res = launch([sys.executable, "benchmarks/prepare_throughput.py", "--recipe", "recipes/quick.yaml",
                  f"target.path={tiny_model_dir}", "target.dtype=float32", "head.type=eagle3",
                  "head.feature_layers=[1,2,3]", "head.draft_vocab_size=64", "--num-samples", "4", "--topk", "4",
                  "--prompts", str(prompt_file), "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    results = {r["layout"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["bf16+final", "fp8+final", "bf16+top4", "fp8+top4"]
    want = {"bf16+final": 4 * 32 * 2 + 4, "fp8+final": 4 * 32 + 4 * 4 + 4, "bf16+top4": 3 * 32 * 2 + 4 * 6,
            "fp8+top4": 3 * 32 + 3 * 4 + 4 * 6}
    for name, r in results.items():
        assert r["bytes_per_token_layout"] == want[name] and r["files"] == 4
        assert 0 < r["bytes"] - want[name] * r["tokens"] < 600 * r["files"]  # + each file's header
        assert r["ratio"] == round(results["bf16+final"]["bytes_per_token"] / r["bytes_per_token"], 2)
    assert results["fp8+top4"]["bytes_per_token_4096"] == 3 * 4096 + 3 * 4 + 4 * 6
    assert results["bf16+final"]["bytes_per_token_4096"] == 32772 and 0 < results["fp8+top4"]["topk_mass"] <= 1
    assert "fp8+top4" in res.stdout and "B/tok H=4096" in res.stdout


def test_the_trainer_reports_its_draft_vocabularys_coverage_of_the_held_aside_responses(varied_model_dir, prompt_file,
                                                                                         tmp_path):
    """heldout_in_draft_vocab in every train_log record, draft_vocab in the data line and in the head's
    config.json (and prepared.json naming the prepared directory): heads/vocab.coverage of the exported
    head's vocabulary over the prepared held-aside responses. benchmarks/vocab_coverage.py chooses the
    same vocabulary from the prepared data as the trainer did: its figures equal those of the trained
    head's (--head), its held-aside figure the log's.
    The varied target and 16 draft ids: the held-aside share is neither 1 nor the training one."""
    from benchmarks.vocab_coverage import HELD, POOLED
    from benchmarks.vocab_coverage import main as vocab_coverage
    from draftkit.distill.prepare import finished, load_prepared
    from draftkit.heads import load_head
    from draftkit.heads.vocab import coverage, sample_counts
    from draftkit.target import load_target
    from tests.test_train import python_run

    args = small(varied_model_dir, prompt_file, tmp_path, "train.max_steps=2", "head.draft_vocab_size=16")
    res = python_run(args)
    assert res.returncode == 0, res.stderr[-3000:]
    target = load_target(str(varied_model_dir), dtype="float32")
    out = finished(load_recipe(ROOT / "recipes" / "quick.yaml", args), target, 10)
    data = load_prepared(out)
    # the run names the data it trained on (benchmarks/acceptance_gap.py --run reads it from any directory)
    assert json.loads((tmp_path / "run" / "prepared.json").read_text()) == {"directory": str(out.resolve())}
    head = load_head(tmp_path / "run" / "head", target)
    want = coverage(head.t2d, sample_counts(data.holdout_samples, target.vocab_size))
    assert want["tokens"] > 0 and 0 < want["inside_fraction"] < 1
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log and all(e["heldout_in_draft_vocab"] == want["inside_fraction"] for e in log)
    said = json.loads((tmp_path / "run" / "head" / "config.json").read_text())["draft_vocab_coverage"]
    assert said["heldout_inside"] == want["inside_fraction"] != said["train_inside"] and said["size"] == 16
    assert said["heldout_tokens"] == want["tokens"] and f'"draft_vocab": {json.dumps(said)}' in res.stderr
    common = [str(ROOT / "recipes" / "quick.yaml"), *args, "--prompts", str(prompt_file), "--max-new-tokens", "8"]
    assert vocab_coverage([*common, "--out", str(tmp_path / "chosen.json")]) == 0
    assert vocab_coverage([*common, "--head", str(tmp_path / "run" / "head"),
                           "--out", str(tmp_path / "head.json")]) == 0
    chosen, trained = (json.loads((tmp_path / f).read_text())["groups"] for f in ("chosen.json", "head.json"))
    assert chosen.pop(HELD)["inside_fraction"] == want["inside_fraction"]
    assert chosen == trained and trained[POOLED]["tokens"] > 0
