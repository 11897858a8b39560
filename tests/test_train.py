"""The training spine: recipes, data order, feature cache, DeepSpeed runs, kill-and-resume, export.

Runs a tiny random llama saved as a model directory with the fixture tokenizer; the launcher tests
start real `deepspeed` / `python` processes on CPU with gloo.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftkit.config import load_recipe
from draftkit.schema import ConfigError
from draftkit.train.data import FeatureStore, SampleOrder
from draftkit.train.deepspeed_config import build_deepspeed_config, head_autocast, lr_lambda
from tests.conftest import make_tiny_target

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
VENV_BIN = Path(sys.executable).parent


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny target directory and a prompt file
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    out = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    path.write_text("".join(json.dumps({"prompt": f"tell me about {w} and {v}"}) + "\n"
                            for w in words for v in words[:3]))
    return path


def recipe_args(model_dir: Path, prompts: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return [f"target.path={model_dir}", "target.dtype=float32", f"data.sources=[{{path: {prompts}}}]",
            f"data.cache_dir={cache}", f"output_dir={out}", "data.holdout=2", "data.max_length=64",
            "data.responses.max_new_tokens=12", "data.responses.batch_size=8", "train.micro_batch_size=2",
            "train.log_every=2", "train.warmup_steps=2", "train.lr=0.003", "logging.wandb_project=null",
            "head.type=eagle", "head.draft_vocab_size=64", *extra]  # quick.yaml's 8192 > this vocab (384)


def launch(cmd: list[str], timeout: int = 300, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), **(env_extra or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def python_run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return launch([sys.executable, "draftkit/train/run.py", "recipes/quick.yaml", *args], **kw)


def head_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "head" / "model.safetensors")


# ---------------------------------------------------------------------------------------------
# recipes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_loads_and_has_the_common_keys(recipe):
    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", ["train.max_steps=20", "output_dir=runs/try"])
    assert r.train.max_steps == 20 and r.output_dir == "runs/try"
    assert r.head["type"] == ("eagle" if recipe == "quick" else recipe.split("-")[0])  # family-first names
    if r.data.responses.mode == "keep":  # kept replies are not the target's text: nothing to ground tasks on
        assert r.data.grounded.fraction == 0 and r.data.sources


def test_recipe_typo_names_dotted_path_and_allowed_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'train.max_stepz'; allowed: .*max_steps"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match=r"train.lr: expected a number, got 'fast'"):
        load_recipe(None, ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"data.overlong: 'cut' is not one of"):
        load_recipe(None, ["data.overlong=cut"])
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_deepspeed_section_is_deepspeeds_own_schema(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2,
                              "train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.5}))
    r = load_recipe(None, [f"deepspeed={ds}"])
    cfg = build_deepspeed_config(r, world_size=2, on_cuda=False)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["train_batch_size"] == 12
    assert cfg["gradient_clipping"] == 0.5  # the user's value wins over train.grad_clip
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    r = load_recipe(None, ["deepspeed={train_batch_size: 7}"])
    with pytest.raises(ConfigError, match="train_batch_size=7"):
        build_deepspeed_config(r, world_size=1, on_cuda=False)
    r = load_recipe(None, ["deepspeed={bf16: {enabled: true}}"])
    with pytest.raises(ConfigError, match="deepspeed.bf16.enabled: needs a GPU; on CPU set train.autocast"):
        build_deepspeed_config(r, world_size=1, on_cuda=False)


def test_autocast_setting_resolves_per_device(monkeypatch):
    cpu = torch.device("cpu")
    for value, want in (("float32", None), ("bfloat16", torch.bfloat16)):
        assert head_autocast(load_recipe(None, [f"train.autocast={value}"]).train, cpu) is want
    auto = load_recipe(None, ["train.autocast=auto"]).train
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False)
    assert head_autocast(auto, cpu) is None  # no native bf16: fp32 (emulated bf16 is slower)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert head_autocast(auto, cpu) is torch.bfloat16
    with pytest.raises(ConfigError, match="train.autocast"):
        load_recipe(None, ["train.autocast=fp8"])


def test_autocast_runs_head_matmuls_in_bf16_and_keeps_fp32_weights_and_grads():
    from draftkit.heads import build_head
    from draftkit.train.loop import TrainWrapper

    target = make_tiny_target()
    torch.manual_seed(0)
    head = build_head({"type": "eagle3", "ttt_steps": 2}, target)
    ids = torch.randint(3, target.vocab_size, (2, 12))
    feats = target.features(ids, None, head.feature_layers)
    seen = []
    head.fc.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    plain = TrainWrapper(head)(feats)
    plain["loss"].backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()
    mixed = TrainWrapper(head, torch.bfloat16)(feats)
    mixed["loss"].backward()
    assert seen == [torch.float32, torch.bfloat16]
    assert mixed["loss"].dtype == torch.float32 and mixed["loss"] != plain["loss"]  # bf16 really ran
    torch.testing.assert_close(mixed["loss"], plain["loss"], rtol=0.05, atol=0.05)
    for name, p in head.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), grads[name].flatten(), dim=0)
        assert cos > 0.95, (name, float(cos))


def test_warmup_then_cosine_to_min_ratio():
    t = load_recipe(None, ["train.max_steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.1"]).train
    f = lr_lambda(t)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)
    t.schedule = "linear"
    assert lr_lambda(t)(55) == pytest.approx(0.55) and lr_lambda(t)(100) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# data order and feature cache
# ---------------------------------------------------------------------------------------------
def test_sample_order_shards_are_disjoint_and_cover_each_epoch():
    order = SampleOrder(24, seed=3)
    seen = []
    for step in range(3):  # 3 steps x 2 micro x 2 ranks x 2 samples = 24 = one epoch
        for micro in range(2):
            per_rank = [order.indices(step, micro, 2, 2, 2, rank) for rank in range(2)]
            assert not set(per_rank[0]) & set(per_rank[1])
            seen += per_rank[0] + per_rank[1]
    assert sorted(seen) == list(range(24))
    assert SampleOrder(24, seed=3).indices(5, 1, 2, 2, 2, 1) == order.indices(5, 1, 2, 2, 2, 1)
    assert order.indices(3, 0, 2, 2, 2, 0) != order.indices(0, 0, 2, 2, 2, 0)  # new epoch, new permutation


def test_feature_store_computes_each_sample_once(tmp_path):
    target = make_tiny_target()
    samples = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [0] * 2 + [1] * (n - 2)} for n in (5, 8, 6)]
    store = FeatureStore(target, (1, -1), tmp_path)
    first = store.batch(samples, pad_id=0)
    again = FeatureStore(target, (1, -1), tmp_path).batch(samples[::-1], pad_id=0)
    assert store.computed == 3
    torch.testing.assert_close(again.hidden[2, :5], first.hidden[0, :5], rtol=0, atol=0)
    direct = target.features(first.input_ids[1:2], None, (1, -1))
    torch.testing.assert_close(first.hidden[1], direct.hidden[0], rtol=1e-5, atol=1e-6)
    assert first.hidden.shape == (3, 8, 2 * target.hidden_size)
    assert torch.equal(first.loss_mask[0], torch.tensor([0, 0, 1, 1, 1, 0, 0, 0]))


# ---------------------------------------------------------------------------------------------
# real runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_kill_and_resume_equals_uninterrupted_run(tiny_model_dir, prompt_file, tmp_path):
    """Every step draws random numbers (head.feature_noise: U(-a, a) on the head's inputs), so the
    resumed weights equal the uninterrupted run's only if the RNG states come back. Killed twice:
    after step 3 (between checkpoints), then while saving step 6 (its directory half written):
    the run resumes from step 4, the last complete checkpoint."""
    cache = tmp_path / "cache"
    common = ["train.max_steps=8", "train.save_every=2", "train.epochs=2", "head.feature_noise=0.2"]
    run = lambda out, env=None: python_run(recipe_args(tiny_model_dir, prompt_file, tmp_path / out, cache, *common),
                                           env_extra=env)  # noqa: E731
    full = run("full")
    assert full.returncode == 0, full.stderr[-3000:]
    killed = run("res", {"DRAFTKIT_FAULT_KILL_AFTER_STEP": "3"})
    assert killed.returncode == -9  # SIGKILL, mid-run, after the step-2 checkpoint
    ckpt = tmp_path / "res" / "checkpoints"
    assert (ckpt / "LATEST").read_text() == "step2" and not (tmp_path / "res" / "head").exists()
    in_save = run("res", {"DRAFTKIT_FAULT_KILL_DURING_SAVE": "6"})
    assert in_save.returncode == -9 and "at step 2" in in_save.stderr
    assert (ckpt / "step6").is_dir() and (ckpt / "LATEST").read_text() == "step4"  # step6 half written
    resumed = run("res")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr
    a, b = head_weights(tmp_path / "full"), head_weights(tmp_path / "res")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    # ... and training did change the weights (the comparison is not between two fresh heads)
    fresh = python_run(recipe_args(tiny_model_dir, prompt_file, tmp_path / "short", cache,
                                   "train.max_steps=1", "train.epochs=2"))
    assert fresh.returncode == 0
    assert not torch.equal(head_weights(tmp_path / "short")["fc.weight"], a["fc.weight"])


@pytest.mark.integration
def test_on_policy_warm_start_switches_at_its_step_and_resumes_exactly(tiny_model_dir, prompt_file, tmp_path):
    """EAGLE-3 with head.on_policy_from = 3: the trainer tells the head the steps done, so steps 1-3
    train with decay and 4 on on-policy (its walk metric `roots` logged from there); killed after step
    3 and resumed from the step-2 checkpoint, the switch falls on the same step and the weights equal
    the uninterrupted run's."""
    cache = tmp_path / "cache"
    common = ["train.max_steps=6", "train.save_every=2", "train.epochs=2", "train.log_every=1",
              "head.type=eagle3", "head.ttt_steps=2", "head.feature_layers=[1, 2, 3]",
              "head.loss_weighting=on_policy", "head.on_policy_from=3"]
    run = lambda out, env=None: python_run(recipe_args(tiny_model_dir, prompt_file, tmp_path / out, cache, *common),
                                           env_extra=env)  # noqa: E731
    full = run("full")
    assert full.returncode == 0, full.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log if "roots" in row] == [4, 5, 6]
    assert [row["step"] for row in log if "roots" not in row] == [1, 2, 3]
    killed = run("res", {"DRAFTKIT_FAULT_KILL_AFTER_STEP": "3"})
    assert killed.returncode == -9
    resumed = run("res")
    assert resumed.returncode == 0 and "at step 2" in resumed.stderr, resumed.stderr[-3000:]
    a, b = head_weights(tmp_path / "full"), head_weights(tmp_path / "res")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)


