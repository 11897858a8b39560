"""`draftkit plan`: sizes and costs from configs of real architectures (fixtures), no weights loaded."""
import json
from pathlib import Path

import pytest

from draftkit.cli import main
from draftkit.config import load_recipe
from draftkit.plan import GiB, PlanSettings, make_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
LLAMA, QWEN, MISTRAL = (str(CONFIGS / n) for n in ("llama-3.1-8b", "qwen2.5-7b", "mistral-7b"))


def plan(recipe="eagle3-llama3-8b", *overrides, **settings):
    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", list(overrides))
    return make_plan(r, PlanSettings(**settings))


def problems(p, severity):
    return [q["message"] for q in p["problems"] if q["severity"] == severity]


@pytest.mark.parametrize("path, params, layers", [(LLAMA, 8_030_261_248, [2, 16, 29]),
                                                   (QWEN, 7_615_616_512, [2, 14, 25]),
                                                   (MISTRAL, 7_241_732_096, [2, 16, 29])])
def test_published_parameter_counts_from_config_alone(path, params, layers):
    p = plan("eagle3-llama3-8b", f"target.path={path}", "data.max_length=2048", world_size=8)
    assert p["target"]["params"] == params  # the model cards' counts: 8.03B, 7.62B, 7.24B
    assert p["head"]["feature_layers"] == layers


def test_eagle3_llama3_8b_recipe_plan():
    p = plan("eagle3-llama3-8b", f"target.path={LLAMA}", world_size=8)
    H, I, N = 4096, 14336, 32000
    # fc (3H -> H), the midlayer (q/k/v read 2H; 8 kv heads of 128), three norms, norm, lm_head (N x H)
    head = 3 * H * H + (2 * H * H + 2 * (2 * H * 1024) + H * H + 3 * H * I + 3 * H) + H + N * H
    assert p["head"]["params"] == head == 424_689_664
    assert p["target"]["rope"]["rope_type"] == "llama3" and p["target"]["rope"]["factor"] == 8.0
    par = p["parallel"]
    assert (par["global_batch"], par["zero_stage"], par["deepspeed_mixed_precision"]) == (64, 2, True)
    m = p["memory_per_rank"]
    assert m["target_weights"] == 8_030_261_248 * 2  # the bf16 replica on every rank
    # ZeRO-2, bf16: weights 2 B/param whole, grads 2 B and AdamW fp32 master + moments 12 B split 8 ways
    assert m["head"] == {"weights": 2 * head, "grads": 2 * head / 8, "optimizer": 12 * head / 8}
    assert m["training_peak"] < 80 * GiB
    assert p["data"]["prompts"] == 200_000 and p["schedule"]["max_steps"] == 6250
    assert p["schedule"]["epochs"] == pytest.approx(2.0)
    assert p["data"]["response_tokens_max"] == (200_000 + 64) * 1536
    assert p["data"]["generation_hours"] == pytest.approx((200_064 * 1536) / (2000 * 8) / 3600)
    assert problems(p, "error") == [] and problems(p, "warning") == []


def test_zero_stage_and_precision_change_the_split():
    fp32 = plan("eagle3-llama3-8b", f"target.path={LLAMA}", "deepspeed.bf16.enabled=false",
                "deepspeed.zero_optimization.stage=3", world_size=4)
    P = fp32["head"]["params"]
    assert fp32["memory_per_rank"]["head"] == {"weights": 4 * P / 4, "grads": 4 * P / 4, "optimizer": 8 * P / 4}
    single = plan("eagle3-llama3-8b", f"target.path={LLAMA}", "deepspeed.zero_optimization.stage=0", world_size=1)
    assert single["memory_per_rank"]["head"] == {"weights": 2 * P, "grads": 2 * P, "optimizer": 12 * P}
    assert single["parallel"]["global_batch"] == 8  # 1 rank x 2 x 4


def test_cpu_recipe_on_an_8b_target_is_flagged():
    p = plan("eagle", f"target.path={LLAMA}", world_size=8)
    assert any("train.lr=0.001" in w and "3e-5..1e-4" in w for w in problems(p, "warning"))
    # 2400 steps x 32 samples over 2500 prompts: 30.72 passes
    assert any("31 passes over 2500 samples (max_steps 2400 x global batch 32)" in w for w in problems(p, "warning"))
    assert any("serve EAGLE-1 over the full vocabulary only" in w for w in problems(p, "warning"))


