"""The draft-verify loop: a head drafts k tokens, the target scores k+1 positions in one forward,
the rejection sampler decides, and both caches roll back to the accepted prefix.

    decoder = SpecDecoder(target, head, k=5)
    outputs, stats = decoder.generate(prompt_ids, max_new_tokens=128, params=SamplingParams(0.7), seeds=[0, 1])
    stats.tau, stats.acceptance_per_position

One step, for every row b of the batch (rows are ragged: own length, own acceptance, own stop):

    drafts d_1..d_k  = head.draft(state, feats of newly confirmed positions, their next tokens, ...)
    verify input     = [pending_b, d_1 .. d_k] at positions next_pos_b .. next_pos_b + k
    target logits    (B, k+1, V) + features of the same k+1 positions, one forward on the KV cache
    sampler          -> n_b accepted drafts + one recovered / bonus token (the new pending token)
    roll back        slots of the rejected drafts become *holes* (mask 0), never re-read

The target's KV cache is a transformers DynamicCache with one slot per fed token per row. Rolling
back does not move memory: the 2D attention mask over all slots hides the holes, and position_ids
are passed per row, so a row's tokens keep consecutive rotary positions whatever its holes. Slots
that are holes in *every* row at the end of the cache are cropped (at batch 1 there are never
holes). The head keeps its own cache the same way (see heads/layers.py). Both are exact: masked
slots get attention weight exp(-inf) = 0, so fp32 greedy output equals plain decoding token for
token (tests/test_spec_decoder.py).

A drafter may leave positions empty by returning token -1 there (the n-gram drafter does when it
finds no match); that row then drafts fewer tokens this step, and the verify forward is only as
wide as the longest row's draft.

Acceptance rule (`SpecDecoder(acceptance=...)`):
  "rejection" (default)  the rejection sampler: LOSSLESS, every token follows the target's distribution.
  "typical"              Medusa's typical acceptance (Cai et al. 2024, heads/medusa.py): LOSSY. Draft i
                         is accepted while p(d_i) > min(epsilon, delta * exp(-H(p))), p the target's
                         distribution at that position after the same temperature / top-k / top-p; at
                         the first position not accepted (or the bonus position) the token is the
                         target's own: argmax at T = 0, at T > 0 a draw from that same processed
                         distribution (the Medusa paper takes it greedily; we sample so T > 0 stays a
                         sample). The drafter drafts its top-1 chain (greedy `sample`, as Medusa's
                         candidates are the heads' top predictions): the rule never reads q, and a
                         draft sampled from q would often be a low-p token it rejects. At T = 0 p is
                         one-hot, so the rule is exact match: lossless there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftkit import prompts
from draftkit.heads.medusa import typical_acceptance
from draftkit.inference.rejection import RejectionSampler
from draftkit.inference.sampling import SamplingParams, exponential, logits_to_probs, make_generators
from draftkit.inference.tree import SOURCE_HEAD, SOURCE_LOOKUP, DraftTree, TreeShape, accept_tree, tree_noise
from draftkit.target import FINAL



SOURCE_NAMES = {SOURCE_HEAD: "head", SOURCE_LOOKUP: "lookup", SOURCE_HEAD | SOURCE_LOOKUP: "both"}


class SpecError(ValueError):
    """Bad settings for the loop (k out of range, prompt too long, empty prompt list)."""


def stop_token_ids(target) -> list[int]:
    """EOS of the config, the generation config and the tokenizer, plus end-of-turn specials."""
    return prompts.stop_token_ids(target.model, target.tokenizer)


def context_length(target) -> int:
    return int(getattr(target.config, "max_position_embeddings", None) or 1 << 30)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


@dataclass
class SpecStats:
    """Counts of one or more `generate` calls. Merge with `+=`; read tau / acceptance."""

    k: int
    steps: int = 0  # verify forwards (one per loop step, whole batch)
    row_steps: int = 0  # (row, step) pairs with the row still running: the denominator of tau
    emitted: int = 0  # tokens the verify steps produced (accepted drafts + one each), before cuts
    new_tokens: int = 0  # tokens in the outputs (prefill token included, cut at EOS / max)
    # accepted_hist[n]: row-steps that accepted exactly n drafts (n = 0..k)
    accepted_hist: list[int] = field(default_factory=list)
    # position i (0-based): row-steps whose draft i was looked at (all before it accepted) ...
    reached: list[int] = field(default_factory=list)
    # ... and that accepted it. alpha_i = accepted_at[i] / reached[i] (conditional acceptance).
    accepted_at: list[int] = field(default_factory=list)
    # accepted drafts by where they came from: "head", "lookup", "both" (a node both proposed)
    accepted_by_source: dict = field(default_factory=dict)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # time in head.draft (incl. consuming the confirmed features)
    verify_s: float = 0.0  # target forward + lm_head + rejection sampler + cache roll-back
    total_s: float = 0.0  # wall time of generate(), everything included

    def __post_init__(self):
        self.accepted_hist = self.accepted_hist or [0] * (self.k + 1)
        self.reached = self.reached or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    @property
    def tau(self) -> float:
        """Mean tokens per target forward per row, the bonus / recovered token included."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """alpha_i = P(draft i accepted | drafts 1..i-1 accepted); None where never reached."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def record(self, offered: Tensor, num_accepted: Tensor, active: Tensor,
               accepted_source: Tensor | None = None) -> None:
        """One verify step: offered (B, k) bool = the walk stood at depth i with a draft to try
        (chain: i < drafts offered and i <= accepted), num_accepted (B,), active (B,) row running;
        accepted_source (B, k) uint8 source flags of the accepted drafts (draftkit.inference.tree)."""
        na, off = num_accepted[active].tolist(), offered[active].long().tolist()
        self.steps += 1
        self.row_steps += len(na)
        for a, o in zip(na, off):
            self.emitted += a + 1
            self.accepted_hist[min(a, self.k)] += 1
            for i, reached in enumerate(o[: self.k]):
                self.reached[i] += reached
            for i in range(min(a, self.k)):
                self.accepted_at[i] += 1
        if accepted_source is not None:
            for row, a in zip(accepted_source[active].tolist(), na):
                for flag in row[:a]:
                    name = SOURCE_NAMES.get(flag)
                    if name:
                        self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + 1

    def __iadd__(self, other: "SpecStats") -> "SpecStats":
        if other.k != self.k:
            raise ValueError(f"cannot merge stats of k={other.k} into k={self.k}")
        for name in ("steps", "row_steps", "emitted", "new_tokens", "prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_hist", "reached", "accepted_at"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        for name, n in other.accepted_by_source.items():
            self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + n
        return self

    def to_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "k": self.k, "tau": self.tau, "acceptance_per_position": self.acceptance_per_position,
            "accepted_length_histogram": list(self.accepted_hist), "steps": self.steps,
            "row_steps": self.row_steps, "new_tokens": self.new_tokens,
            "accepted_by_source": dict(self.accepted_by_source),
            "tokens_per_s": self.tokens_per_s, "prefill_s": self.prefill_s, "draft_s": self.draft_s,
            "verify_s": self.verify_s, "total_s": self.total_s,
            "draft_ms_per_step": 1e3 * self.draft_s / steps, "verify_ms_per_step": 1e3 * self.verify_s / steps,
        }


