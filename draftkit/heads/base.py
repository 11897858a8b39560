"""The one interface every draft head implements, and what heads share with the target.

A head is an nn.Module whose *parameters are only its own trainable weights*. The target modules
it may use (token embedding, final norm, lm_head) are frozen and held outside the parameter tree
(`SharedModules`), so DeepSpeed never partitions, saves or steps them.

Contract with the trainer:  `loss(features) -> {"loss", "acc", ...}` on a batch of TargetFeatures.
Contract with the verify loop (draftkit.inference):
    state = head.new_draft_state(batch_size)
    tokens, probs = head.draft(state, feats, next_tokens, valid, k, sample)
`feats` (B, n, F) are the target's features at the n positions each row confirmed since the last
call (padded; `valid` (B, n) marks real entries), and `next_tokens` (B, n) the token that follows
each of those positions (the last valid one per row is the newest token, not yet seen by the
target). The head consumes these, discards whatever it speculated last time, then drafts k tokens,
sampling each with `sample(logits (B, n)) -> (indices (B,), probs (B, n) | None)` (None = greedy)
over the vocabulary it hands `sample`: its draft vocabulary (`draft_vocab`, whose target ids the
head maps the indices to) or the target's (n = V). It returns tokens (B, k) and probs
(B, k, V) | None, both over the *target* vocabulary.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from draftkit.schema import ConfigError, from_dict
from draftkit.heads.layers import LayerDims
from draftkit.target import rope_parameters_of, rows_linear

SampleFn = Callable[[Tensor], tuple[Tensor, Tensor | None]]
HEAD_FORMAT_VERSION = 1


class HeadError(ValueError):
    """A head that does not fit its target, or a head directory that is not what it claims."""


@dataclass
class SharedModules:
    """Frozen target modules a head may use; never part of the head's parameters."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    final_norm: nn.Module | None = None

    @classmethod
    def from_target(cls, target) -> "SharedModules":
        return cls(target.embed_tokens, target.lm_head, target.final_norm)


@dataclass
class HeadConfig:
    """Fields every head has. Users set the family's own fields; the rest comes from the target."""

    type: str = ""
    # ---- filled from the target when the head is created (do not set in a recipe) ----
    hidden_size: int = 0
    vocab_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096
    # What the head was trained against: name, fingerprint, sizes (written by the trainer).
    target: dict = field(default_factory=dict)
    # Feature layer index convention (see draftkit.target): residual stream entering layer i.
    layer_convention: str = "hf_hidden_states_index; -1 = final norm output"

    def layer_dims(self, input_size: int | None = None) -> LayerDims:
        return LayerDims(self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                         self.head_dim, self.intermediate_size, self.rms_norm_eps, input_size)

    def fill_from_target(self, target) -> None:
        c = target.config
        self.hidden_size = target.hidden_size
        self.vocab_size = target.vocab_size
        self.num_attention_heads = c.num_attention_heads
        self.num_key_value_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.intermediate_size = c.intermediate_size
        self.rms_norm_eps = float(getattr(c, "rms_norm_eps", 1e-5))
        rope = rope_parameters_of(c)  # theta + scaling, transformers 4.x or 5 spelling
        # Gemma 3 keeps one rope per layer type; the head's layer is a global-attention llama layer.
        self.rope_parameters = dict(rope.get("full_attention", rope) if "rope_type" not in rope else rope)
        self.max_position_embeddings = getattr(c, "max_position_embeddings", 4096)
        self.target = target.info()