def test_inconsistent_settings_are_errors():
    p = plan("eagle3-llama3-8b", f"target.path={QWEN}", "data.max_length=40000", world_size=8)
    assert any("data.max_length=40000 exceeds the target's context (max_position_embeddings=32768)" in e
               for e in problems(p, "error"))
    p = plan("eagle3-llama3-8b", f"target.path={MISTRAL}", world_size=8)  # V = 32000: fine
    assert problems(p, "error") == []
    p = plan("eagle3-llama3-8b", f"target.path={MISTRAL}", "head.draft_vocab_size=32001", world_size=8)
    assert any("head.draft_vocab_size: 32001 must be in 1..32000" in e for e in problems(p, "error"))
    p = plan("eagle3-llama3-8b", f"target.path={LLAMA}", "train.micro_batch_size=1", world_size=8)
    assert p["parallel"]["global_batch"] == 32
    p = plan("eagle3-llama3-8b", f"target.path={LLAMA}", "data.num_prompts=40", world_size=8)
    assert any("40 prompts are fewer than one global batch (64)" in e for e in problems(p, "error"))


def test_sliding_window_and_target_that_does_not_fit():
    p = plan("eagle3-llama3-8b", f"target.path={MISTRAL}", "data.max_length=8192", world_size=8)
    assert any("exceeds the target's sliding window (4096)" in w for w in problems(p, "warning"))
    assert p["target"]["sliding_window"] == 4096
    small = plan("eagle3-llama3-8b", f"target.path={LLAMA}", world_size=8, gpu_memory_gib=16)
    assert any("do not fit one 16 GiB GPU" in e and "does not shard it" in e for e in problems(small, "error"))
    tight = plan("eagle3-llama3-8b", f"target.path={LLAMA}", "train.micro_batch_size=64", world_size=8)
    assert any("training needs" in e for e in problems(tight, "error"))


def test_cli_prints_writes_json_and_exits_1_on_error(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", str(ROOT / "recipes/eagle3-llama3-8b.yaml"), f"target.path={LLAMA}", "--gpus", "8",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "424.69M params" in text and "problems: none found" in text
    assert json.loads(out.read_text())["head"]["params"] == 424_689_664
    rc = main(["plan", str(ROOT / "recipes/eagle3-llama3-8b.yaml"), f"target.path={LLAMA}", "--gpu-memory", "16"])
    assert rc == 1 and "error: target:" in capsys.readouterr().out
    rc = main(["plan", str(ROOT / "recipes/eagle3-llama3-8b.yaml"), f"target.path={tmp_path}"])
    assert rc == 2 and "no config.json" in capsys.readouterr().err


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


def _fake_target(config):
    from types import SimpleNamespace

    return SimpleNamespace(config=config, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                           info=lambda: {"name": "fake"})


def test_heads_keep_llama3_rope_scaling_in_either_transformers_spelling():
    """A transformers 4.x config spells RoPE as rope_theta + rope_scaling; a head built from it must
    still rotate as Llama-3.1 does (theta 500000, llama3 scaling), exactly like the 5.x spelling."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from draftkit.heads.base import DraftHead, HeadConfig

    raw = json.loads((Path(LLAMA) / "config.json").read_text())
    v4 = SimpleNamespace(**{k: v for k, v in raw.items() if k != "rope_scaling"},
                         rope_scaling={**raw["rope_scaling"], "type": "llama3"})
    del v4.rope_scaling["rope_type"]  # the oldest spelling: "type"
    old = HeadConfig()
    old.fill_from_target(_fake_target(v4))
    assert old.rope_parameters == LLAMA3_ROPE
    cfg5 = AutoConfig.from_pretrained(LLAMA)
    new = HeadConfig()
    new.fill_from_target(_fake_target(cfg5))
    assert new.rope_parameters == LLAMA3_ROPE
    head = DraftHead(new)
    want = LlamaRotaryEmbedding(cfg5).inv_freq
    assert torch.equal(head.rotary().inv_freq, want)


def test_a_transformers_that_ignores_rope_parameters_is_refused(monkeypatch):
    import transformers

    from draftkit.target import TargetError, check_rope_support

    class OldLlamaConfig(transformers.LlamaConfig):  # what 4.x does: no rope_parameters in the config
        def to_dict(self):
            return {k: v for k, v in super().to_dict().items() if k != "rope_parameters"}

    check_rope_support()
    monkeypatch.setattr(transformers, "LlamaConfig", OldLlamaConfig)
    with pytest.raises(TargetError, match="predates rope_parameters.*install transformers>=5"):
        check_rope_support()