# ---------------------------------------------------------------------------------------------
# The target side: a KV cache with holes
# ---------------------------------------------------------------------------------------------


class TargetCache:
    """The target's KV cache for a ragged batch: slots, their validity, their rotary positions.

    Prefill and plain steps pass transformers a 2D mask over the slots. Verify steps (`verify`)
    build the 4D mask themselves from per-slot positions: a query sees the valid cached slots and
    the new slots it is told to (a chain: the ones before it; a tree: its ancestors), and on
    sliding-window layers only keys less than `sliding_window` positions back. Positions, not slot
    indices, bound the window: rolled-back holes would make a slot-indexed window too short. So the
    cache is a plain DynamicCache (full layers): transformers' sliding layers would drop slots by
    count. After a verify, `commit_path` moves the kept slots (in path order) to the front of the
    new block and crops the rest, so at batch 1 the cache never holds a hole.
    """

    def __init__(self, target, batch_size: int, layers: tuple[int, ...] = ()):
        from transformers import DynamicCache

        self.target = target
        self.layers = tuple(layers)
        self.cache = DynamicCache()
        dev = target.device
        self.slot_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=dev)  # (B, S)
        self.slot_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=dev)  # (B, S) rotary position
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=dev)  # (B,)
        self.mask_spec = attention_mask_spec(target)

    def forward(self, ids: Tensor, valid: Tensor, logits_from: int = 0) -> tuple[Tensor, Tensor | None]:
        """Feed ids (B, T) as new slots; valid (B, T) marks real tokens (left padding, finished rows).

        Every fed token is provisionally valid; `commit` later turns rejected ones into holes.
        Returns logits (B, T - logits_from, V) float32 and the features (B, T, F) the head reads
        (None when it reads none).
        """
        positions = (self.next_pos[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
        self._append(valid, positions)
        return self._run(ids, self.slot_valid.long(), positions, logits_from)

    def verify(self, ids: Tensor, valid: Tensor, positions: Tensor, visible: Tensor) -> tuple[Tensor, Tensor | None]:
        """Feed a draft block: ids, valid, positions (B, T); visible (B, T, T) bool = query i may see
        new slot j (its ancestors and itself). Returns logits (B, T, V) and features as `forward`."""
        S0 = self.slot_valid.shape[1]
        self._append(valid, positions)
        B, T = ids.shape
        new = visible & valid[:, None, :]
        new |= torch.eye(T, dtype=torch.bool, device=ids.device)  # a query always sees itself (no empty rows)
        allowed = torch.cat([self.slot_valid[:, None, :S0].expand(B, T, S0), new], dim=2)  # (B, T, S)
        return self._run(ids, self.mask_spec.build(allowed, positions, self.slot_pos), positions, 0)

    def _append(self, valid: Tensor, positions: Tensor) -> None:
        self.slot_valid = torch.cat([self.slot_valid, valid], dim=1)  # (B, S + T)
        self.slot_pos = torch.cat([self.slot_pos, positions], dim=1)

    def _run(self, ids, mask, positions, logits_from):
        want_hidden = any(i != FINAL for i in self.layers)
        out = self.target.decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                                  past_key_values=self.cache, use_cache=True, output_hidden_states=want_hidden)
        final = out.last_hidden_state  # (B, T, H) after the final norm
        logits = self.target.lm_head(final[:, logits_from:]).float()  # (B, T', V)
        feats = None
        if self.layers:
            picked = [final if i == FINAL else out.hidden_states[i] for i in self.layers]
            feats = picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
        return logits, feats

    def commit(self, keep: Tensor) -> None:
        """keep (B, T): which of the last T fed slots stay; the others become holes."""
        T = keep.shape[1]
        self.slot_valid[:, -T:] = keep
        self.next_pos += keep.long().sum(1)
        # Slots that are holes in every row at the end of the cache can go: crop them.
        used = self.slot_valid[:, -T:].any(0)  # (T,)
        trailing = T - (int(used.nonzero().max()) + 1 if bool(used.any()) else 0)
        if trailing:
            self._crop(trailing)

    def commit_path(self, slots: Tensor, num_keep: Tensor, block: int) -> None:
        """Keep, of the last `block` fed slots, slots (B, L) (block-relative, in order; entries past
        num_keep (B,) ignored): they move to the front of the block, everything after is dropped."""
        L = int(num_keep.max()) if num_keep.numel() else 0
        S0 = self.slot_valid.shape[1] - block
        idx = slots[:, :L].clamp(min=0)  # (B, L)
        keep = torch.arange(L, device=slots.device)[None] < num_keep[:, None]  # (B, L)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (B, kv, S, d)
                g = idx[:, None, :, None].expand(t.shape[0], t.shape[1], L, t.shape[3])
                t[:, :, S0: S0 + L] = t[:, :, S0:].gather(2, g)  # the kept slots, in path order, in place
                setattr(layer, name, t[:, :, : S0 + L])  # a view: no copy of the cache
        self.slot_valid = torch.cat([self.slot_valid[:, :S0], keep], dim=1)
        self.slot_pos = torch.cat([self.slot_pos[:, :S0], self.slot_pos[:, S0:].gather(1, idx)], dim=1)
        self.next_pos += num_keep

    def _crop(self, n: int) -> None:
        self.cache.crop(-n)
        self.slot_valid = self.slot_valid[:, :-n]
        self.slot_pos = self.slot_pos[:, :-n]


@dataclass
class MaskSpec:
    """How this target takes a ready-made 4D mask: one tensor, or a dict per layer type (models
    whose config has `layer_types`); which types are sliding and their window; bool or additive."""

    layer_types: tuple[str, ...] | None  # None: the model takes one tensor
    window: int | None  # sliding window (positions) of "sliding_attention" layers / of every layer
    additive_dtype: torch.dtype | None  # eager attention adds the mask: 0 / finfo.min in this dtype

    def build(self, allowed: Tensor, q_pos: Tensor, k_pos: Tensor):
        """allowed (B, T, S) bool; q_pos (B, T), k_pos (B, S) rotary positions -> the model's mask."""
        def fmt(m: Tensor) -> Tensor:
            m = m[:, None]  # (B, 1, T, S)
            if self.additive_dtype is None:
                return m
            return torch.zeros(m.shape, dtype=self.additive_dtype, device=m.device).masked_fill(
                ~m, torch.finfo(self.additive_dtype).min)

        def windowed() -> Tensor:
            return allowed & (q_pos[:, :, None] - k_pos[:, None, :] < self.window)

        if self.layer_types is None:
            return fmt(windowed() if self.window else allowed)
        return {t: fmt(windowed() if t == "sliding_attention" else allowed) for t in self.layer_types}


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_mask_spec(target) -> MaskSpec:
    cfg = getattr(target.model, "config", None) or target.config
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if impl.startswith("flash") or impl == "flex_attention":
        raise SpecError(f"target attention '{impl}' cannot take the verify loop's tree/hole mask; "
                        "load the target with attn_implementation='sdpa' or 'eager'")
    if types is not None:
        unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
        if unknown:
            raise SpecError(f"target config layer_types {unknown}: the verify loop supports {SUPPORTED_LAYER_TYPES}")
        types = tuple(dict.fromkeys(types))
        window = window if "sliding_attention" in types else None
    if window is not None and (not isinstance(window, int) or window < 1):
        window = None
    return MaskSpec(types, window, target.dtype if impl == "eager" else None)


def left_pad(prompts: list[list[int]], device) -> tuple[Tensor, Tensor]:
    """Token lists -> ids (B, L) left-padded with 0, valid (B, L) bool."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    valid = torch.zeros(len(prompts), L, dtype=torch.bool)
    for b, p in enumerate(prompts):
        if p:
            ids[b, L - len(p):] = torch.tensor(p)
            valid[b, L - len(p):] = True
    return ids.to(device), valid.to(device)


def sample_fn(params: SamplingParams, generators):
    """logits (B, V) -> (tokens (B,), probs (B, V) | None): argmax when greedy, else a per-row draw."""
    if params.greedy:
        return lambda logits: (logits.argmax(-1), None)

    def sample(logits: Tensor) -> tuple[Tensor, Tensor]:
        probs = logits_to_probs(logits, params)  # (B, V) float32
        noise = exponential(probs.shape, generators).to(probs.device)  # (B, V) Exp(1), row b from gen b
        return (probs / noise).argmax(-1), probs  # exponential race: argmin E/p ~ p
    return sample


def check_prompts(prompts: list[list[int]], max_new_tokens: int, ctx: int, extra: int = 0) -> None:
    if not prompts:
        raise SpecError("no prompts to decode")
    if max_new_tokens < 1:
        raise SpecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if not p:
            raise SpecError(f"prompt {i} is empty")
        if len(p) + max_new_tokens + extra > ctx:
            raise SpecError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} (+{extra}) "
                            f"exceeds the target's context of {ctx}")


class _Rows:
    """Per-row outputs and stop bookkeeping (Python lists: B is small, tokens arrive in chunks)."""

    def __init__(self, batch_size: int, max_new_tokens: int, stop_ids, device):
        self.out: list[list[int]] = [[] for _ in range(batch_size)]
        self.max_new = max_new_tokens
        self.stop = set(stop_ids)
        self.active = torch.ones(batch_size, dtype=torch.bool, device=device)
        self._active = [True] * batch_size

    def add(self, b: int, tokens: list[int]) -> None:
        for t in tokens:
            self.out[b].append(t)
            if t in self.stop or len(self.out[b]) >= self.max_new:
                self._active[b] = False
                self.active[b] = False
                return

    @property
    def any_active(self) -> bool:
        return any(self._active)

    def new_tokens(self) -> int:
        return sum(map(len, self.out))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Typical acceptance (lossy)
# ---------------------------------------------------------------------------------------------

ACCEPTANCE_RULES = ("rejection", "typical")
TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3  # Medusa's posterior_threshold / posterior_alpha


def acceptance_label(acceptance: str = "rejection", epsilon: float = TYPICAL_EPSILON,
                     delta: float = TYPICAL_DELTA) -> str:
    """How a report names the rule: 'rejection (lossless)' or 'typical (lossy, eps=..., delta=...)'."""
    if acceptance == "typical":
        return f"typical (lossy, eps={epsilon:g}, delta={delta:g})"
    return "rejection (lossless)"


def check_acceptance(acceptance: str, epsilon: float, delta: float) -> None:
    if acceptance not in ACCEPTANCE_RULES:
        raise SpecError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {acceptance!r}")
    for name, v in (("typical_epsilon", epsilon), ("typical_delta", delta)):
        if not (isinstance(v, (int, float)) and 0.0 <= v < float("inf")):
            raise SpecError(f"{name} must be a finite number >= 0, got {v!r}")


def typical_verify(drafts: Tensor, logits: Tensor, num_draft: Tensor, params: SamplingParams, sample,
                   epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> tuple[Tensor, Tensor]:
    """The verify rule of acceptance="typical" (LOSSY at T > 0), same contract as the rejection sampler.

    drafts (B, w), logits (B, w+1, V) the target's raw logits at the verify positions, num_draft (B,).
    Accepts the longest prefix with p(d_i) > min(epsilon, delta * exp(-H(p_i))), p_i the processed
    target distribution (logits_to_probs: one-hot at T = 0, so exact match there), then takes the
    target's own token at position num_accepted with `sample` (argmax at T = 0, a per-row draw from
    p at T > 0; no residual distribution). Returns (tokens (B, w+1) padded with -1, num_accepted (B,)).
    """
    B, w = drafts.shape
    probs = logits_to_probs(logits[:, :w], params)  # (B, w, V)
    offered = torch.where(torch.arange(w, device=drafts.device)[None] < num_draft[:, None], drafts, -1)
    num_acc = typical_acceptance(offered, probs, epsilon, delta)  # (B,)
    last, _ = sample(logits[torch.arange(B, device=drafts.device), num_acc])  # (B,)
    positions = torch.arange(w + 1, device=drafts.device)[None]  # (1, w+1)
    out = torch.where(positions < num_acc[:, None], torch.nn.functional.pad(drafts, (0, 1), value=-1), -1)
    return out.scatter_(1, num_acc[:, None], last[:, None]), num_acc


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


class SpecDecoder:
    """Target + drafter + verify rule: the draft-verify loop.

    Chain mode (tree=None): the drafter's `draft` proposes k tokens per step, verified by the
    rejection sampler (acceptance="rejection", lossless, sampled drafts with their q) or Medusa's
    typical acceptance (acceptance="typical", LOSSY at T > 0; see the module doc).
    Tree mode (tree=TreeShape): the drafter's `draft_tree` proposes a tree (heads: EAGLE-2 growth;
    HybridDrafter: the head's tree plus a lookup branch), verified in one forward and accepted by
    draftkit.inference.tree.accept_tree (lossless at every temperature).
    """

    def __init__(self, target, head, k: int | None = None, sampler: RejectionSampler | None = None,
                 stop_ids: list[int] | None = None, acceptance: str = "rejection",
                 typical_epsilon: float = TYPICAL_EPSILON, typical_delta: float = TYPICAL_DELTA,
                 tree: TreeShape | None = None):
        check_acceptance(acceptance, typical_epsilon, typical_delta)
        self.acceptance, self.typical_epsilon, self.typical_delta = acceptance, typical_epsilon, typical_delta
        self.tree = tree
        if tree is not None:
            if not hasattr(head, "draft_tree"):
                raise SpecError(f"{getattr(head, 'family', type(head).__name__)} cannot draft trees (no draft_tree)")
            if acceptance != "rejection":
                raise SpecError("tree drafting verifies with the lossless tree walk; acceptance='typical' is chain-only")
            check_tree(head, tree)
            k = max(tree.depth, getattr(head, "max_branch_tokens", 0))
        limit = getattr(head, "max_draft_tokens", None)
        if not isinstance(k, int) or k < 1:
            raise SpecError(f"k (draft tokens per step) must be an integer >= 1, got {k!r}")
        if tree is None and limit is not None and k > limit:
            raise SpecError(f"k={k} is larger than this {getattr(head, 'family', 'drafter')} head supports "
                            f"(max_draft_tokens={limit})")
        self.target, self.head, self.k = target, head, k
        self.sampler = sampler or RejectionSampler("auto")
        self.stop_ids = stop_token_ids(target) if stop_ids is None else list(stop_ids)
        self.layers = tuple(getattr(head, "feature_layers", (FINAL,)))
        self.observer = None  # called with (DraftTree, TreeVerdict) after every tree verify

    @property
    def lossless(self) -> bool:
        return self.acceptance == "rejection"

    @property
    def acceptance_label(self) -> str:
        return acceptance_label(self.acceptance, self.typical_epsilon, self.typical_delta)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128,
                 params: SamplingParams = SamplingParams(), seeds: list[int] | None = None,
                 ) -> tuple[list[list[int]], SpecStats]:
        """Decode every prompt (token ids) in one ragged batch; outputs exclude the prompt."""
        t_start = time.perf_counter()
        k, B, dev = self.k, len(prompts), self.target.device
        check_prompts(prompts, max_new_tokens, context_length(self.target), extra=k + 1)
        stats = SpecStats(k)
        gens = make_generators(seeds if seeds is not None else range(B), dev)
        sample = sample_fn(params, gens)
        rows = _Rows(B, max_new_tokens, self.stop_ids, dev)

        # Prefill: the whole prompt, the first token sampled from the target.
        ids, valid = left_pad(prompts, dev)
        tc = TargetCache(self.target, B, self.layers)
        logits, feats = tc.forward(ids, valid, logits_from=ids.shape[1] - 1)
        tc.commit(valid)
        pending, _ = sample(logits[:, -1])  # (B,)
        for b, t in enumerate(pending.tolist()):
            rows.add(b, [t])
        next_tokens = torch.cat([ids[:, 1:], pending[:, None]], dim=1)  # (B, L): token after each position
        feed_valid = valid
        feats = _no_feats(feats, ids, self.target.dtype)
        state = self.head.new_draft_state(B)
        _sync(dev)
        stats.prefill_s = time.perf_counter() - t_start

        while rows.any_active:
            active = rows.active.clone()
            t0 = time.perf_counter()
            step = self._tree_step if self.tree is not None else self._chain_step
            out, num_acc, path, offered, source, verify_feats, t1 = step(
                state, feats, next_tokens, feed_valid & active[:, None], active, pending, tc, params, gens, sample)
            # Roll back: keep the root (pending) and the accepted path, compacted in path order.
            num_keep = (num_acc + 1) * active
            slots = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)  # (B, D+1) block slots
            tc.commit_path(slots, num_keep, verify_feats.shape[1])
            L = int(num_keep.max())
            pending = out.gather(1, num_acc[:, None])[:, 0]  # (B,) recovered / bonus token
            # The head consumes the kept positions next step: their features and the token after each.
            feats = verify_feats.gather(1, slots[:, :L].clamp(min=0)[..., None].expand(-1, -1, verify_feats.shape[2]))
            next_tokens = out[:, :L].clamp(min=0)
            feed_valid = torch.arange(L, device=dev)[None] < num_keep[:, None]
            _sync(dev)
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            stats.record(offered, num_acc, active, source)
            out_rows, n_rows = out.tolist(), num_acc.tolist()
            for b in active.nonzero()[:, 0].tolist():
                rows.add(b, out_rows[b][: n_rows[b] + 1])

        stats.new_tokens = rows.new_tokens()
        stats.total_s = time.perf_counter() - t_start
        return rows.out, stats

    def _chain_step(self, state, feats, next_tokens, feed_valid, active, pending, tc, params, gens, sample):
        """Draft a chain of k, verify [pending, d_1..d_w] causally, rejection-sample (or typical)."""
        B, dev = active.shape[0], active.device
        # typical acceptance verifies the drafter's top-1 chain; rejection sampling its samples (and q)
        draft_sample = sample_fn(SamplingParams(), gens) if self.acceptance == "typical" else sample
        drafts, dprobs = self.head.draft(state, feats, next_tokens, feed_valid, self.k, draft_sample)
        _sync(dev)
        t1 = time.perf_counter()
        num_draft = (drafts >= 0).long().cumprod(1).sum(1) * active  # (B,)
        w = int(num_draft.max())
        drafts = drafts[:, :w].clamp(min=0)
        if dprobs is not None:
            dprobs = dprobs[:, :w]
        step_ids = torch.cat([pending[:, None], drafts], dim=1)  # (B, w+1)
        ar = torch.arange(w + 1, device=dev)
        step_valid = (ar[None] <= num_draft[:, None]) & active[:, None]
        causal = (ar[None, :] <= ar[:, None]).expand(B, w + 1, w + 1)
        logits, vfeats = tc.verify(step_ids, step_valid, tc.next_pos[:, None] + ar, causal)
        if w and self.acceptance == "typical":  # LOSSY: see typical_verify
            out, num_acc = typical_verify(drafts, logits, num_draft, params, sample,
                                          self.typical_epsilon, self.typical_delta)
        else:  # w == 0 (nothing drafted anywhere) is a plain step: the bonus token drawn from p
            # draw_width=k: each row consumes the same random numbers per step whatever the others drafted
            out, num_acc = self.sampler(drafts, dprobs, logits, num_draft, params, gens, draw_width=self.k)
        ark = torch.arange(self.k, device=dev)[None]
        path = torch.where(ark < num_acc[:, None], ark + 1, -1)  # (B, k) block slots 1..num_acc
        offered = (ark < num_draft[:, None]) & (ark <= num_acc[:, None])
        out = torch.nn.functional.pad(out, (0, self.k + 1 - out.shape[1]), value=-1)
        source = torch.full_like(path, getattr(self.head, "draft_source", SOURCE_HEAD), dtype=torch.uint8)
        return out, num_acc, path, offered, source, _no_feats(vfeats, step_ids, self.target.dtype), t1

    def _tree_step(self, state, feats, next_tokens, feed_valid, active, pending, tc, params, gens, sample):
        """Draft a tree, verify root + nodes in one forward with the ancestor mask, walk it."""
        dev = active.device
        tree = self.head.draft_tree(state, feats, next_tokens, feed_valid, self.tree)
        tree = _mask_rows(tree, active)
        _sync(dev)
        t1 = time.perf_counter()
        step_ids = torch.cat([pending[:, None], tree.tokens.clamp(min=0)], dim=1)  # (B, N+1)
        step_valid = torch.cat([active[:, None], tree.tokens >= 0], dim=1)
        positions = tc.next_pos[:, None] + torch.cat([tree.depth.new_zeros(tree.depth.shape[0], 1), tree.depth], dim=1)
        logits, vfeats = tc.verify(step_ids, step_valid, positions, tree.ancestor_mask())
        noise = None if params.greedy else tree_noise(self.k, logits.shape[-1], gens).to(dev)
        v = accept_tree(tree, logits, params, noise, depth=self.k)
        if self.observer is not None:  # the cost model's acceptance profile (draftkit.inference.cost)
            self.observer(tree, v)
        flags = torch.nn.functional.pad(tree.source, (1, 0))  # (B, N+1) by block slot, root 0
        source = flags.gather(1, v.path.clamp(min=0))  # (B, k) flags of the accepted nodes
        return v.tokens, v.num_accepted, v.path, v.offered, source, _no_feats(vfeats, step_ids, self.target.dtype), t1


def _no_feats(feats: Tensor | None, ids: Tensor, dtype) -> Tensor:
    return feats if feats is not None else ids.new_zeros(*ids.shape, 0, dtype=dtype)


def _mask_rows(tree: DraftTree, active: Tensor) -> DraftTree:
    """Stopped rows offer no nodes."""
    tokens = torch.where(active[:, None], tree.tokens, -1)
    return DraftTree(tokens, tree.parents, tree.depth, torch.where(tokens >= 0, tree.source, 0).to(torch.uint8),
                     tree.score)


def check_tree(head, shape: TreeShape) -> None:
    limit = getattr(head, "max_tree_depth", None)
    if limit is not None and shape.depth > limit:
        raise SpecError(f"tree depth {shape.depth} is deeper than this {getattr(head, 'family', 'drafter')} "
                        f"drafter supports ({limit})")


@dataclass
class PlainStats:
    new_tokens: int = 0
    steps: int = 0
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def __iadd__(self, other: "PlainStats") -> "PlainStats":
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.total_s += other.total_s
        return self


@torch.inference_mode()
def plain_generate(target, prompts: list[list[int]], max_new_tokens: int = 128,
                   params: SamplingParams = SamplingParams(), seeds: list[int] | None = None,
                   stop_ids: list[int] | None = None, record_gaps: bool = False,
                   ) -> tuple[list[list[int]], PlainStats, list[list[tuple[float, float]]] | None]:
    """Plain autoregressive decoding (one target forward per token), the baseline and the reference.

    With record_gaps, also returns for each emitted token (top-1 minus top-2 logit, top-1 logit) at
    that position: how close the choice was, the measure that tells bf16 rounding from a bug.
    """
    t_start = time.perf_counter()
    B, dev = len(prompts), target.device
    check_prompts(prompts, max_new_tokens, context_length(target))
    gens = make_generators(seeds if seeds is not None else range(B), dev)
    sample = sample_fn(params, gens)
    rows = _Rows(B, max_new_tokens, stop_token_ids(target) if stop_ids is None else stop_ids, dev)
    gaps: list[list[tuple[float, float]]] | None = [[] for _ in range(B)] if record_gaps else None
    stats = PlainStats()
    ids, valid = left_pad(prompts, dev)
    tc = TargetCache(target, B)
    logits, _ = tc.forward(ids, valid, logits_from=ids.shape[1] - 1)
    tc.commit(valid)
    while True:
        stats.steps += 1
        tok, _ = sample(logits[:, -1])  # (B,)
        if gaps is not None:
            top2 = logits[:, -1].topk(2, dim=-1).values.tolist()  # (B, 2)
            for b, (first, second) in enumerate(top2):
                if rows._active[b]:
                    gaps[b].append((first - second, first))
        for b, t in enumerate(tok.tolist()):
            if rows._active[b]:
                rows.add(b, [t])
        if not rows.any_active:
            break
        running = rows.active[:, None]  # (B, 1)
        logits, _ = tc.forward(tok[:, None], running)
        tc.commit(running)
    stats.new_tokens = rows.new_tokens()
    stats.total_s = time.perf_counter() - t_start
    return rows.out, stats, gaps


# ---------------------------------------------------------------------------------------------
# Greedy equality check
# ---------------------------------------------------------------------------------------------

# A (k+1)-token forward and a 1-token step round differently. On SmolLM2-135M in bf16 their logits
# differ by up to ~0.75 at top-1 logits of ~26, i.e. ~4 bf16 epsilons of the top-1 magnitude per
# logit; the top-2 *gap* can then move by twice that. A divergence whose gap at that position is
# within NEAR_TIE_EPS epsilons of |top-1| is a near-tie (numerics); one beyond it is a bug.
NEAR_TIE_EPS = 8.0


def near_tie_tolerance(top1: float, dtype: torch.dtype) -> float:
    return NEAR_TIE_EPS * torch.finfo(dtype).eps * max(abs(top1), 1.0)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, len of the shorter one if a prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(outputs: list[list[int]], reference: list[list[int]],
                   gaps: list[list[tuple[float, float]]] | None, dtype: torch.dtype,
                   ids: list | None = None) -> dict:
    """T = 0 outputs vs plain decoding: mismatch count, near-ties, and every divergence."""
    divergences = []
    for r, (out, ref) in enumerate(zip(outputs, reference)):
        i = first_divergence(out, ref)
        if i is None:
            continue
        d = {"prompt": ids[r] if ids else r, "index": i, "got": out[i] if i < len(out) else None,
             "expected": ref[i] if i < len(ref) else None}
        if gaps is not None and i < len(gaps[r]):
            gap, top1 = gaps[r][i]
            tol = near_tie_tolerance(top1, dtype)
            d.update(gap=gap, top1=top1, tolerance=tol, near_tie=gap <= tol)
        divergences.append(d)
    return {"mismatches": len(divergences), "near_ties": sum(bool(d.get("near_tie")) for d in divergences),
            "divergences": divergences}