def test_resume_without_the_rng_state_is_refused_naming_the_file(tmp_path):
    from draftkit.train.checkpoint import ResumeError, load

    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "draftkit_state.json").write_text(json.dumps({"step": 4, "recipe_hash": "h"}))
    with pytest.raises(ResumeError, match=r"step4/rng_rank1.pt: missing; .* lacks rank 1's RNG state"):
        load(None, tmp_path, "step4", rank=1, recipe_hash="h")  # refused before DeepSpeed reads a tensor


@pytest.mark.integration
def test_resume_from_another_recipe_is_refused(tiny_model_dir, prompt_file, tmp_path):
    args = recipe_args(tiny_model_dir, prompt_file, tmp_path / "run", tmp_path / "cache", "train.max_steps=2")
    assert python_run(args).returncode == 0
    other = python_run(args + ["head.num_layers=2", "train.max_steps=3"])
    assert other.returncode != 0 and "written by another recipe" in other.stderr


@pytest.mark.integration
def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tiny_model_dir, prompt_file, tmp_path):
    args = recipe_args(tiny_model_dir, prompt_file, tmp_path / "run", tmp_path / "cache",
                       "train.max_steps=3", "train.save_every=1", "train.warmup_steps=0", "train.grad_clip=0",
                       "train.schedule=constant", "train.lr=1.0e+30")
    res = python_run(args)
    assert res.returncode != 0
    assert "loss is nan (non-finite)" in res.stderr or "loss is inf (non-finite)" in res.stderr
    step = int(res.stderr.split("NonFiniteLoss: step ")[1].split(":")[0])
    latest = (tmp_path / "run" / "checkpoints" / "LATEST").read_text()
    assert latest == f"step{step - 1}"  # the last good one; the bad step wrote nothing


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_launcher_two_processes(tiny_model_dir, prompt_file, tmp_path, stage):
    args = recipe_args(tiny_model_dir, prompt_file, tmp_path / "run", tmp_path / "cache", "train.max_steps=3",
                       "train.log_every=3", "train.eval_every=3", "train.eval_k=2", "train.eval_max_new_tokens=8",
                       f"deepspeed={{zero_optimization: {{stage: {stage}}}}}", "train.autocast=bfloat16")
    res = launch([str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(29500 + stage),
                  "draftkit/train/run.py", "recipes/quick.yaml", *args], timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    from draftkit.heads import load_head
    from draftkit.target import load_target

    target = load_target(str(tiny_model_dir), dtype="float32")
    head = load_head(tmp_path / "run" / "head", target)
    weights = head_weights(tmp_path / "run")
    assert weights["fc.weight"].shape == (32, 64) and weights["fc.weight"].abs().sum() > 0
    cfg = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert cfg["target"]["fingerprint"] == target.fingerprint and cfg["head_autocast"] == "bfloat16"
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 3 and "heldout_acc" in log[-1]
    assert 1.0 <= log[-1]["tau"] <= 3.0 and len([k for k in log[-1] if k.startswith("alpha_")]) == 2
    assert head.feature_layers == (-1,)


@pytest.mark.integration
def test_embedded_target_trains_and_export_reloads(tmp_path):
    """The default path: embedded SmolLM2, prompts synthesized by the target, export reloads exactly."""
    out = tmp_path / "run"
    res = python_run([f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
                      "data.num_prompts=2", "data.holdout=1", "data.responses.max_new_tokens=16",
                      "data.synthesize.max_new_tokens=48", "data.synthesize.batch_size=4",
                      "train.micro_batch_size=2", "train.log_every=1", "logging.wandb_project=null"], timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    from draftkit.heads import load_head
    from draftkit.target import FINAL, load_target

    target = load_target(None, dtype="bfloat16")
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
    head = load_head(out / "head", target)
    saved = head_weights(out)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, saved[name])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["family"] == "eagle" and cfg["feature_layers"] == [FINAL]
    assert cfg["target"]["name"] == "SmolLM2-135M-Instruct" and cfg["target"]["fingerprint"] == target.fingerprint
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log] == [1, 2] and all(0 <= e["acc"] <= 1 for e in log)


