"""train.engine_eval_every: the head as trained so far, served by vLLM during training, logged beside the loss.

A tiny llama vLLM runs (tests/conftest.py: save_vllm_target) with the fixture tokenizer is trained for
60 steps with the engine's evaluation every 30; the figures logged at steps 30 and 60 must EQUAL draftkit's
loop under vLLM's rule (fp32, T = 0, as tests/test_engine_vllm.py shows they do) run on the head of that
very step (read back from the step's checkpoint) on the held-aside prompts, and the two steps' heads must
accept differently there, so that a hook serving a stale export or another step's head logs other counts.
A head one optimizer step early accepts the same, so each record also carries the digest of the weights
vLLM was handed (engine_head_digest), which must equal the digest of that step's checkpoint, exported.
For that the head must learn what carries over to prompts it never saw: on the random target as saved it
does not (fitted to 0.73 training accuracy, it accepted nothing on the held-aside prompts), so the target's
attention writes nothing into the residual stream (o_proj zeroed): its next token is a function of the
current token alone (its MLPs), every prompt's continuation the same walk from the chat template's last
token, which the head learns over the steps from the training prompts' continuations.
Missing vLLM stops the run before any data is prepared, with one line and no traceback.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from draftkit.engines import vllm as ev
from draftkit.engines.vllm_eval import EngineEvalSettings, run_loop, run_name, served_head
from draftkit.engines.vllm_train_eval import export_now, prompt_ids, weights_digest
from tests.conftest import save_vllm_target, vllm_python
from tests.test_train import FIXTURES, prompt_file, python_run, recipe_args  # noqa: F401 (prompt_file: a fixture)

K, N_NEW, EVERY, STEPS = 3, 16, 30, 60
ENGINE_ARGS = [f"train.max_steps={STEPS}", f"train.engine_eval_every={EVERY}", f"train.save_every={EVERY}",
               "train.keep_checkpoints=2", f"train.eval_k={K}", f"train.eval_max_new_tokens={N_NEW}",
               "train.log_every=100", "train.epochs=4", "data.holdout=4", "data.responses.engine=hf"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    out = tmp_path_factory.mktemp("vllm-target") / "target"
    target = save_vllm_target(out, vocab_size=len(tok), tokenizer=tok, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    with torch.no_grad():  # the module doc: no attention, so every prompt's continuation is the same walk
        for layer in target.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target.model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trained(target_dir, prompt_file, tmp_path_factory):
    """One training run with the engine's evaluation on: (run dir, cache dir, log records)."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("engine-train")
    run, cache = root / "run", root / "cache"
    res = python_run(recipe_args(target_dir, prompt_file, run, cache, *ENGINE_ARGS), timeout=900,
                     env_extra={ev.PYTHON_ENV: python})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return run, cache, records


def head_at(run: Path, step: int, target):
    """The head as it was after `step` optimizer steps: the step's DeepSpeed checkpoint (stage 0:
    mp_rank_00_model_states.pt, the TrainWrapper's state), in a head built from the run's config."""
    from draftkit.heads import load_head

    head = load_head(run / "head", target)
    module = torch.load(run / "checkpoints" / f"step{step}" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)["module"]
    head.load_state_dict({k.removeprefix("head."): v for k, v in module.items()})
    return head.eval()


def loop_under_engine_rule(head, target, prompts: list[list[int]], work: Path) -> tuple[dict, str]:
    """Our chain of K on the head vLLM serves (exported as the hook exports, imported back), T = 0, batch 1;
    and the digest of that export's weights (vllm_train_eval.weights_digest, as the hook logs it)."""
    from draftkit.inference.decoder import stop_token_ids

    export, _ = export_now(head, target, work)
    s = EngineEvalSettings(k=K, max_new_tokens=N_NEW, batch_sizes=(1,))
    res = run_loop(target, served_head(export, target, work), prompts, s, K, stop_token_ids(target))
    return ev.loop_figures(res[run_name(0.0, 1)]["stats"]), weights_digest(export)


@pytest.mark.integration
def test_logged_engine_figures_are_that_steps_head_served(trained, target_dir, tmp_path):
    from draftkit.distill.prepare import load_prepared
    from draftkit.target import load_target

    run, cache, records = trained
    logged = {r["step"]: r for r in records if "engine_tau" in r}
    assert sorted(logged) == [EVERY, 2 * EVERY] and not any("engine_error" in r for r in records), records
    assert not list(run.glob(".engine-eval-*")), "temporary exports left in the run directory"
    target = load_target(str(target_dir), dtype="float32")
    holdout = load_prepared(next(cache.rglob("manifest.json")).parent).holdout_prompts
    prompts = prompt_ids(target, holdout, K, N_NEW)
    assert len(prompts) == 4
    ours = {}
    for step, rec in logged.items():
        f, digest = loop_under_engine_rule(head_at(run, step, target), target, prompts, tmp_path / str(step))
        ours[step] = f
        # the weights vLLM was handed are that step's checkpoint, bit for bit: a head served one optimizer
        # step early (or late) accepts the same on these prompts, but its digest differs
        assert rec["engine_head_digest"] == digest, (step, rec["engine_head_digest"], digest)
        got = {"drafts": rec["engine_drafts"], "accepted_per_pos": [rec[f"engine_accepted_{i + 1}"] for i in range(K)]}
        assert got == {"drafts": f["drafts"], "accepted_per_pos": f["accepted_per_pos"]}, (step, rec, f)
        assert rec["engine_tau"] == pytest.approx(f["tau"], abs=1e-9)
        for i, a in enumerate(f["alpha"]):
            assert rec[f"engine_alpha_{i + 1}"] == pytest.approx(a or 0.0, abs=1e-9)
        assert rec["loss"] > 0 and rec["engine_tokens_per_s"] > 0  # beside the loss, in the same record
    # the head learned between the two steps, so a stale export or another step's head logs other counts
    assert ours[EVERY]["accepted_per_pos"] != ours[2 * EVERY]["accepted_per_pos"], ours
    assert sum(ours[2 * EVERY]["accepted_per_pos"]) > sum(ours[EVERY]["accepted_per_pos"]), ours


