"""`draftkit plan`: sizes and costs from configs of real architectures (fixtures), no weights loaded."""
import json
from pathlib import Path

import pytest

from draftkit.cli import main
from draftkit.config import load_recipe
from draftkit.plan import GiB, PlanSettings, make_plan

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
LLAMA, QWEN, MISTRAL, LLAMA70 = (str(CONFIGS / n) for n in ("llama-3.1-8b", "qwen2.5-7b", "mistral-7b",
                                                             "llama-3.1-70b"))


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
    p = plan("eagle3-llama3-8b", f"target.path={LLAMA}", world_size=8, gen_tokens_per_s=2000)
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
               "--gen-tok-s", "2000", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "424.69M params" in text and "problems: none found" in text
    assert json.loads(out.read_text())["head"]["params"] == 424_689_664
    rc = main(["plan", str(ROOT / "recipes/eagle3-llama3-8b.yaml"), f"target.path={LLAMA}", "--gpu-memory", "16"])
    assert rc == 1 and "error: target:" in capsys.readouterr().out
    rc = main(["plan", str(ROOT / "recipes/eagle3-llama3-8b.yaml"), f"target.path={tmp_path}"])
    assert rc == 2 and "no config.json" in capsys.readouterr().err


def throughput_file(path: Path, model: str) -> Path:
    """A benchmarks/generation_throughput.py result: vLLM bf16 at two batch sizes, fp32, and refill."""
    rows = [("vllm", "bf16", 32, 500.0), ("vllm", "bf16", 64, 800.0), ("vllm", "fp32", 64, 300.0),
            ("refill", "bf16", 64, 100.0)]
    path.write_text(json.dumps({"meta": {"model": model, "device": "cuda", "threads": 1},
                                "results": [{"scheduler": sc, "dtype": dt, "batch_size": b, "tok_per_s": r}
                                            for sc, dt, b, r in rows]}))
    return path


def test_plan_takes_the_measured_rate_and_says_where_from(tmp_path, capsys):
    """The fastest row of the recipe's engine and dtype; the repo's own measurement by default (with a
    warning that it is another model's), a number as given; the hours follow from it."""
    tokens = (200_000 + 64) * 1536
    f = throughput_file(tmp_path / "gen.json", "llama-3.1-8b")
    p = plan("eagle3-llama3-8b", f"target.path={LLAMA}", world_size=8, gen_rate_file=f)
    g = p["data_stage"]
    assert (g["engine"], g["engine_setting"], g["tensor_parallel"], g["instances"]) == ("vllm", "auto", 1, 8)
    assert g["rate_tok_s"] == 800.0 and "gen.json" in g["rate_source"] and "vllm bf16 batch 64" in g["rate_source"]
    assert g["hours"] == pytest.approx(tokens / (800 * 8) / 3600) == p["data"]["generation_hours"]
    assert problems(p, "warning") == []  # measured on this target
    hf = plan("eagle3-llama3-8b", f"target.path={LLAMA}", "data.responses.engine=hf",
              "data.responses.scheduler=refill", world_size=8, gen_rate_file=f)
    assert hf["data_stage"]["rate_tok_s"] == 100.0 and hf["data_stage"]["tensor_parallel"] == 1
    repo = json.loads((ROOT / "benchmarks/results/generation_throughput_vllm.json").read_text())
    best = max(r["tok_per_s"] for r in repo["results"] if r["scheduler"] == "vllm" and r["dtype"] == "bf16")
    default = plan("eagle3-llama3-8b", f"target.path={LLAMA}", world_size=8)
    assert default["data_stage"]["rate_tok_s"] == best
    assert any("measured on SmolLM2-135M" in w and "--gen-tok-s" in w for w in problems(default, "warning"))
    with pytest.raises(Exception, match="no vllm fp16 row"):
        plan("eagle3-llama3-8b", f"target.path={LLAMA}", "target.dtype=float16", world_size=8, gen_rate_file=f)
    assert main(["plan", str(ROOT / "recipes/eagle3-llama3-8b.yaml"), f"target.path={LLAMA}", "--gpus", "8",
                 "--gen-tok-s", str(f)]) == 0
    assert f"~{tokens / (800 * 8) / 3600:.2f} h at 800 tok/s per instance (measured: gen.json" in capsys.readouterr().out


def test_plan_of_a_70b_target_from_its_config(tmp_path):
    """Llama-3.1-70B (tests/fixtures/configs/llama-3.1-70b: the published config.json): its size,
    the vLLM tensor-parallel data stage and the training, each figure computed here from the config."""
    H, I, L, V, KV, HD, N = 8192, 28672, 80, 128256, 8, 128, 32000
    P = 2 * V * H + L * (2 * H * H + 2 * H * KV * HD + 3 * H * I + 2 * H) + H
    assert P == 70_553_706_496  # the model card's 70.6B
    p = plan("eagle3-llama3-8b", f"target.path={LLAMA70}", world_size=16, gen_tokens_per_s=3000)
    assert p["target"]["params"] == P and p["head"]["feature_layers"] == [2, 40, 77]
    head = 3 * H * H + (2 * H * H + 2 * (2 * H * KV * HD) + H * H + 3 * H * I + 3 * H) + H + N * H
    assert p["head"]["params"] == head
    weights, kv_token = 2 * P, 2 * L * KV * HD * 2  # bf16
    kv = 64 * (200 + 1536) * kv_token  # batch 64 x (prompt + response) tokens
    tp = next(t for t in (1, 2, 4, 8) if (weights + kv) / t <= 0.9 * 80 * GiB)
    g = p["data_stage"]
    assert tp == 4 and (g["tensor_parallel"], g["instances"], g["kv_bytes_per_token"]) == (4, 4, kv_token)
    assert g["gpu_bytes"] == {"weights": weights / 4, "kv_cache": kv / 4}
    tokens = (200_000 + 64) * 1536
    assert g["hours"] == pytest.approx(tokens / (3000 * 4) / 3600)
    bound = 64 * 3350e9 / ((weights + 64 * (200 + 768) * kv_token) / 4)
    assert g["bound_tok_s"] == pytest.approx(bound) and g["bound_hours"] == pytest.approx(tokens / (bound * 4) / 3600)
    seen = 6250 * 128 * 1736  # steps x global batch (16 x 2 x 4) x tokens per sample
    tt = p["training_time"]
    assert tt["target_forward_flops"] == 2 * P * seen and tt["head_flops"] == 6 * head * 7 * seen
    assert tt["hours"] == pytest.approx((2 * P + 42 * head) * seen / (16 * 989e12 * 0.4) / 3600)
    m = p["memory_per_rank"]
    assert m["target_weights"] == weights
    assert any("131.4 GiB of bfloat16 weights do not fit one 80 GiB GPU" in e for e in problems(p, "error"))
    big = plan("eagle3-llama3-8b", f"target.path={LLAMA70}", world_size=16, gen_tokens_per_s=3000,
               gpu_memory_gib=192)  # B200: the replica fits, and vLLM needs no tensor parallelism
    assert problems(big, "error") == [] and big["data_stage"]["tensor_parallel"] == 1
    eight = plan("eagle3-llama3-8b", f"target.path={LLAMA70}", world_size=16, gen_tokens_per_s=3000, data_tp=8)
    assert (eight["data_stage"]["instances"], eight["data_stage"]["gpu_bytes"]["weights"]) == (2, weights / 8)


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
