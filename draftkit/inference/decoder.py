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

Where the parts live: the target's KV cache with holes and its masks in cache.py, the counts and
the T = 0 comparison in stats.py, the verify rules in rejection.py (lossless), typical.py (Medusa's,
lossy) and tree.py (the tree walk).

A drafter may leave positions empty by returning token -1 there (the n-gram drafter does when it
finds no match); that row then drafts fewer tokens this step, and the verify forward is only as
wide as the longest row's draft.

Acceptance rule (`SpecDecoder(acceptance=...)`): "rejection" (default, lossless) or "typical"
(Medusa's, LOSSY at T > 0; draftkit/inference/typical.py).
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from draftkit import prompts
from draftkit.inference.cache import TargetCache, left_pad
from draftkit.inference.errors import SpecError
from draftkit.inference.rejection import RejectionSampler
from draftkit.inference.sampling import SamplingParams, exponential, logits_to_probs, make_generators
from draftkit.inference.stats import PlainStats, SpecStats
from draftkit.inference.tree import SOURCE_HEAD, DraftTree, TreeShape, accept_tree, tree_noise
from draftkit.inference.typical import TYPICAL_DELTA, TYPICAL_EPSILON, acceptance_label, check_acceptance, typical_verify
from draftkit.target import FINAL


def stop_token_ids(target) -> list[int]:
    """EOS of the config, the generation config and the tokenizer, plus end-of-turn specials."""
    return prompts.stop_token_ids(target.model, target.tokenizer)


def context_length(target) -> int:
    return int(getattr(target.config, "max_position_embeddings", None) or 1 << 30)


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
