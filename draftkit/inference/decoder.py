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

A tree goes through the same step: node i at position next_pos_b + depth_i, seeing the cache and
its ancestors, accepted by the tree walk. The chain is the tree whose node i has parent i-1, so
both share one verify and one commit (SpecDecoder._verify / _commit); only acceptance differs.

Where the parts live: the target's KV cache with holes and its masks in cache.py, the counts and
the T = 0 comparison in stats.py, the verify rules in rejection.py (lossless), typical.py (Medusa's,
lossy) and tree.py (the tree walk).

A drafter may leave positions empty by returning token -1 there (the n-gram drafter does when it
finds no match); that row then drafts fewer tokens this step, and the verify forward is only as
wide as the longest row's draft.

Acceptance rule (`SpecDecoder(acceptance=...)`): "rejection" (default, lossless) or "typical"
(Medusa's, LOSSY at T > 0; draftkit/inference/typical.py).

Draft rule of a chain (`SpecDecoder(draft_sampling=...)`, DRAFT_SAMPLING):
  "sample" (default)  each draft token is drawn from the drafter's q (processed with the same
                      temperature / top-k / top-p) and verified with that q: accept d with
                      probability min(1, p(d)/q(d)), else draw from norm(max(p - q, 0)).
  "greedy"            each draft token is the drafter's argmax, and verification treats q as
                      one-hot on it (RejectionSampler with draft_probs=None, as n-gram drafts are
                      verified): accept d with probability p(d), else draw from p with d removed.
                      LOSSLESS too (a one-hot q is a valid draft distribution: the token is a
                      deterministic function of the context). This is vLLM's default engine rule:
                      SpeculativeConfig.draft_sample_method = "greedy" (vllm/config/speculative.py,
                      vLLM 0.32: "always picks the argmax token, and the draft probabilities are
                      treated as one-hot during rejection sampling"); the proposer takes
                      compute_logits(h).argmax (vllm/v1/spec_decode/llm_base_proposer.py,
                      _greedy_sample) and the rejection sampler runs with draft_probs None
                      (vllm/v1/sample/rejection_sampler.py, NO_DRAFT_PROBS: draft_prob = 1, the
                      recovered token drawn from target_probs with the draft token masked out).
                      It accepts less than "sample" where q is close to p, and measures what an
                      engine serving the head with its defaults will see.
At T = 0 both rules draft the argmax and accept on exact match. Trees always draft the drafter's
top-k children (deterministic), typical acceptance always its top-1 chain: the rule is chain-only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

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

DRAFT_SAMPLING = ("sample", "greedy")  # the chain's draft rule (module doc)


def stop_token_ids(target) -> list[int]:
    """EOS of the config, the generation config and the tokenizer, plus end-of-turn specials."""
    return prompts.stop_token_ids(target.model, target.tokenizer)


def context_length(target) -> int:
    return int(getattr(target.config, "max_position_embeddings", None) or 1 << 30)


def sample_fn(params: SamplingParams, generators):
    """logits (B, n) -> (indices (B,), probs (B, n) | None): argmax when greedy, else a per-row draw, over
    whatever vocabulary it is handed (the target's, or a head's draft vocabulary: heads/base.py)."""
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


@dataclass
class LoopState:
    """What one step hands the next (one `generate` call, B rows)."""

    tc: TargetCache  # the target's KV cache
    params: SamplingParams
    gens: list  # one torch.Generator per row
    sample: Callable  # sample_fn(params, gens): the target's (and a sampling drafter's) draw
    draft_state: Any  # the drafter's own state (head.new_draft_state)
    feats: Tensor  # (B, n, F) target features of the positions confirmed last step
    next_tokens: Tensor  # (B, n) the token after each of those positions
    valid: Tensor  # (B, n) bool: real entries (rows confirm different counts)
    pending: Tensor  # (B,) the newest token (recovered / bonus), not yet fed to the target
    active: Tensor  # (B,) bool: rows still running this step


@dataclass
class Proposal:
    """One step's drafts. A chain of w tokens is the tree whose node i has parent i-1 (depth i+1);
    `probs` (B, w, V) is q of a chain drafted by sampling (the rejection sampler reads it), None
    for one-hot drafts (argmax, lookup) and for every tree."""

    tree: DraftTree
    probs: Tensor | None = None


@dataclass
class Verdict:
    """What one verify decided, per row (D = the loop's k: the deepest a step can accept).

    tokens        (B, D+1) the emitted tokens: accepted drafts, then the recovered / bonus token, -1 pad
    num_accepted  (B,) accepted drafts
    path          (B, D) block slot (1 + node index) of each accepted node in order, -1 pad
    offered       (B, D) bool: the walk stood at depth i with a draft to try (SpecStats.record)
    source        (B, D) uint8 source flags of the accepted nodes (draftkit.inference.tree)
    feats         (B, N+1, F) the target's features at the verify block's slots [root, nodes]
    """

    tokens: Tensor
    num_accepted: Tensor
    path: Tensor
    offered: Tensor
    source: Tensor
    feats: Tensor


class SpecDecoder:
    """Target + drafter + verify rule: the draft-verify loop.

    Chain mode (tree=None): the drafter's `draft` proposes k tokens per step, verified by the
    rejection sampler (acceptance="rejection", lossless: drafts sampled from q and verified with
    it, or with draft_sampling="greedy" the drafter's argmax verified as one-hot, vLLM's default)
    or Medusa's typical acceptance (acceptance="typical", LOSSY at T > 0; see typical.py).
    Tree mode (tree=TreeShape): the drafter's `draft_tree` proposes a tree (heads: EAGLE-2 growth;
    HybridDrafter: the head's tree plus a lookup branch), accepted by the tree walk
    draftkit.inference.tree.accept_tree (lossless at every temperature).
    Both go through one step: draft (a chain is a one-child-per-node tree) -> verify [pending,
    nodes] in one forward with the ancestor mask -> accept (the chain's rule or the walk) ->
    commit the accepted path.
    """

    def __init__(self, target, head, k: int | None = None, sampler: RejectionSampler | None = None,
                 stop_ids: list[int] | None = None, acceptance: str = "rejection",
                 typical_epsilon: float = TYPICAL_EPSILON, typical_delta: float = TYPICAL_DELTA,
                 tree: TreeShape | None = None, draft_sampling: str = "sample"):
        check_acceptance(acceptance, typical_epsilon, typical_delta)
        if draft_sampling not in DRAFT_SAMPLING:
            raise SpecError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {draft_sampling!r}")
        self.draft_sampling = draft_sampling
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
        self.observer = None  # called with (DraftTree, Verdict) after every verify (tree.score: None for a chain)
        self.on_step = None  # called with (DraftTree, draft seconds, verify_step seconds) after every step

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
        B, dev = len(prompts), self.target.device
        check_prompts(prompts, max_new_tokens, context_length(self.target), extra=self.k + 1)
        stats = SpecStats(self.k)
        rows = _Rows(B, max_new_tokens, self.stop_ids, dev)
        s = self._prefill(prompts, params, seeds)
        for b, t in enumerate(s.pending.tolist()):
            rows.add(b, [t])
        _sync(dev)
        stats.prefill_s = time.perf_counter() - t_start

        while rows.any_active:
            s.active = rows.active.clone()
            t0 = time.perf_counter()
            proposal = self._draft(s)
            _sync(dev)
            t1 = time.perf_counter()
            v = self.verify_step(s, proposal)
            _sync(dev)
            t2 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            if self.on_step is not None:  # timing hook (draftkit.inference.cost checks its verify costs by it)
                self.on_step(proposal.tree, t1 - t0, t2 - t1)
            stats.record(v.offered, v.num_accepted, s.active, v.source)
            out_rows, n_rows = v.tokens.tolist(), v.num_accepted.tolist()
            for b in s.active.nonzero()[:, 0].tolist():
                rows.add(b, out_rows[b][: n_rows[b] + 1])

        stats.new_tokens = rows.new_tokens()
        stats.total_s = time.perf_counter() - t_start
        return rows.out, stats

    def _prefill(self, prompts, params: SamplingParams, seeds) -> LoopState:
        """Feed the whole prompt; the first token is the target's own draw."""
        B, dev = len(prompts), self.target.device
        gens = make_generators(seeds if seeds is not None else range(B), dev)
        sample = sample_fn(params, gens)
        ids, valid = left_pad(prompts, dev)  # (B, L)
        tc = TargetCache(self.target, B, self.layers)
        logits, feats = tc.forward(ids, valid, logits_from=ids.shape[1] - 1)
        tc.commit(valid)
        pending, _ = sample(logits[:, -1])  # (B,)
        next_tokens = torch.cat([ids[:, 1:], pending[:, None]], dim=1)  # (B, L): token after each position
        return LoopState(tc, params, gens, sample, self.head.new_draft_state(B),
                         _no_feats(feats, ids, self.target.dtype), next_tokens, valid, pending,
                         torch.ones(B, dtype=torch.bool, device=dev))

    def _draft(self, s: LoopState) -> Proposal:
        """The drafter's chain of k (as a chain tree) or its tree; stopped rows offer nothing."""
        valid = s.valid & s.active[:, None]
        if self.tree is not None:
            return Proposal(_mask_rows(self.head.draft_tree(s.draft_state, s.feats, s.next_tokens, valid, self.tree),
                                       s.active))
        # typical acceptance and the greedy draft rule verify the drafter's top-1 chain (q one-hot,
        # probs None); the sample rule its draws from q, with q
        greedy = self.acceptance == "typical" or self.draft_sampling == "greedy"
        sample = sample_fn(SamplingParams(), s.gens) if greedy else s.sample
        tokens, probs = self.head.draft(s.draft_state, s.feats, s.next_tokens, valid, self.k, sample)  # (B, k)
        source = getattr(self.head, "draft_source", SOURCE_HEAD)
        tree = _mask_rows(DraftTree.chains(tokens, source), s.active)  # a -1 ends a row's chain
        w = int(tree.num_nodes.max())  # the verify is as wide as the longest chain
        tree = DraftTree(tree.tokens[:, :w], tree.parents[:, :w], tree.depth[:, :w], tree.source[:, :w])
        return Proposal(tree, None if probs is None else probs[:, :w])

    def verify_step(self, s: LoopState, p: Proposal) -> Verdict:
        """One step's verify as the loop's verify timer (SpecStats.verify_s) spans it: the forward
        with the ancestor mask, the acceptance rule, the commit of the accepted path. The cost
        model's calibration times this very function (cost._verify_fn)."""
        v = self._verify(s, p)
        self._commit(s, v)
        return v

    def _verify(self, s: LoopState, p: Proposal) -> Verdict:
        """Feed [pending, nodes] in one forward (node at position next_pos + depth, seeing its
        ancestors), then accept with the chain's rule or the tree walk."""
        tree = p.tree
        ids = torch.cat([s.pending[:, None], tree.tokens.clamp(min=0)], dim=1)  # (B, N+1)
        valid = torch.cat([s.active[:, None], tree.tokens >= 0], dim=1)
        positions = s.tc.next_pos[:, None] + torch.nn.functional.pad(tree.depth, (1, 0))  # root at depth 0
        logits, feats = s.tc.verify(ids, valid, positions, tree.ancestor_mask())  # (B, N+1, V)
        accept = self._accept_tree if self.tree is not None else self._accept_chain
        tokens, num_acc, path, offered = accept(tree, p.probs, logits, s)
        flags = torch.nn.functional.pad(tree.source, (1, 0))  # (B, N+1) by block slot, root 0
        v = Verdict(tokens, num_acc, path, offered, flags.gather(1, path.clamp(min=0)),
                    _no_feats(feats, ids, self.target.dtype))
        if self.observer is not None:  # the cost model's acceptance profile (draftkit.inference.cost)
            self.observer(tree, v)
        return v

    def _accept_tree(self, tree: DraftTree, probs, logits: Tensor, s: LoopState):
        """The lossless walk (tree.py); its noise is drawn for the full depth k every step."""
        noise = None if s.params.greedy else tree_noise(self.k, logits.shape[-1], s.gens).to(logits.device)
        w = accept_tree(tree, logits, s.params, noise, depth=self.k)
        return w.tokens, w.num_accepted, w.path, w.offered

    def _accept_chain(self, tree: DraftTree, probs: Tensor | None, logits: Tensor, s: LoopState):
        """Rejection sampling with q (or one-hot drafts), or typical acceptance, over a chain tree."""
        drafts, num_draft = tree.tokens.clamp(min=0), tree.num_nodes  # (B, w), (B,)
        if drafts.shape[1] and self.acceptance == "typical":  # LOSSY: see typical_verify
            out, num_acc = typical_verify(drafts, logits, num_draft, s.params, s.sample,
                                          self.typical_epsilon, self.typical_delta)
        else:  # w == 0 (nothing drafted anywhere) is a plain step: the bonus token drawn from p
            # draw_width=k: each row consumes the same random numbers per step whatever the others drafted
            out, num_acc = self.sampler(drafts, probs, logits, num_draft, s.params, s.gens, draw_width=self.k)
        ark = torch.arange(self.k, device=drafts.device)[None]
        path = torch.where(ark < num_acc[:, None], ark + 1, -1)  # (B, k): node i sits in block slot i+1
        offered = (ark < num_draft[:, None]) & (ark <= num_acc[:, None])
        return torch.nn.functional.pad(out, (0, self.k + 1 - out.shape[1]), value=-1), num_acc, path, offered

    def _commit(self, s: LoopState, v: Verdict) -> None:
        """Roll back: keep the root (pending) and the accepted path, compacted in path order; the
        drafter consumes the kept positions next step (their features and the token after each)."""
        num_keep = (v.num_accepted + 1) * s.active
        slots = torch.cat([torch.zeros_like(v.path[:, :1]), v.path], dim=1)  # (B, D+1) block slots
        s.tc.commit_path(slots, num_keep, v.feats.shape[1])
        L = int(num_keep.max())
        s.pending = v.tokens.gather(1, v.num_accepted[:, None])[:, 0]  # (B,) recovered / bonus token
        s.feats = v.feats.gather(1, slots[:, :L].clamp(min=0)[..., None].expand(-1, -1, v.feats.shape[2]))
        s.next_tokens = v.tokens[:, :L].clamp(min=0)
        s.valid = torch.arange(L, device=slots.device)[None] < num_keep[:, None]


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
                   on_step: Callable[[], object] | None = None,
                   ) -> tuple[list[list[int]], PlainStats, list[list[tuple[float, float]]] | None]:
    """Plain autoregressive decoding (one target forward per token), the baseline and the reference.

    With record_gaps, also returns for each emitted token (top-1 minus top-2 logit, top-1 logit) at
    that position: how close the choice was (informative; whether a divergence is rounding is
    decided by stats.compare_greedy's teacher-forced criterion). on_step is called as each step
    starts (after the prefill, then after each forward): the gaps between calls are the steps'
    wall times (timing.plain_step_median_ms).
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
        if on_step is not None:
            on_step()
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
