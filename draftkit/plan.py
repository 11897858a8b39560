"""`draftkit plan RECIPE [overrides]`: what a run will cost, from configs alone (no weights loaded).

The target is built from its config.json on the meta device (exact parameter counts, no memory),
the head is built on it the same way, and the recipe's DeepSpeed section decides how weights,
gradients and AdamW states split across ranks. Memory for activations is an ESTIMATE from the
shapes (documented in `head_activation_bytes`); everything else is exact arithmetic on the configs.
Time, per stage: stage 1 (responses) at the measured generation rate of one engine instance (a
benchmarks/generation_throughput.py JSON, by default this repo's, or --gen-tok-s N) times the
instances (vLLM: tensor parallel within a node, data parallel across), beside the HBM-bandwidth
bound of decoding (`decode_bound`); features and training an ESTIMATE from FLOPs at an assumed
fraction of the GPU's peak (`training_time`).
Problems that would fail or waste the run (a length over the target's context, a draft vocabulary
larger than the target's, a learning rate tuned for the 135M demo target, a target that cannot fit
one GPU) are listed, errors first; `plan` exits 1 when there is an error.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from draftkit.config import Recipe, load_recipe
from draftkit.schema import ConfigError
from draftkit.target import AUTO_DTYPE, DTYPES, FINAL, Target, TargetError, check_rope_support, embedded_model_dir

GiB = 1024 ** 3


MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "generation_throughput_vllm.json"


@dataclass
class PlanSettings:
    # Processes the launcher starts (deepspeed --num_gpus N x nodes) = GPUs in the run.
    world_size: int = 1
    # Memory of one accelerator, GiB (H100 / A100-80GB: 80).
    gpu_memory_gib: float = 80.0
    # Response tokens one engine instance generates per second while regenerating data: a number
    # (measured on your cluster), or None to read it from `gen_rate_file`.
    gen_tokens_per_s: float | None = None
    # A benchmarks/generation_throughput.py JSON: its fastest row for the recipe's engine and
    # dtype is the rate (default: this repo's measurement, SmolLM2-135M on two CPU cores).
    gen_rate_file: Path = MEASURED
    # Mean prompt length in tokens (chat prompts of ShareGPT / UltraChat: ~100-300).
    prompt_tokens: int = 200
    # GPUs per node: vLLM's tensor parallelism stays within one.
    gpus_per_node: int = 8
    # vLLM tensor_parallel_size of the data stage; None: data.responses.vllm's, else the smallest
    # power of two whose shard of the weights and KV cache fits 90% of a GPU.
    data_tp: int | None = None
    # HBM bandwidth of one GPU, GB/s (H100 SXM: 3350): the decode-rate bound of the data stage.
    gpu_bandwidth_gbs: float = 3350.0
    # Dense bf16 TFLOP/s of one GPU (H100 SXM: 989) and the fraction a run reaches (an ASSUMPTION):
    # the training and feature-stage time estimates.
    gpu_tflops: float = 989.0
    mfu: float = 0.4


class MetaTarget(Target):
    """A Target whose weights live on the meta device: sizes without memory, no fingerprint."""

    @property
    def fingerprint(self) -> str:
        return "meta"


def target_config(recipe: Recipe):
    """The target's transformers config from a model dir, hub id, GGUF dir or the embedded default."""
    from transformers import AutoConfig

    t = recipe.target
    if t.path is None:
        src, kwargs = embedded_model_dir(), {}
    else:
        p = Path(t.path).expanduser()
        if p.suffix == ".gguf":
            src, kwargs = p.parent, {"gguf_file": p.name}
        elif p.is_dir() and not (p / "config.json").is_file() and not t.gguf_file:
            raise TargetError(f"target.path: {p} is not a model directory (no config.json)")
        else:
            src, kwargs = (p if p.exists() else t.path), ({"gguf_file": t.gguf_file} if t.gguf_file else {})
    try:
        return AutoConfig.from_pretrained(src, trust_remote_code=t.trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        raise TargetError(f"target.path: cannot read a model config from {src}: {e}") from e


def meta_target(config, dtype: str, name: str) -> MetaTarget:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    return MetaTarget(model, None, name=name)


def zero_split(params: int, stage: int, world: int, mixed: bool) -> dict[str, float]:
    """Per-rank bytes of a trained module under ZeRO `stage` (the ZeRO paper's accounting).

    mixed (DeepSpeed bf16/fp16): 2-byte weights and grads + fp32 master, exp_avg, exp_avg_sq (12 B).
    fp32 (draftkit's default, autocast or not): 4-byte weights and grads + exp_avg, exp_avg_sq (8 B).
    Stage 1 partitions the optimizer states, 2 also the gradients, 3 also the weights.
    """
    w, g, o = params * (2 if mixed else 4), params * (2 if mixed else 4), params * (12 if mixed else 8)
    return {"weights": w / (world if stage >= 3 else 1), "grads": g / (world if stage >= 2 else 1),
            "optimizer": o / (world if stage >= 1 else 1)}


def head_activation_bytes(head_cfg: dict, c, micro: int, length: int, act_bytes: int,
                          logits_rows: int) -> dict[str, float]:
    """ESTIMATE of the activations autograd keeps for one micro-batch of the head.

    Decoder layer: ~8H + 4I values per token (norm, q/k/v/o inputs and outputs, the SwiGLU's four
    I-wide tensors); attention keeps O(T) (flash / chunked unrolled attention, no T x T scores).
    Logits: `logits_rows` rows of the vocabulary at a time, fp32, x3 (head logits, log-softmax,
    target log-probs): the losses are chunked over rows (draftkit.heads.losses).
    """
    H, I = c.hidden_size, c.intermediate_size
    tokens = micro * length
    family = head_cfg["type"]
    layer = 8 * H + 4 * I
    if family == "eagle":
        values = head_cfg.get("num_layers", 1) * layer + 2 * H
        passes = 1
    elif family == "eagle3":
        passes = head_cfg.get("ttt_steps", 7)
        values = passes * (layer + 4 * H) + 3 * H
    elif family == "mtp":
        passes = head_cfg.get("num_depths", 1)
        values = passes * (layer + 4 * H)
    elif family == "dflash":  # A blocks of B query rows per sample, each layer's scores over the context
        blocks, L = micro * head_cfg.get("num_anchors", 64), head_cfg.get("num_layers", 2)
        rows = min(blocks * head_cfg.get("block_size", 8), tokens * head_cfg.get("block_size", 8))
        kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * (getattr(c, "head_dim", None) or H // c.num_attention_heads)
        scores = rows * c.num_attention_heads * length * 4 * 2 * L  # fp32 scores and probabilities (einsum attention)
        vocab = head_cfg.get("draft_vocab_size") or c.vocab_size
        return {"layers": float((rows * L * layer + tokens * (2 * H + 2 * L * kv)) * act_bytes + scores),
                "logits": float(min(rows, logits_rows) * vocab * 4 * 3)}
    else:  # medusa: L residual blocks of width H per head
        passes = head_cfg.get("num_heads", 4)
        values = passes * head_cfg.get("num_layers", 1) * 3 * H
    vocab = head_cfg.get("draft_vocab_size") or c.vocab_size
    return {"layers": float(tokens * values * act_bytes),
            "logits": float(min(tokens, logits_rows) * vocab * 4 * 3)}


def generation_rate(s: PlanSettings, engine: str, scheduler: str, dtype: str) -> tuple[float, str, dict]:
    """(response tok/s per engine instance, where the figure came from, its measurement's meta):
    s.gen_tokens_per_s as given, else the fastest row of s.gen_rate_file for the engine (vllm, or
    hf's scheduler) and dtype. ConfigError when the file has no such row."""
    if s.gen_tokens_per_s is not None:
        return float(s.gen_tokens_per_s), "given (--gen-tok-s)", {}
    try:
        measured = json.loads(Path(s.gen_rate_file).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--gen-tok-s: cannot read a throughput file {s.gen_rate_file}: {e}") from e
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    want = "vllm" if engine == "vllm" else scheduler
    rows = [r for r in measured.get("results", []) if r.get("scheduler") == want and r.get("dtype") == short]
    if not rows:
        raise ConfigError(f"{s.gen_rate_file}: no {want} {short} row (benchmarks/generation_throughput.py "
                          f"--schedulers {want} --dtypes {short} writes one), or give --gen-tok-s N")
    best, meta = max(rows, key=lambda r: r["tok_per_s"]), measured.get("meta", {})
    where = (f"measured: {Path(s.gen_rate_file).name}, {meta.get('model', '?')} {want} {short} batch "
             f"{best['batch_size']}, {meta.get('device', '?')} x{meta.get('threads', '?')} threads"
             + (" (AVX512-BF16)" if meta.get("cpu_avx512_bf16") else ""))
    return float(best["tok_per_s"]), where, meta


def data_tp(s: PlanSettings, d, weight_bytes: float, kv_bytes: float) -> int:
    """vLLM's tensor_parallel_size for the data stage (PlanSettings.data_tp's rule)."""
    if s.data_tp:
        return s.data_tp
    if d.responses.vllm.get("tensor_parallel_size"):
        return int(d.responses.vllm["tensor_parallel_size"])
    cap, t = 0.9 * s.gpu_memory_gib * GiB, 1
    while t < s.gpus_per_node and (weight_bytes + kv_bytes) / t > cap:
        t *= 2
    return t


def decode_bound(weight_bytes: float, kv_per_token: float, batch: int, context: float, tp: int,
                 bandwidth_gbs: float) -> float:
    """Upper bound of one engine instance's decode rate, tok/s: every step reads each GPU's shard of
    the weights and of the batch's KV cache from HBM once, batch tokens per step (no compute time,
    perfect tensor parallelism: a real engine reaches perhaps half)."""
    step_bytes = (weight_bytes + batch * context * kv_per_token) / tp
    return batch * bandwidth_gbs * 1e9 / step_bytes


def data_stage(r: Recipe, s: PlanSettings, cfg, dtype: str, weight_bytes: float, response_tokens: int,
               problems: list) -> dict:
    """Stage 1 on the cluster. engine vllm (auto: planned as where vLLM is installed): instances of
    tp GPUs each, tensor parallel within a node, data parallel across (one prepare rank per
    instance: it answers its share of the prompts and writes its own shards); engine hf: one
    instance per rank. Hours at the measured (or given) rate and at the HBM bound, bytes per GPU."""
    d = r.data
    engine = "hf" if d.responses.engine == "hf" else "vllm"
    layers, kv = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * layers * kv * head_dim * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    batch = int(d.responses.vllm.get("max_num_seqs", d.responses.batch_size))
    kv_bytes = batch * (s.prompt_tokens + d.responses.max_new_tokens) * kv_per_token
    tp = data_tp(s, d, weight_bytes, kv_bytes) if engine == "vllm" else 1
    instances = max(s.world_size // tp, 1)
    rate, source, meta = generation_rate(s, engine, d.responses.scheduler, dtype)
    bound = decode_bound(weight_bytes, kv_per_token, batch, s.prompt_tokens + d.responses.max_new_tokens / 2, tp,
                         s.gpu_bandwidth_gbs)
    if engine == "vllm" and (weight_bytes + kv_bytes) / tp > 0.9 * s.gpu_memory_gib * GiB:
        problems.append(("error", f"data stage: {(weight_bytes + kv_bytes) / tp / GiB:.1f} GiB of weights and KV "
                         f"cache per GPU at tensor parallel {tp} exceed 90% of {s.gpu_memory_gib:g} GiB; lower "
                         "data.responses.batch_size or raise data.responses.vllm.tensor_parallel_size"))
    if s.world_size % tp:
        problems.append(("warning", f"data stage: {s.world_size} GPUs are not a multiple of tensor parallel {tp}"))
    model = str(meta.get("model", "")).split(".")[0]
    if meta and model not in str(r.target.path or "embedded SmolLM2-135M-Instruct"):
        problems.append(("warning", f"data stage: the rate was measured on {meta.get('model')} ({meta.get('device')}), "
                         "not this target on these GPUs: measure there (benchmarks/generation_throughput.py --model "
                         "TARGET --schedulers vllm --dtypes bf16) and pass --gen-tok-s FILE or N"))
    return {"engine": engine, "engine_setting": d.responses.engine, "tensor_parallel": tp, "instances": instances,
            "batch": batch, "rate_tok_s": rate, "rate_source": source,
            "hours": response_tokens / (rate * instances) / 3600, "bound_tok_s": bound,
            "bound_hours": response_tokens / (bound * instances) / 3600, "kv_bytes_per_token": kv_per_token,
            "gpu_bytes": {"weights": weight_bytes / tp, "kv_cache": kv_bytes / tp}}


def training_time(r: Recipe, s: PlanSettings, target_params: int, head_params: int, head_cfg: dict, prompts: int,
                  samples_seen: int, sample_tokens: int) -> dict:
    """ESTIMATE of the GPU time of features and training from FLOPs: a target forward is 2 P_target
    per token (train.features online: every sample seen; offline: each sample once, in stage 2), the
    head's forward and backward 6 P_head per token per pass (EAGLE-3: ttt_steps, MTP: num_depths,
    else 1), at s.mfu of s.gpu_tflops on each of s.world_size GPUs. Attention's T^2 terms and the
    evaluation passes are left out."""
    family = r.head["type"]
    passes = head_cfg.get("ttt_steps", 7) if family == "eagle3" else head_cfg.get("num_depths", 1) if family == "mtp" else 1
    seen = samples_seen * sample_tokens
    target = 2 * target_params * (seen if r.train.features == "online" else prompts * sample_tokens)
    head = 6 * head_params * passes * seen
    per_s = s.world_size * s.gpu_tflops * 1e12 * s.mfu
    features = r.train.features == "offline"
    return {"features": r.train.features, "target_forward_flops": float(target), "head_flops": float(head),
            "feature_hours": target / per_s / 3600 if features else 0.0,
            "hours": (head if features else target + head) / per_s / 3600,
            "assumption": f"{s.mfu:.0%} of {s.gpu_tflops:g} bf16 TFLOP/s on each of {s.world_size} GPUs"}


def make_plan(recipe: Recipe, s: PlanSettings) -> dict:
    """Everything `draftkit plan` prints, as a dict (also written by --json)."""
    from draftkit.heads import HeadError, build_head
    from draftkit.heads.losses import chunk_rows
    from draftkit.train.deepspeed_config import build_deepspeed_config

    problems: list[tuple[str, str]] = []  # (severity, message)
    r, d, t = recipe, recipe.data, recipe.train
    cfg = target_config(r)
    name = r.target.path or "embedded SmolLM2-135M-Instruct"
    try:
        check_rope_support(cfg)
    except TargetError as e:
        problems.append(("error", str(e)))
    tdtype = "bfloat16" if r.target.dtype == AUTO_DTYPE else r.target.dtype  # auto: bf16 on the planned GPUs
    target = meta_target(cfg, tdtype, name)
    tbytes = {"bfloat16": 2, "float16": 2, "float32": 4}[tdtype]
    try:
        ds = build_deepspeed_config(r, s.world_size, on_cuda=True)
    except ConfigError as e:
        problems.append(("error", str(e)))
        ds = build_deepspeed_config(Recipe(train=r.train), s.world_size, on_cuda=True)
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    global_batch = micro * accum * s.world_size
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    mixed = any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16"))

    head = None
    try:
        with torch.device("meta"):
            head = build_head(r.head, target)
    except (HeadError, TargetError, ConfigError) as e:
        problems.append(("error", str(e)))
    head_cfg = dict(r.head)
    if head is not None:
        head_cfg.update({k: v for k, v in vars(head.config).items() if k in
                         ("ttt_steps", "num_depths", "num_heads", "num_layers", "draft_vocab_size",
                          "num_anchors", "block_size")})
    head_params = sum(p.numel() for p in head.parameters()) if head is not None else 0
    target_params = sum(p.numel() for p in target.model.parameters())
    layers = head.feature_layers if head is not None else (FINAL,)

    # ---- data ----
    prompts = r.samples_needed(global_batch)
    sample_tokens = min(d.max_length, s.prompt_tokens + d.responses.max_new_tokens)
    response_tokens = (prompts + d.holdout) * d.responses.max_new_tokens  # upper bound (EOS ends earlier)
    per_token_feature = (cfg.hidden_size * (1 if tuple(layers) == (FINAL,) else 1 + len(layers))) * tbytes + 4
    feature_bytes = prompts * sample_tokens * per_token_feature if t.features == "offline" else 0
    passes = t.max_steps * global_batch / max(prompts, 1)

    # ---- memory per rank ----
    act_bytes = 2 if (mixed or t.autocast in ("auto", "bfloat16")) else 4
    vocab = head_cfg.get("draft_vocab_size") or cfg.vocab_size
    head_mem = zero_split(head_params, stage, s.world_size, mixed)
    head_act = head_activation_bytes(head_cfg, cfg, micro, d.max_length, act_bytes, chunk_rows(vocab))
    target_weights = target_params * tbytes
    n_layers, kv = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # Feature forward (no grad): every hidden state kept (output_hidden_states) + one layer's MLP.
    target_fwd = micro * d.max_length * ((n_layers + 1) * cfg.hidden_size + 2 * cfg.intermediate_size) * tbytes
    target_fwd += d.max_length * cfg.vocab_size * 4  # the top-1 logits, one row at a time
    gen_len = s.prompt_tokens + d.responses.max_new_tokens
    kv_cache = 2 * n_layers * kv * head_dim * tbytes * d.responses.batch_size * gen_len
    train_total = target_weights + sum(head_mem.values()) + sum(head_act.values()) + target_fwd
    gen_total = target_weights + kv_cache + d.responses.batch_size * cfg.vocab_size * 4  # + one step's logits
    memory = {"target_weights": target_weights, "head": head_mem, "head_activations": head_act,
              "target_feature_forward": float(target_fwd), "training_peak": float(train_total),
              "generation_kv_cache": float(kv_cache), "generation_peak": float(gen_total)}
    stage1 = data_stage(r, s, cfg, tdtype, target_weights, response_tokens, problems)
    stage2 = training_time(r, s, target_params, head_params, head_cfg, prompts, t.max_steps * global_batch,
                           sample_tokens)

    # ---- what does not fit ----
    cap = s.gpu_memory_gib * GiB
    if target_weights > 0.9 * cap:
        problems.append(("error", f"target: {target_weights / GiB:.1f} GiB of {tdtype} weights do not fit "
                         f"one {s.gpu_memory_gib:g} GiB GPU with room to work; draftkit replicates the frozen target "
                         "on every rank and does not shard it (tensor parallel / ZeRO-3 inference): use a GPU "
                         "with more memory or a smaller target"))
    elif train_total > cap:
        problems.append(("error", f"training needs ~{train_total / GiB:.1f} GiB per rank, more than {s.gpu_memory_gib:g} "
                         "GiB: lower train.micro_batch_size (raise grad_accum), data.max_length, or use ZeRO-2/3"))
    if gen_total > cap and target_weights <= 0.9 * cap and stage1["engine"] != "vllm":
        problems.append(("warning", f"data.responses.batch_size={d.responses.batch_size}: the KV cache needs "
                         f"~{kv_cache / GiB:.1f} GiB over {gen_len} tokens; lower it"))
    ctx = getattr(cfg, "max_position_embeddings", None)
    if ctx is not None and d.max_length > ctx:
        problems.append(("error", f"data.max_length={d.max_length} exceeds the target's context "
                         f"(max_position_embeddings={ctx})"))
    window = getattr(cfg, "sliding_window", None)
    if window and d.max_length > window:
        problems.append(("warning", f"data.max_length={d.max_length} exceeds the target's sliding window "
                         f"({window}): the head's own attention is full-context, the target's is windowed"))
    if d.responses.max_new_tokens + s.prompt_tokens > d.max_length:
        problems.append(("warning", f"data.responses.max_new_tokens={d.responses.max_new_tokens} + ~{s.prompt_tokens} "
                         f"prompt tokens exceed data.max_length={d.max_length}: long answers are {d.overlong}d"))
    if prompts < global_batch:
        problems.append(("error", f"data: {prompts} prompts are fewer than one global batch ({global_batch})"))
    elif passes > 20:
        problems.append(("warning", f"train: {passes:.0f} passes over {prompts} samples (max_steps {t.max_steps} x "
                         f"global batch {global_batch}); the head will memorise them: prepare more prompts"))
    elif passes < 1 and d.num_prompts is not None:
        problems.append(("warning", f"data.num_prompts={d.num_prompts}: only {passes:.2f} of the prepared data is used"))
    if t.warmup_steps >= t.max_steps:
        problems.append(("warning", f"train.warmup_steps={t.warmup_steps} >= max_steps={t.max_steps}: no decay"))
    if t.lr > 3e-4 and cfg.hidden_size >= 2048:
        problems.append(("warning", f"train.lr={t.lr:g} is the small-target CPU recipes' rate; published EAGLE / "
                         "EAGLE-3 heads on 7-8B targets train at 3e-5..1e-4"))
    elif t.lr * math.sqrt(256 / global_batch) > 1e-2:
        problems.append(("warning", f"train.lr={t.lr:g} is high for a global batch of {global_batch}"))
    if head is not None and r.head["type"] == "eagle" and head_cfg.get("draft_vocab_size"):
        problems.append(("warning", f"head.draft_vocab_size={vocab}: vLLM / SGLang serve EAGLE-1 over the full "
                         "vocabulary only; export will refuse it (or drop it with --full-vocab)"))
    if head is not None and vocab < cfg.vocab_size and r.head["type"] in ("eagle", "eagle3") and prompts * sample_tokens < 10 * vocab:
        problems.append(("warning", f"head.draft_vocab_size={vocab}: the {prompts * sample_tokens} training tokens "
                         "cannot rank that many distinct tokens by frequency (the tail fills by id order)"))

    return {
        "target": {"name": name, "architecture": (getattr(cfg, "architectures", None) or ["?"])[0],
                   "params": target_params, "dtype": tdtype, "layers": n_layers,
                   "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "context": ctx,
                   "sliding_window": window, "rope": dict(getattr(cfg, "rope_parameters", None) or {})},
        "head": {"type": r.head["type"], "params": head_params, "feature_layers": list(layers),
                 "draft_vocab_size": vocab},
        "parallel": {"world_size": s.world_size, "micro_batch": micro, "grad_accum": accum,
                     "global_batch": global_batch, "zero_stage": stage, "deepspeed_mixed_precision": mixed,
                     "gpu_memory_gib": s.gpu_memory_gib},
        "data": {"prompts": prompts, "holdout": d.holdout, "max_length": d.max_length,
                 "response_tokens_max": response_tokens, "tokens_per_sample_est": sample_tokens,
                 "generation_hours": stage1["hours"], "feature_cache_bytes": float(feature_bytes)},
        "data_stage": stage1,
        "training_time": stage2,
        "schedule": {"max_steps": t.max_steps, "epochs": passes, "samples_seen": t.max_steps * global_batch,
                     "lr": t.lr, "warmup_steps": t.warmup_steps},
        "memory_per_rank": memory,
        "problems": [{"severity": sev, "message": msg} for sev, msg in
                     sorted(problems, key=lambda p: p[0] != "error")],
    }


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def format_plan(p: dict) -> str:
    t, h, par, d, sch, m = p["target"], p["head"], p["parallel"], p["data"], p["schedule"], p["memory_per_rank"]
    g, tt = p["data_stage"], p["training_time"]
    hm, ha = m["head"], m["head_activations"]
    lines = [
        f"target   {t['name']} ({t['architecture']}): {_count(t['params'])} params, {t['layers']} layers, "
        f"hidden {t['hidden_size']}, vocab {t['vocab_size']}, context {t['context']}"
        + (f", sliding window {t['sliding_window']}" if t["sliding_window"] else "")
        + f", rope {t['rope'].get('rope_type', 'default')}",
        f"head     {h['type']}: {_count(h['params'])} params, feature layers {h['feature_layers']}, "
        f"draft vocab {h['draft_vocab_size']}",
        f"ranks    {par['world_size']} x micro batch {par['micro_batch']} x accumulation {par['grad_accum']} "
        f"= global batch {par['global_batch']}; ZeRO-{par['zero_stage']}, "
        + ("DeepSpeed bf16/fp16 weights" if par["deepspeed_mixed_precision"] else "fp32 head weights"),
        f"data     {d['prompts']} prompts (+{d['holdout']} held aside), up to {_count(d['response_tokens_max'])} "
        f"response tokens; ~{d['tokens_per_sample_est']} tokens/sample (max_length {d['max_length']})",
        f"stage 1  {g['engine']} (data.responses.engine: {g['engine_setting']}): {g['instances']} instance(s) x "
        f"TP {g['tensor_parallel']}, one prepare rank each writing its own shards; per GPU "
        f"{_gib(g['gpu_bytes']['weights'])} weights + {_gib(g['gpu_bytes']['kv_cache'])} KV cache (batch {g['batch']})",
        f"         ~{g['hours']:.2f} h at {g['rate_tok_s']:g} tok/s per instance ({g['rate_source']}); "
        f">= {g['bound_hours']:.2f} h at the HBM bound ({g['bound_tok_s']:.0f} tok/s per instance)",
        (f"stage 2  ~{tt['feature_hours']:.2f} h of target forwards into the feature cache (ESTIMATE)"
         if tt["features"] == "offline" else "stage 2  none (features online: the target runs in every step)"),
        f"training ~{tt['hours']:.2f} h (ESTIMATE: {tt['target_forward_flops'] if tt['features'] == 'online' else 0:.3g} "
        f"target + {tt['head_flops']:.3g} head FLOPs at {tt['assumption']})",
        (f"features {_gib(d['feature_cache_bytes'])} on disk (train.features: offline)" if d["feature_cache_bytes"]
         else "features none on disk (train.features: online, recomputed every step)"),
        f"schedule {sch['max_steps']} steps, {sch['samples_seen']} samples seen = {sch['epochs']:.2f} passes; "
        f"lr {sch['lr']:g}, warmup {sch['warmup_steps']}",
        f"memory per rank (GPU {par['gpu_memory_gib']:g} GiB):",
        f"  target replica      {_gib(m['target_weights'])} ({t['dtype']})",
        f"  head weights        {_gib(hm['weights'])}",
        f"  head grads          {_gib(hm['grads'])}",
        f"  optimizer (AdamW)   {_gib(hm['optimizer'])}",
        f"  head activations    {_gib(ha['layers'])} layers + {_gib(ha['logits'])} loss logits (estimate)",
        f"  target features fwd {_gib(m['target_feature_forward'])} (estimate)",
        f"  = training peak     {_gib(m['training_peak'])}",
        f"  generation          {_gib(m['generation_peak'])} (KV cache {_gib(m['generation_kv_cache'])})",
    ]
    if p["problems"]:
        lines.append("problems:")
        lines += [f"  {q['severity']}: {q['message']}" for q in p["problems"]]
    else:
        lines.append("problems: none found")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--gpus", type=int, default=PlanSettings.world_size, help="processes (GPUs) in the run")
    parser.add_argument("--gpu-memory", type=float, default=PlanSettings.gpu_memory_gib, help="GiB per GPU")
    parser.add_argument("--gen-tok-s", default=None,
                        help="response tokens/s of one engine instance while regenerating data: a number, or a "
                             "benchmarks/generation_throughput.py JSON (its fastest row for the recipe's engine and "
                             "dtype); default: this repo's measurement, benchmarks/results/generation_throughput_vllm.json")
    parser.add_argument("--gpus-per-node", type=int, default=PlanSettings.gpus_per_node)
    parser.add_argument("--data-tp", type=int, default=None, help="vLLM tensor_parallel_size of the data stage")
    parser.add_argument("--gpu-bandwidth", type=float, default=PlanSettings.gpu_bandwidth_gbs,
                        help="HBM GB/s per GPU (the decode bound)")
    parser.add_argument("--gpu-tflops", type=float, default=PlanSettings.gpu_tflops, help="dense bf16 TFLOP/s per GPU")
    parser.add_argument("--mfu", type=float, default=PlanSettings.mfu, help="fraction of --gpu-tflops reached (assumed)")
    parser.add_argument("--prompt-tokens", type=int, default=PlanSettings.prompt_tokens,
                        help="assumed mean prompt length in tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")


def settings_of(args: argparse.Namespace) -> PlanSettings:
    """--gen-tok-s N is a rate, anything else a throughput file to read it from."""
    rate, file = None, MEASURED
    if args.gen_tok_s is not None:
        try:
            rate = float(args.gen_tok_s)
        except ValueError:
            file = Path(args.gen_tok_s)
    return PlanSettings(args.gpus, args.gpu_memory, rate, file, args.prompt_tokens, args.gpus_per_node,
                        args.data_tp, args.gpu_bandwidth, args.gpu_tflops, args.mfu)


def run(args: argparse.Namespace) -> int:
    import sys

    from draftkit.heads import HeadError

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        plan = make_plan(recipe, settings_of(args))
    except (ConfigError, TargetError, HeadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan, indent=2))
        tmp.replace(args.json)
    return 1 if any(q["severity"] == "error" for q in plan["problems"]) else 0