def test_missing_vllm_stops_before_any_data_with_one_line(target_dir, prompt_file, tmp_path):
    """DRAFTKIT_VLLM_PYTHON names a Python without vLLM: the run stops before stage 1, one line, no traceback."""
    cache = tmp_path / "cache"
    res = python_run(recipe_args(target_dir, prompt_file, tmp_path / "run", cache, *ENGINE_ARGS), timeout=300,
                     env_extra={ev.PYTHON_ENV: sys.executable})
    assert res.returncode == 1, res.stderr[-3000:]
    err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "train.engine_eval_every=30: vLLM not found" in err[0] and "setup_vllm.sh" in err[0], err
    assert not list(cache.rglob("manifest.json")) and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("setting, head, match", [
    ("data.holdout=0", {"type": "eagle"}, r"train.engine_eval_every=2 serves the head on the held-aside prompts.*"
                                           r"data.holdout is 0"),
    ("data.holdout=2", {"type": "mtp"}, r"train.engine_eval_every=2: format 'vllm' cannot carry a 'mtp' head"),
])
def test_what_vllm_cannot_serve_is_refused_before_training(setting, head, match, tmp_path):
    from draftkit.config import load_recipe
    from draftkit.engines.vllm_train_eval import preflight
    from draftkit.heads import build_head
    from draftkit.schema import ConfigError
    from tests.conftest import make_tiny_target

    target = make_tiny_target()
    recipe = load_recipe(None, ["train.engine_eval_every=2", setting])
    with pytest.raises(ConfigError, match=match):
        preflight(recipe, target, build_head(head, target), tmp_path / "run")
    assert not list((tmp_path / "run").glob(".engine-eval-*"))  # the trial export is removed


def test_engine_eval_serves_on_rank_0_and_the_others_wait(monkeypatch):
    """Rank 0 exports and serves once; every rank (rank 0 after serving) waits at the barrier."""
    from types import SimpleNamespace

    from draftkit.train import loop

    calls = []
    monkeypatch.setattr(loop, "barrier", lambda: calls.append("barrier"))
    engine = SimpleNamespace(measure=lambda head, prompts, step: calls.append(("measure", head, prompts, step))
                             or {"engine_tau": 1.5})
    head = torch.nn.Linear(2, 2)
    for rank, want in ((1, {}), (0, {"engine_tau": 1.5})):
        me = SimpleNamespace(engine_eval=engine, main=rank == 0, head=head, data=SimpleNamespace(holdout_prompts=["p"]),
                             ds_config={"zero_optimization": {"stage": 2}})
        me.eval_head = lambda me=me: loop.Trainer.eval_head(me)
        assert loop.Trainer.engine_eval_step(me, 3) == want
    assert calls == ["barrier", ("measure", head, ["p"], 3), "barrier"]


@pytest.mark.parametrize("head, names", [
    ({"type": "eagle"}, "the target tiny-llama-0 nor the eagle head"),  # its attention has the target's sizes
    ({"type": "medusa", "num_heads": 2}, "the target tiny-llama-0: head_dim 8"),  # Medusa's heads: no attention
])
def test_a_head_size_vllm_cpu_cannot_run_is_refused_before_vllm_is_looked_for(head, names, tmp_path, monkeypatch):
    """head_dim 8 (make_tiny_target) is not a size vLLM's CPU attention runs (vllm_data.CPU_HEAD_SIZES):
    refused at preflight, one line naming head_dim and the sizes expected, before vLLM is looked for
    (so before stage 1); with a CUDA device visible the rule is not applied (vLLM's GPU backends)."""
    from draftkit.config import load_recipe
    from draftkit.engines import vllm_train_eval
    from draftkit.heads import build_head
    from draftkit.schema import ConfigError
    from tests.conftest import make_tiny_target

    looked = []
    monkeypatch.setattr(vllm_train_eval, "find_python", lambda *a: looked.append(a) or ev.find_python(sys.executable))
    target = make_tiny_target()
    recipe = load_recipe(None, ["train.engine_eval_every=2", "data.holdout=2"])
    with pytest.raises(ConfigError) as e:
        vllm_train_eval.preflight(recipe, target, build_head(head, target), tmp_path / "run")
    msg = str(e.value)
    assert msg.startswith(f"train.engine_eval_every=2: vLLM's CPU build cannot serve {names}"), msg
    assert "head_dim 8 not in vLLM CPU's supported sizes (32, 64, 80," in msg and "\n" not in msg, msg
    assert "train.engine_eval_every=0" in msg and looked == [], (msg, looked)
    assert not list((tmp_path / "run").glob(".engine-eval-*"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA build: its backends, not this rule
    with pytest.raises(ConfigError, match=r"train.engine_eval_every=2: vLLM not found"):
        vllm_train_eval.preflight(recipe, target, build_head(head, target), tmp_path / "run")
    assert len(looked) == 1