class DraftHead(nn.Module):
    """Base class: config handling, shared modules, rotary embeddings, save/load."""

    family: ClassVar[str] = ""
    config_class: ClassVar[type[HeadConfig]] = HeadConfig
    # Whether the family's loss can take the target's top-k log-probabilities (TargetFeatures.topk_*)
    # instead of its final hidden state: only where that state is the label and never an input.
    topk_teacher: ClassVar[bool] = False
    # Positions whose top-1 agreement the trainer's held-aside eval reports apart (heldout_acc_{i}):
    # for each i, loss() returns acc_{i} and tokens_{i}, the rows it was measured on. () = top-1 only.
    agreement_positions: tuple[int, ...] = ()
    # Drafting only: None = the head's attention sees the whole context (as in training); else only
    # keys fewer than this many positions behind each query. The engine loop sets it to the window
    # vLLM puts on a served drafter (export/vllm.py: draft_window); heads without attention ignore it.
    attention_window: int | None = None
    # Training only: the optimizer steps done before the current one. The trainer sets it before each
    # step (resumed runs included: it is the loop's own counter), so a loss can follow a schedule
    # (EAGLE-3's head.on_policy_from); outside training it stays 0.
    steps_done: int = 0

    def __init__(self, config: HeadConfig, shared: SharedModules | None = None):
        super().__init__()
        self.config = config
        object.__setattr__(self, "_shared", shared)  # not a submodule: frozen, never saved

    # ---- creation ----
    @classmethod
    def config_from_dict(cls, data: dict[str, Any], path: str = "head") -> HeadConfig:
        return from_dict(cls.config_class, data, path)

    @classmethod
    def for_target(cls, data: dict[str, Any], target) -> "DraftHead":
        """Build a fresh head from recipe settings, sized to `target`."""
        config = cls.config_from_dict(data)
        config.fill_from_target(target)
        cls.validate(config, target)
        return cls(config, SharedModules.from_target(target))

    @classmethod
    def validate(cls, config: HeadConfig, target) -> None:
        """Raise HeadError when the head cannot work on this target. Families extend this."""
        target.check_layers(tuple(cls.feature_layers_of(config)), f"head.{cls.family}.feature_layers")

    @classmethod
    def feature_layers_of(cls, config: HeadConfig) -> tuple[int, ...]:
        raise NotImplementedError  # abstract: each family says which target layers it reads

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.feature_layers_of(self.config)

    def check_target_topk(self, k: int) -> None:
        """Refuse train.target_topk = k > 0 for a family that reads the final hidden state as input."""
        if k < 0:
            raise HeadError(f"train.target_topk: must be >= 0 (0 = store the final hidden state), got {k}")
        if k and not self.topk_teacher:
            raise HeadError(
                f"train.target_topk: {k} stores the target's top-k log-probabilities instead of its final "
                f"hidden state, but the {self.family} head reads that state as its input feature "
                f"(feature_layers {list(self.feature_layers)}), not only as its label; set train.target_topk: 0")
        if k > self.config.vocab_size:
            raise HeadError(f"train.target_topk: {k} exceeds the target's vocabulary ({self.config.vocab_size})")

    @property
    def shared(self) -> SharedModules:
        if self._shared is None:
            raise HeadError(f"{self.family} head has no target modules attached: call head.attach(target)")
        return self._shared

    def attach(self, target_or_shared) -> "DraftHead":
        shared = target_or_shared if isinstance(target_or_shared, SharedModules) else SharedModules.from_target(target_or_shared)
        info = getattr(target_or_shared, "info", None)
        if info is not None:
            check_fits(self.config, target_or_shared)
        object.__setattr__(self, "_shared", shared)
        return self

    def rotary(self) -> nn.Module:
        """Rotary embedding of the target's family (rope scaling included), built from the config."""
        if not hasattr(self, "_rotary"):
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            from draftkit.target import check_rope_support

            check_rope_support()  # transformers 4.x would ignore rope_parameters below, silently
            c = self.config
            lc = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                             head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                             rope_parameters=dict(c.rope_parameters))
            object.__setattr__(self, "_rotary", LlamaRotaryEmbedding(lc))
        return self._rotary

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        rot = self.rotary().to(positions.device)
        cos, sin = rot(torch.zeros((), dtype=dtype, device=positions.device), positions)
        return cos.to(dtype), sin.to(dtype)  # (B, T, head_dim)

    def embed(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return self.shared.embed_tokens(ids).to(dtype)

    def target_logits(self, hidden: Tensor) -> Tensor:
        """Logits of the frozen lm_head over `hidden` (B, T, H), in float32."""
        w = self.shared.lm_head.weight
        return rows_linear(hidden.to(w.dtype), w).float()

    def target_logits_top1(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(M, H) -> the frozen lm_head's (M, V) float32 logits and their (M,) argmax (a loss teacher)."""
        logits = self.target_logits(hidden)
        return logits, logits.argmax(-1)

    # ---- the interface ----
    def loss(self, features) -> dict[str, Tensor]:
        raise NotImplementedError  # abstract

    def new_draft_state(self, batch_size: int) -> Any:
        raise NotImplementedError  # abstract

    def draft(self, state: Any, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample: SampleFn) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError  # abstract

    @property
    def max_draft_tokens(self) -> int | None:
        """Largest k the head supports (None = unbounded)."""
        return None

    # ---- tree drafting (draftkit.inference.tree) ----
    # A family drafts trees by providing tree_root (consume the confirmed positions, return the
    # root's state (B, H)), tree_logp(hidden (B, m, H), depth) -> (B, m, V) log-probs of the
    # children, and tree_step(state, parent hidden, tokens, depth, visible) -> (B, m, H), which
    # feeds frontier nodes into the head's cache with the tree mask.
    max_tree_depth: int | None = None

    @torch.no_grad()
    def draft_tree(self, state: Any, feats: Tensor, next_tokens: Tensor, valid: Tensor, shape):
        """EAGLE-2 dynamic tree of `shape` (TreeShape) after the newest confirmed token."""
        from draftkit.inference.tree import grow_tree  # inference imports heads, not the reverse at load

        if self.max_tree_depth is not None and shape.depth > self.max_tree_depth:
            raise HeadError(f"{self.family} head drafts trees up to depth {self.max_tree_depth}, asked for {shape.depth}")
        root = self.tree_root(state, feats, next_tokens, valid)
        return grow_tree(root, self.tree_logp,
                         lambda h, tokens, depth, visible: self.tree_step(state, h, tokens, depth, visible), shape,
                         self.draft_vocab)

    @property
    def draft_vocab(self) -> Tensor | None:
        """(N,) target ids of the head's draft logits, which tree_logp scores and chain drafts are
        sampled over, when it has a draft vocabulary (None: the target's)."""
        return None

    # ---- save / load ----
    @classmethod
    def from_pretrained(cls, directory: str | Path, target=None, **kwargs) -> "DraftHead":
        """Load a head saved by save_pretrained (bit-identical weights); see load_head."""
        return load_head(directory, target, expected_family=cls.family or None, **kwargs)

    def save_pretrained(self, directory: str | Path, extra: dict | None = None) -> Path:
        """Write config.json + model.safetensors atomically (a crash leaves the previous copy)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt", "draftkit_family": self.family})
            cfg = {"draftkit_format": HEAD_FORMAT_VERSION, "family": self.family,
                   **dataclasses.asdict(self.config), **(extra or {})}
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
            replace_dir(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return directory


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished directory into place; an existing one is swapped out, never half-replaced."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def check_fits(config: HeadConfig, target) -> None:
    """A head trained for one target refuses another with different sizes."""
    for name, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        want = getattr(config, name)
        if want != have:
            raise HeadError(f"head config {name}={want} does not fit target {target.name} ({name}={have})")


def read_head_config(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise HeadError(f"{directory}: not a head directory (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HeadError(f"{path}: not valid JSON: {e}") from e


def load_head(directory: str | Path, target=None, *, expected_family: str | None = None,
              strict_target: bool = True) -> DraftHead:
    """Load a native draftkit head directory; attach `target` (checked) when given."""
    from draftkit.heads.registry import head_class

    directory = Path(directory)
    raw = read_head_config(directory)
    family = raw.get("family")
    if family is None:
        raise HeadError(f"{directory}/config.json: no 'family' field; is this a draftkit head? "
                        "(third-party layouts: draftkit import DIR --format ...)")
    if expected_family and family != expected_family:
        raise HeadError(f"{directory}: holds a '{family}' head, not '{expected_family}'")
    cls = head_class(family)
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    try:
        config = from_dict(cls.config_class, {k: v for k, v in raw.items() if k in fields}, "config")
    except ConfigError as e:
        raise HeadError(f"{directory}/config.json: {e}") from e
    head = cls(config)
    path = directory / "model.safetensors"
    try:
        state = load_file(path)
    except (OSError, SafetensorError) as e:
        raise HeadError(f"{path}: cannot read safetensors ({e})") from e
    check_state_dict(head, state, path)
    head.load_state_dict(state)
    if target is not None:
        if strict_target:
            check_fits(config, target)
            want = config.target.get("fingerprint")
            if want and want != target.fingerprint:
                raise HeadError(f"{directory}: trained against target fingerprint {want} "
                                f"({config.target.get('name')}), but this target is {target.fingerprint} "
                                f"({target.name}); pass force=True / --force to use it anyway")
        head.attach(SharedModules.from_target(target))
        head.to(target.device)
    return head


def check_state_dict(head: nn.Module, state: dict[str, Tensor], where) -> None:
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadError(f"{where}: tensors do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise HeadError(f"{where}: tensor '{name}' has shape {tuple(t.shape)}, config expects {tuple(expected[name].shape)}")