def test_head_load_bad_input_is_named(tmp_path):
    from draftkit.heads import HeadError, build_head, load_head

    target = make_tiny_target()
    head = build_head({"type": "eagle"}, target)
    head.save_pretrained(tmp_path / "head")
    data = (tmp_path / "head" / "model.safetensors").read_bytes()
    (tmp_path / "head" / "model.safetensors").write_bytes(data[: len(data) // 2])  # a torn write
    with pytest.raises(HeadError, match=r"model.safetensors: cannot read safetensors"):
        load_head(tmp_path / "head", target)
    head.save_pretrained(tmp_path / "head")  # replaces the broken copy atomically
    other = make_tiny_target(hidden=48, heads=4, kv_heads=2)
    with pytest.raises(HeadError, match=r"hidden_size=32 does not fit target .*hidden_size=48"):
        load_head(tmp_path / "head", other)
    with pytest.raises(HeadError, match="trained against target fingerprint"):
        load_head(tmp_path / "head", make_tiny_target(seed=9))
    with pytest.raises(HeadError, match="holds a 'eagle' head, not 'medusa'"):
        load_head(tmp_path / "head", target, expected_family="medusa")
    assert not list(tmp_path.glob(".head*"))  # no temp directories left behind


@pytest.mark.integration
def test_torchrun_two_processes(tiny_model_dir, prompt_file, tmp_path):
    args = recipe_args(tiny_model_dir, prompt_file, tmp_path / "run", tmp_path / "cache", "train.max_steps=2",
                       "deepspeed={zero_optimization: {stage: 1}}")
    res = launch([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29533",
                  "draftkit/train/run.py", "recipes/quick.yaml", *args], timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text() == "step2"


def test_cached_top1_gives_the_same_loss_as_full_logits(tmp_path):
    """Draft-vocabulary losses read the target's top-1 from the feature cache instead of a full lm_head."""
    from draftkit.heads import build_head

    target = make_tiny_target()
    samples = [{"input_ids": [3 + (7 * i + j) % 90 for j in range(12)], "loss_mask": [0] * 4 + [1] * 8}
               for i in range(3)]
    cached = FeatureStore(target, (-1,), tmp_path).batch(samples, pad_id=0)
    online = FeatureStore(target, (-1,), None).batch(samples, pad_id=0)
    assert online.top1 is None
    full = target.logits(cached.final_hidden).argmax(-1)
    assert torch.equal(cached.top1[cached.attention_mask.bool()], full[cached.attention_mask.bool()])
    for settings in ({"type": "eagle", "draft_vocab_size": 40},
                     {"type": "eagle3", "draft_vocab_size": 40, "feature_layers": [1, 2, 3], "ttt_steps": 2}):
        head = build_head(settings, target)
        head.set_draft_vocab(tokens=[t for s in samples for t in s["input_ids"]])
        f = FeatureStore(target, head.feature_layers, tmp_path).batch(samples, pad_id=0)
        with_top1, without = head.loss(f), head.loss(dataclasses.replace(f, top1=None))
        for key in ("loss", "acc"):
            torch.testing.assert_close(with_top1[key], without[key], rtol=1e-6, atol=1e-6, msg=key)


def test_target_loads_straight_onto_the_rank_device_in_the_recipe_dtype(tiny_model_dir, monkeypatch):
    """On a GPU rank the weights go from the files to that device (device_map), never through a
    full host copy that is then moved; on CPU nothing changes."""
    from transformers import AutoModelForCausalLM

    from draftkit import target as target_mod

    real = AutoModelForCausalLM.from_pretrained.__func__
    seen = []

    def spy(cls, src, **kwargs):
        seen.append(dict(kwargs))
        kwargs.pop("device_map", None)  # no GPU here: load on the host, but never `.to` it afterwards
        model = real(cls, src, **kwargs)
        model.to = lambda *a, **k: pytest.fail(f"model.to{a} after loading: a host copy was moved")
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    monkeypatch.setattr(target_mod, "use_gqa_attention", lambda model: False)
    t = target_mod.load_target(str(tiny_model_dir), dtype="bfloat16", device="cuda:3")
    assert seen[-1]["device_map"] == {"": "cuda:3"} and seen[-1]["dtype"] == torch.bfloat16
    assert t.dtype == torch.bfloat16


def test_speculative_eval_runs_on_rank_0_only(monkeypatch):
    """The in-training draft-verify evaluation runs once (rank 0), not once per rank."""
    from types import SimpleNamespace

    import importlib

    ev = importlib.import_module("draftkit.inference.evaluate")
    from draftkit.train import loop

    calls = []
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: calls.append(a) or
                        {"tau": 1.5, "acceptance_per_position": [0.5, 0.25]})
    monkeypatch.setattr(loop, "barrier", lambda: None)
    head = torch.nn.Linear(2, 2)
    for rank, want in ((1, {}), (0, {"tau": 1.5, "alpha_1": 0.5, "alpha_2": 0.25})):
        me = SimpleNamespace(recipe=SimpleNamespace(train=SimpleNamespace(eval_k=2, eval_max_new_tokens=8)),
                             data=SimpleNamespace(holdout_prompts=["p"]), head=head, target=None,
                             ds_config={"zero_optimization": {"stage": 2}}, main=rank == 0,
                             dist=SimpleNamespace(rank=rank, world_size=2))
        me.eval_head = lambda me=me: loop.Trainer.eval_head(me)
        assert loop.Trainer.speculative_eval(me) == want
        assert len(calls) == (0 if rank == 1 else 1)


@pytest.mark.parametrize("chunks, world", [(5, 2), (1, 4), (8, 8), (7, 3)])
def test_heldout_agreement_is_sharded_once_with_equal_forwards(chunks, world):
    from draftkit.train.loop import holdout_shard

    plans = [holdout_shard(chunks, world, r) for r in range(world)]
    assert len({len(p) for p in plans}) == 1  # same number of forwards on every rank (ZeRO-3)
    counted = sorted(i for p in plans for i, w in p if w == 1.0)
    assert counted == list(range(chunks))  # each held-out micro-batch counted exactly once
    assert all(w == 0.0 for p in plans for i, w in p if (i, w) not in [(j, 1.0) for j in range(chunks)])


def test_a_child_of_a_process_that_made_its_own_group_does_not_inherit_its_bound_port():
    """init_distributed from plain `python` binds a port it picked; a `python run.py` started from that
    process (a notebook, a test) used to inherit MASTER_PORT and die with EADDRINUSE (CI, Gemma test)."""
    child = "from draftkit.train.distributed import init_distributed; print('child rank', init_distributed().rank)"
    parent = ("import os, subprocess, sys\n"
              "from draftkit.train.distributed import init_distributed\n"
              "init_distributed()\n"
              f"r = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True)\n"
              "print(r.stdout, r.stderr[-1500:]); sys.exit(r.returncode)\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    r = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "child rank 0" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_init_distributed_gives_deepspeed_an_arch_list_its_jit_builder_parses():
    """NVIDIA's Hopper images set TORCH_CUDA_ARCH_LIST=9.0a; DeepSpeed 0.19's JIT builder parses each entry
    as int.int, so fused Adam's build died with int('0a') on the H200 (benchmarks/results/gpu_check/). After
    init_distributed the list is one DeepSpeed's own FusedAdamBuilder parses, with +PTX and every arch kept;
    the raw list is shown to fail the same parser, so the check has something to catch."""
    script = ("import os\n"
              "from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # CUDA's, whatever the accelerator\n"
              "def parse():\n"
              "    b = FusedAdamBuilder(); b.jit_mode = True; b._jit_arch_list = None\n"
              "    return b.compute_capability_args()\n"
              "try:\n"
              "    parse(); print('raw parsed')\n"
              "except ValueError as e:\n"
              "    print('raw failed:', e)\n"
              "from draftkit.train.distributed import init_distributed\n"
              "init_distributed()\n"
              "print('list', os.environ['TORCH_CUDA_ARCH_LIST'])\n"
              "parse(); print('mended parsed')\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "TORCH_CUDA_ARCH_LIST": "8.0 9.0a;10.0a+PTX"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr[-2000:]
    assert "raw failed: invalid literal for int()" in r.stdout, out
    assert "list 8.0 9.0;10.0+PTX" in r.stdout and "mended parsed" in r.stdout and r.returncode == 0, out
