"""Draft sizes chosen from measured cost: what `draftkit eval --draft auto` runs.

The model has two halves, both measured on the machine at hand (batch 1, the target's dtype):

Tokens per step, from traces. A calibration prompt is decoded by plain decoding (`plain_generate`,
at the requested temperature): its output y is the trajectory. At EVERY position i of y (the step
that would start with y[i] pending) the trace keeps the lookup proposal for every lookup length
(NgramDrafter.propose on the same history the loop's lookup sees) and, for every topk, the head's
whole EAGLE-2 candidate pool of depth D, ranked by score (the head fed exactly what the loop feeds
it: every confirmed position's feature and next token, teacher-forced from one target forward over
y). A tree of (topk, depth d <= D, budget b) keeps the b best pool nodes of depth <= d (growth to
depth d is the same in both, and the pool is ranked as `tree._select` ranks it), so every
candidate's tree at every position is known exactly, lookup's branch for its own length included.
- The run is simulated exactly, at every temperature: at position i a candidate accepts the longest
  prefix of y[i+1:] that its tree holds, and the next step starts at i + accepted + 1. Its steps and
  verify widths are those of a real run whose output is y (tests/test_cost.py checks both against
  the loop). At T = 0 every shape's output IS y (the walk accepts the longest path of target
  argmaxes). At T > 0 the tree walk (tree.py) draws each token from the target's own distribution
  and descends while the draw is a child, and lookup alone's chain accepts a one-hot draft exactly
  when p's draw is that token: so the loop's output is a plain sample, and a run whose output is y
  accepts the longest prefix of y in each step's tree. A sampled y is therefore the trajectory of a
  real run, and the simulation on it that run's steps (an unbiased estimate of the expected steps;
  the law of y is the same whatever the shape). The model before weighted every position of y by
  the expected reach of each node (prod p along its path) through a renewal over positions; that
  treats the step at i as independent of which tokens y holds after i, where in a run a step spans
  i + 1..i + a exactly when those tokens are its drafts. It put steps after draft-matching tokens
  (where the next draft is easy), and over-predicted tau by 0.10-0.12 on an AMX CPU at T = 1, on the
  measured prompts' own traces too (results/cost_model_accuracy_amx_bf16_depth_overhead_calib16.json).

Cost per step, from timings: the loop's own verify step of w tokens (SpecDecoder.verify_step, the
function the loop's verify timer spans: ancestor mask, forward on the loop's cache, walk, commit;
timed greedy on a LoopState of the calibration context), the head's tree drafting per (topk,
depth) (or only consuming the confirmed positions), the lookup's proposal and merge, the loop's own
overhead (bookkeeping between the parts: the median residual of a real run of the loop, measured for
a depth-1 tree, a mid-size hybrid and lookup alone: Costs.overhead) and, at T > 0, the noise rows a
step draws (the walk's k + 1, a lookup chain's sampler one: Candidate.noise_rows). Plain decoding's
step is timed with plain_generate itself and priced the same way: its minimum plus the median
residual of a real plain run (Costs.plain_step). Every cost is measured in several interleaved rounds
and the minimum kept (load from other processes only ever adds time: inference/timing.py, which the
decode-stage dtype choice times with too); the profile is checked for consistency and `warnings`
says where it is not.

The pick maximises the predicted speedup (mean over the requested temperatures) for runs of
auto_draft's run_tokens new tokens, a trace cut short standing for the whole run at its own rate
(predict); where no shape's
prediction exceeds PAYS the choice is plain decoding. When the prompts carry two or more categories,
the same pick is made on each category's traces alone (choose_per_category) and reported beside the
global one (which it does not change): plain decoding where nothing pays in that category.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from draftkit.inference.cache import TargetCache, left_pad
from draftkit.inference.decoder import Proposal, SpecDecoder, plain_generate
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.errors import SpecError
from draftkit.inference.ngram import NgramDrafter
from draftkit.inference.sampling import SamplingParams, make_generators
from draftkit.inference.timing import min_times, plain_runs, plain_step_median_ms, plain_step_ms
from draftkit.inference.tree import DraftTree, TreeShape, add_branches, tree_noise

VERIFY_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80)
BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LOOKUP_LENS = (0, 4, 6, 8, 10)
MIN_TRACE_TOKENS = 16  # breadth before length (_Calibrating.traces): no calibration trace shorter than this
HEAD_OFF = (None, 2, 4, 6)
PAYS = 1.05  # a shape is chosen over plain decoding only when predicted this much faster
OTHERS_CORES = 0.1  # other processes' mean CPU use (cores) above which timings are said to include them
INF = 1 << 30


# ---------------------------------------------------------------------------------------------
# Traces: what every candidate's tree would be at every position
# ---------------------------------------------------------------------------------------------


@dataclass
class Position:
    """The step that starts with y[i] pending: lookup's proposals by length, and per topk the
    head's candidate pool best first as (path of tokens from the root, depth)."""

    branches: dict[int, list[int]]
    ranked: dict[int, list[tuple[tuple[int, ...], int]]]
    _memo: dict = field(default_factory=dict, repr=False)

    def level(self, topk: int, depth: int) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], int]]:
        """Pool nodes of depth <= depth, best first, and each one's rank among them."""
        key = (topk, depth)
        if key not in self._memo:
            paths = [p for p, d in self.ranked[topk] if d <= depth]
            self._memo[key] = (paths, {p: r for r, p in enumerate(paths)})
        return self._memo[key]


@dataclass
class Trace:
    """One calibration prompt decoded at `temperature`: output y and a Position per step start."""

    prompt_len: int
    tokens: list[int]
    temperature: float
    positions: list[Position]
    plain_s: float = 0.0  # the plain_generate run that produced y (wall time, prefill included)
    prefill_ms: float = 0.0  # plain_generate of one token on this prompt (both methods' prefill)
    head_prefill_ms: float = 0.0  # the head reading the prompt (the first speculative step's extra)
    category: str | None = None  # the prompt's category (choose_per_category), None: not given


def rank_pool(tree: DraftTree) -> list[tuple[tuple[int, ...], int]]:
    """(1, N) tree -> [(path, depth)] by score, best first, ties to the earlier node (tree._select's order)."""
    toks, pars, deps = (x[0].tolist() for x in (tree.tokens, tree.parents, tree.depth))
    scores = tree.score[0].tolist()
    paths: list[tuple[int, ...]] = []
    for t, p in zip(toks, pars):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    order = sorted((i for i, t in enumerate(toks) if t >= 0 and math.isfinite(scores[i])), key=lambda i: -scores[i])
    return [(paths[i], deps[i]) for i in order]


def pool_shape(topk: int, depth: int) -> TreeShape:
    """The shape whose tree is the whole candidate pool (budget = every candidate)."""
    return TreeShape(topk, depth, topk + (depth - 1) * topk * topk)


def _branches(lookup: NgramDrafter, prompt: list[int], y: list[int], i: int, lens) -> dict[int, list[int]]:
    # the loop's lookup history: the prompt from its second token on (prefill feeds next tokens), then y[:i+1]
    hist = list(prompt[1:]) + list(y[: i + 1])
    return {L: lookup.propose(hist, L) for L in lens if L}


@torch.inference_mode()
def trace_prompt(target, head, prompt: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                 topks, depth: int, lookup_lens=LOOKUP_LENS, lookup_ngram: int = 3, stop_ids=None,
                 tokens: list[int] | None = None) -> Trace:
    """Decode `prompt` plainly at `params` and record every position's drafts (module doc); with
    `tokens`, record them for that output instead (a run's own output; plain decoding is not run,
    plain_s is 0)."""
    t = time.perf_counter()
    if tokens is None:
        out, _, _ = plain_generate(target, [prompt], max_new_tokens, params, [seed], stop_ids)
        y, plain_s = out[0], time.perf_counter() - t
    else:
        y, plain_s = list(tokens), 0.0
    t = time.perf_counter()
    plain_generate(target, [prompt], 1, params, [seed], stop_ids)
    prefill_ms = 1e3 * (time.perf_counter() - t)
    lookup = NgramDrafter(max_n=lookup_ngram)
    positions = [Position(_branches(lookup, prompt, y, i, lookup_lens), {}) for i in range(len(y) - 1)]
    dev = target.device
    P = len(prompt)
    ids, valid = left_pad([prompt], dev)
    tc = TargetCache(target, 1, head.feature_layers)  # teacher-forced features of every position at once
    _, feats = tc.forward(torch.tensor([list(prompt) + y[:-1]], device=dev),
                          torch.ones(1, P + len(y) - 1, dtype=torch.bool, device=dev))
    for k in topks:
        _head_pools(head, positions, k, depth, ids, valid, y, feats)
    nxt = torch.cat([ids[:, 1:], ids.new_tensor([[y[0]]])], 1)
    t = time.perf_counter()
    head.tree_root(head.new_draft_state(1), feats[:, :P], nxt, valid)
    head_ms = 1e3 * (time.perf_counter() - t)
    return Trace(P, y, float(params.temperature), positions, plain_s, prefill_ms, head_ms)


def _head_pools(head, positions, k, depth, ids, valid, y, feats) -> None:
    """The head's pool at every position, fed the teacher-forced features (1, P + n - 1, F)
    as the loop feeds them: the prompt's at the first step, then position P + i - 1 and y[i]."""
    state = head.new_draft_state(1)
    P, one = ids.shape[1], torch.ones(1, 1, dtype=torch.bool, device=ids.device)
    for i, pos in enumerate(positions):
        if i == 0:
            nxt = torch.cat([ids[:, 1:], ids.new_tensor([[y[0]]])], 1)
            tree = head.draft_tree(state, feats[:, :P], nxt, valid, pool_shape(k, depth))
        else:
            tree = head.draft_tree(state, feats[:, P + i - 1: P + i], ids.new_tensor([[y[i]]]), one,
                                   pool_shape(k, depth))
        pos.ranked[k] = rank_pool(tree)


# ---------------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A draft shape: the head's tree (topk, depth, budget; topk 0 = no head) and lookup's branch."""

    topk: int
    depth: int
    budget: int
    lookup_len: int = 0
    head_off_at: int | None = None

    @property
    def loop_depth(self) -> int:
        """The loop's k: the deepest branch (a tree walk's noise rows per step are k + 1: noise_rows)."""
        return max(self.depth if self.topk else 0, self.lookup_len)

    @property
    def chain(self) -> bool:
        """Lookup alone: the loop runs the chain path (DraftSettings.decoder_args), not the tree walk."""
        return not self.topk

    @property
    def noise_rows(self) -> int:
        """T > 0: vocabulary rows of 1/Exp(1) noise a step of c draws. The tree walk draws k + 1
        every step (tree_noise, a fixed amount whatever was drafted); lookup alone runs the chain path,
        whose rejection sampler draws one, for the recovered or bonus token (its k accept uniforms
        cost nothing beside it). Priced at k + 1, a lookup chain's step came out 5.3 ms (12%) cheaper
        than it ran (AMX, bf16, T = 1, lookup 4: 38.3 vs 43.6 ms), and its probe's overhead negative."""
        return 1 if self.chain else self.loop_depth + 1

    def settings(self, base: DraftSettings) -> DraftSettings:
        if self.chain:
            return replace(base, mode="lookup", lookup_len=self.lookup_len)
        return replace(base, mode="hybrid" if self.lookup_len else "tree", topk=self.topk, depth=self.depth,
                       budget=self.budget, lookup_len=self.lookup_len or base.lookup_len,
                       head_off_at=self.head_off_at if self.lookup_len else None)

    def label(self) -> str:
        if not self.topk:
            return f"lookup {self.lookup_len}"
        s = f"tree {self.topk}x{self.depth} b{self.budget}"
        if self.lookup_len:
            s += f" + lookup {self.lookup_len}" + (f" (head off at {self.head_off_at})" if self.head_off_at else "")
        return s


def _verified(pos: Position, c: Candidate):
    """What c verifies at pos: (head's kept paths, lookup's paths not among them, lookup's branch,
    the head's ranks, verify width, head drafted?)."""
    branch = pos.branches.get(c.lookup_len, []) if c.lookup_len else []
    head_on = bool(c.topk) and not (c.head_off_at and len(branch) >= c.head_off_at)
    paths, rank = pos.level(c.topk, c.depth) if head_on else ([], {})
    kept = paths[: min(c.budget, len(paths))]
    branch_new = [tuple(branch[:j]) for j in range(1, len(branch) + 1) if rank.get(tuple(branch[:j]), INF) >= c.budget]
    return kept, branch_new, branch, rank, len(kept) + len(branch_new) + 1, head_on


def position_step(pos: Position, future: list[int], c: Candidate) -> tuple[int, int, bool]:
    """(accepted drafts, verify width, head drafted?) of c's step at pos, in a run whose output
    after the pending token is `future` (module doc: at every temperature)."""
    kept, branch_new, branch, rank, width, head_on = _verified(pos, c)
    acc_head = 0
    while acc_head < len(future) and rank.get(tuple(future[: acc_head + 1]), INF) < c.budget:
        acc_head += 1
    acc_lookup = 0
    while acc_lookup < min(len(branch), len(future)) and branch[acc_lookup] == future[acc_lookup]:
        acc_lookup += 1
    return max(acc_head, acc_lookup), width, head_on


def simulate(trace: Trace, c: Candidate) -> list[tuple[int, int, bool]]:
    """The steps of c in a run whose output is the trace's: per step (tokens emitted, verify width,
    head drafted?). Every step starts where the last one ended (module doc)."""
    n, y = len(trace.tokens), trace.tokens
    steps, i = [], 0
    while i < n - 1:
        acc, w, h = position_step(trace.positions[i], y[i + 1:], c)
        steps.append((acc + 1, w, h))
        i += acc + 1
    return steps


def simulated_steps(trace: Trace, c: Candidate) -> float:
    """Verify steps c needs for the trace's output."""
    return len(simulate(trace, c))


# ---------------------------------------------------------------------------------------------
# Costs
# ---------------------------------------------------------------------------------------------


@dataclass
class Costs:
    """Milliseconds on this machine at one temperature (module doc)."""

    verify_ms: dict[int, float]
    draft_ms: dict[tuple[int, int], float]  # (topk, depth) -> ms
    consume_ms: float  # the head reading the confirmed positions only (a head-off hybrid step)
    plain_step_ms: float  # one plain_generate step (forward + sampling)
    plain_prefill_ms: float  # plain_generate of one token on the calibration context
    head_prefill_ms: float = 0.0  # the head reading the calibration context (the first draft's extra)
    noise_ms_per_row: float = 0.0  # T > 0: one 1/Exp(1) row over the vocabulary (Candidate.noise_rows a step)
    lookup_ms: float = 0.0  # lookup's proposal and merge per step
    overhead_ms: float = 0.0  # per step beyond forward, drafting and noise (walk, roll-back, bookkeeping)
    lookup_overhead_ms: float | None = None  # the same for lookup alone (the chain path); None: overhead_ms
    overhead_depth: int = 0  # the head depth of the probe overhead_ms is measured with (0: priced at every depth)
    shallow_overhead_ms: float | None = None  # the same for a depth-1 tree of the head (overhead())
    temperature: float = 0.0
    plain_run_ms: float = 0.0  # plain_generate of 1 + plain_tokens tokens (plain_step_ms is the difference)
    plain_tokens: int = 8
    plain_overhead_ms: float = 0.0  # a real plain run's median step beyond plain_step_ms (plain_step)

    def plain_step(self) -> float:
        """ms a plain step is priced at against the loop's: its timed minimum plus the median residual
        of a real plain run, as the loop's steps are their parts' minima plus the median residual of a
        real loop run (overhead_ms). Priced at the minimum alone, plain decoding was cheaper than any
        run of it on a noisy machine and every shape 7-18% pessimistic (an AVX2 VM, README)."""
        return self.plain_step_ms + self.plain_overhead_ms

    def verify(self, width: int) -> float:
        """Linear interpolation in the measured widths (the last slope beyond them)."""
        ws = sorted(self.verify_ms)
        if width <= ws[0]:
            return self.verify_ms[ws[0]]
        for a, b in zip(ws, ws[1:]):
            if width <= b:
                return self.verify_ms[a] + (self.verify_ms[b] - self.verify_ms[a]) * (width - a) / (b - a)
        a, b = ws[-2], ws[-1]
        return self.verify_ms[b] + (self.verify_ms[b] - self.verify_ms[a]) * (width - b) / (b - a)

    def overhead(self, c: Candidate) -> float:
        """ms a step of c runs beyond its timed parts: lookup alone its own probe's (the chain path);
        a tree the probes' at head depth 1 and overhead_depth, linear in c's depth between them and the
        deep probe's beyond it. The residual grows with the head's depth (the head reads more accepted
        positions a step, the walk visits more levels): priced at the one mid-size probe, depth-1 trees
        at T = 1 came out 2-5 ms a step dearer than they ran (AMX, bf16: tree 8x1 b6 54.9 vs 51.1 ms),
        4 of 4 runs, one of them 11.7% pessimistic."""
        if c.chain and self.lookup_overhead_ms is not None:
            return self.lookup_overhead_ms
        if self.shallow_overhead_ms is None or self.overhead_depth <= 1:
            return self.overhead_ms
        f = (min(max(c.depth, 1), self.overhead_depth) - 1) / (self.overhead_depth - 1)
        return self.shallow_overhead_ms + f * (self.overhead_ms - self.shallow_overhead_ms)

    def parts(self, c: Candidate, width: float, head_on: bool) -> float:
        """ms of one step of c with this verify width from its timed parts alone: drafting (or the
        head consuming), lookup, the verify step and, at T > 0, the noise rows."""
        draft = (self.draft_ms[(c.topk, c.depth)] if head_on else self.consume_ms) if c.topk else 0.0
        noise = self.noise_ms_per_row * c.noise_rows if self.temperature > 0 else 0.0
        return draft + (self.lookup_ms if c.lookup_len else 0.0) + self.verify(width) + noise

    def step(self, c: Candidate, width: float, head_on: bool) -> float:
        """ms of one speculative step of c with this verify width."""
        return self.parts(c, width, head_on) + self.overhead(c)


def predict(traces: list[Trace], costs: Costs, c: Candidate, new_tokens: int | None = None) -> dict:
    """c's predicted tau, ms per step and speedup over plain decoding on the traces' prompts
    (prefill included on both sides, as eval's tokens/s are), for runs of `new_tokens` new tokens
    per prompt: each trace's steps stand for that many tokens at the trace's own rate (None: each
    trace's own length). A trace the calibration budget cut to 16 of 64 tokens would otherwise
    weigh its prefill four times as much as the run does and pull every prediction towards 1x."""
    spec_ms = plain_ms = steps_total = tokens = decode_ms = 0.0
    for tr in traces:
        steps = simulate(tr, c)
        n_steps = len(steps)
        scale = (new_tokens - 1) / (len(tr.tokens) - 1) if new_tokens and len(tr.tokens) > 1 else 1.0
        decode = sum(costs.step(c, w, h) for _, w, h in steps)
        spec_ms += tr.prefill_ms + (tr.head_prefill_ms if c.topk else 0.0) + scale * decode
        plain_ms += tr.prefill_ms + scale * (len(tr.tokens) - 1) * costs.plain_step()
        steps_total += n_steps
        tokens += len(tr.tokens) - 1
        decode_ms += decode
    return {"tau": tokens / steps_total if steps_total else 1.0,
            "ms_per_step": decode_ms / max(steps_total, 1e-9),
            "speedup": plain_ms / spec_ms if spec_ms else 0.0}


def candidates(topks, max_depth: int, budgets=BUDGETS, lookup_lens=LOOKUP_LENS, head_off=HEAD_OFF,
               depths=None, lookup_alone: bool = True) -> list[Candidate]:
    """Every shape the traces can simulate: trees cut from each topk's pool (depth <= max_depth,
    or the given depths), with and without lookup's branch, and lookup alone."""
    out = [Candidate(0, 0, 0, L) for L in lookup_lens if L] if lookup_alone else []
    for k in topks:
        for d in depths or range(1, max_depth + 1):
            for b in budgets:
                if b > k + (d - 1) * k * k or (k == 1 and b != d):
                    continue
                for L in lookup_lens:
                    for off in head_off if L else (None,):
                        if off is None or off <= L:
                            out.append(Candidate(k, d, b, L, off))
    return out


FIXABLE = ("topk", "depth", "budget", "lookup_len", "head_off_at")  # DraftSettings fields a flag can fix


@dataclass(frozen=True)
class SearchSpace:
    """What calibration may choose from: the fields the user fixed (DraftSettings names, FIXABLE)
    hold one value, the mode their flags imply ("tree": no lookup branch, "hybrid": head and
    lookup; None: anything, lookup alone and plain decoding included); every other field ranges
    over the defaults. Every candidate it yields, and so every one measured, has the fixed values."""

    fixed: dict = field(default_factory=dict)
    mode: str | None = None
    topks: tuple = (1, 2, 4, 8)
    max_depth: int = 6

    def __post_init__(self):
        bad = sorted(set(self.fixed) - set(FIXABLE))
        if bad or self.mode not in (None, "tree", "hybrid"):
            raise ValueError(f"calibration can fix {', '.join(FIXABLE)} in mode tree or hybrid, got {bad or self.mode}")

    @property
    def any_mode(self) -> bool:
        """Nothing fixed: lookup alone and plain decoding may be chosen."""
        return self.mode is None and not self.fixed

    def axes(self, head_limit: int) -> dict:
        """topks, depth (traced to), depths, budgets, lookup_lens, head_off of the search; head_limit:
        the deepest tree the head drafts (a fixed depth beyond it is an error naming it)."""
        f = self.fixed
        if f.get("depth", 0) > head_limit:
            raise SpecError(f"calibration: depth {f['depth']} was fixed but the head drafts at most {head_limit} levels")
        depth = f.get("depth") or min(self.max_depth, head_limit)
        if "lookup_len" in f:
            lens = (f["lookup_len"],)
        else:
            lens = {"tree": (0,), "hybrid": tuple(L for L in LOOKUP_LENS if L)}.get(self.mode, LOOKUP_LENS)
        if self.mode == "tree" and ("lookup_len" in f or "head_off_at" in f):
            raise SpecError("calibration: mode tree has no lookup branch, but lookup_len/head_off_at were fixed")
        return {"topks": (f["topk"],) if "topk" in f else tuple(self.topks), "depth": depth,
                "depths": (depth,) if "depth" in f else None, "budgets": (f["budget"],) if "budget" in f else BUDGETS,
                "lookup_lens": lens, "head_off": (f["head_off_at"],) if "head_off_at" in f else HEAD_OFF}

    def candidates(self, head_limit: int) -> list[Candidate]:
        """The candidates of the space (never empty: an impossible combination is an error)."""
        a = self.axes(head_limit)
        out = [c for c in candidates(a["topks"], a["depth"], a["budgets"], a["lookup_lens"], a["head_off"],
                                     a["depths"], lookup_alone=self.any_mode)
               if self.mode != "hybrid" or c.lookup_len]
        if not out:
            raise SpecError(f"calibration: no draft shape has {_words(self.fixed)}"
                            + (f" in mode {self.mode}" if self.mode else "")
                            + " (a tree of topk k and depth d holds at most k + (d - 1) k^2 nodes; a chain, "
                              "topk 1, exactly d; head_off_at <= lookup_len)")
        return out


def _words(fixed: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fixed.items()) or "nothing fixed"


def choose(traces_by_t: dict[float, list[Trace]], costs_by_t: dict[float, Costs], cands: list[Candidate],
           pays: float = PAYS, new_tokens: int | None = None) -> tuple[Candidate | None, list[dict]]:
    """Rank the candidates by predicted speedup (mean over temperatures) for runs of `new_tokens`
    (predict); None = plain decoding (no candidate is predicted faster than `pays` x plain).
    Returns (choice, ranked rows)."""
    rows = []
    for c in cands:
        per_t = {t: predict(traces_by_t[t], costs_by_t[t], c, new_tokens) for t in traces_by_t}
        mean = sum(p["speedup"] for p in per_t.values()) / len(per_t)
        rows.append({"candidate": c, "label": c.label(), "speedup": mean,
                     "by_temperature": {f"{t:g}": {key: round(v, 4) for key, v in p.items()} for t, p in per_t.items()}})
    rows.sort(key=lambda r: -r["speedup"])
    return (rows[0]["candidate"] if rows and rows[0]["speedup"] > pays else None), rows


def choose_per_category(traces_by_t: dict[float, list[Trace]], costs_by_t: dict[float, Costs],
                        cands: list[Candidate], pays: float = PAYS, new_tokens: int | None = None) -> dict[str, dict]:
    """choose() on each prompt category's traces alone (the same costs, candidates, floor and length):
    {category: {"prompts", "choice" (the Candidate's fields, None = plain decoding), "shape" (its
    label or "plain decoding"), "speedup" (the choice's mean prediction, 1.0 for plain), "best",
    "best_speedup" (the ranking's first row, chosen or not), "by_temperature"}}, categories sorted;
    {} when the traces carry fewer than two categories (the global choice says it all).
    A temperature that traced none of a category's prompts (a budget cut) is left out of its mean."""
    cats = sorted({tr.category for trs in traces_by_t.values() for tr in trs if tr.category is not None})
    if len(cats) < 2:
        return {}
    out = {}
    for cat in cats:
        sub = {t: [tr for tr in trs if tr.category == cat] for t, trs in traces_by_t.items()}
        sub = {t: trs for t, trs in sub.items() if trs}
        choice, rows = choose(sub, {t: costs_by_t[t] for t in sub}, cands, pays, new_tokens)
        best = rows[0] if rows else None
        out[cat] = {"prompts": max(len(trs) for trs in sub.values()),
                    "choice": None if choice is None else asdict(choice),
                    "shape": "plain decoding" if choice is None else choice.label(),
                    "speedup": round(best["speedup"], 4) if choice is not None else 1.0,
                    "best": best["label"] if best else None,
                    "best_speedup": round(best["speedup"], 4) if best else None,
                    "by_temperature": best["by_temperature"] if choice is not None else
                    {f"{t:g}": {"tau": 1.0, "speedup": 1.0} for t in sub}}
    return out


# ---------------------------------------------------------------------------------------------
# Measuring the costs
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def measure_costs(target, head, context: list[int], topks, depth: int, params: SamplingParams, rounds: int = 5,
                  widths=VERIFY_WIDTHS, plain_tokens: int = 8, tick=None, warmup: bool = True) -> Costs:
    """Time every cost of the model on `context` (interleaved rounds, minimum kept)."""
    dev = target.device
    dec = _verify_decoder(target, head)
    s = dec._prefill([context], SamplingParams(), [0])  # the loop's own state on the context (greedy: module doc)
    feats, nxt, valid = s.feats, s.next_tokens, s.valid
    state = head.new_draft_state(1)
    head.tree_root(state, feats, nxt, valid)  # the context is in the head's cache; then one position a step
    one_f, one_t, one_v = feats[:, -1:], nxt[:, -1:], valid[:, -1:]
    items = {("verify", w): _verify_fn(dec, s, w) for w in widths}
    for k in topks:
        for d in range(1, depth + 1):
            items[("draft", k, d)] = (lambda k=k, d=d: head.draft_tree(state, one_f, one_t, one_v, TreeShape(k, d, k)))
    items["consume"] = lambda: head.tree_root(state, one_f, one_t, one_v)
    items["head_prefill"] = lambda: head.tree_root(head.new_draft_state(1), feats, nxt, valid)
    lookup, tree = NgramDrafter(), head.draft_tree(state, one_f, one_t, one_v, TreeShape(4, min(3, depth), 16))
    items["lookup"] = lambda: add_branches(tree, [lookup.propose(context, max(LOOKUP_LENS))])  # HybridDrafter's extra
    items["plain1"], items["plainN"] = plain_runs(target, context, plain_tokens, params)
    rows = 10
    if not params.greedy:
        gens = make_generators([0], dev)
        items["noise"] = lambda: tree_noise(rows - 1, target.vocab_size, gens)
    ms = min_times(items, rounds, tick, warmup)
    return Costs({w: ms[("verify", w)] for w in widths}, {key[1:]: v for key, v in ms.items() if key[0] == "draft"},
                 ms["consume"], plain_step_ms(ms["plain1"], ms["plainN"], plain_tokens), ms["plain1"],
                 ms["head_prefill"],
                 noise_ms_per_row=ms.get("noise", 0.0) / rows, temperature=float(params.temperature),
                 plain_run_ms=ms["plainN"], plain_tokens=plain_tokens, lookup_ms=ms["lookup"])


def _verify_decoder(target, head) -> SpecDecoder:
    """A tree-mode loop as the candidates' (its k, the walk's depth bound, is lookup's longest
    branch, the deepest a candidate drafts); its drafter is never asked: calibration hands
    verify_step its trees."""
    from draftkit.inference.drafters import HybridDrafter

    return SpecDecoder(target, HybridDrafter(head, NgramDrafter(), max(LOOKUP_LENS)), tree=TreeShape(1, 1, 1),
                       stop_ids=[])


def verify_tree(w: int, token: int, device, depth: int = max(LOOKUP_LENS)) -> DraftTree:
    """The tree calibration verifies at width w: w - 1 nodes of `token`, a chain of up to `depth`
    (lookup's longest branch) and the rest children of the root, as a wide head tree's are: its
    ancestor mask and walk cost what a candidate's of that width cost."""
    idx = torch.arange(w - 1, device=device)
    parents = torch.where((idx > 0) & (idx < depth), idx - 1, -1)[None]  # (1, w - 1)
    depths = torch.where(idx < depth, idx + 1, 1)[None]
    return DraftTree(torch.full((1, w - 1), int(token), dtype=torch.long, device=device), parents, depths,
                     torch.zeros(1, w - 1, dtype=torch.uint8, device=device))


def _verify_fn(dec: SpecDecoder, s, w: int):
    """(step, undo): the loop's own verify step (SpecDecoder.verify_step: ancestor mask, forward on
    the loop's cache, walk, commit: what the loop's verify timer spans) of width w on LoopState s;
    undo (untimed) crops the committed slots and restores s, so every call sees the same context."""
    proposal = Proposal(verify_tree(w, int(s.pending[0]), s.pending.device))
    saved = (s.pending, s.feats, s.next_tokens, s.valid)
    verdict = []

    def step():
        verdict[:] = [dec.verify_step(s, proposal)]

    def undo():
        kept = int(verdict[0].num_accepted[0]) + 1
        s.tc._crop(kept)
        s.tc.next_pos -= kept
        s.pending, s.feats, s.next_tokens, s.valid = saved
    return step, undo


@torch.inference_mode()
def measure_loop(target, head, context: list[int], costs: Costs, params: SamplingParams, c: Candidate,
                 lookup_ngram: int = 3, tokens: int = 32, rounds: int = 2) -> float:
    """Run the real loop with c (head drafting every step) and return its loop overhead: the median
    over steps of each step's wall time (observer to observer) beyond its timed parts (Costs.parts).
    The median, as the parts are minima: a step slowed by another process must not count as overhead."""
    from draftkit.inference.drafters import HybridDrafter

    if c.chain:  # lookup alone runs the chain path (DraftSettings.decoder_args): its own overhead
        dec = SpecDecoder(target, NgramDrafter(max_n=lookup_ngram), k=c.lookup_len, stop_ids=[])
    else:
        drafter = HybridDrafter(head, NgramDrafter(max_n=lookup_ngram), c.lookup_len)
        dec = SpecDecoder(target, drafter, tree=TreeShape(c.topk, c.depth, c.budget), stop_ids=[])
    seen: list[tuple[float, int]] = []  # (time, verify width) at each step's walk
    dec.observer = lambda tree, verdict: seen.append((time.perf_counter(), int((tree.tokens[0] >= 0).sum()) + 1))
    residuals = []
    for _ in range(rounds):
        seen.clear()
        dec.generate([context], tokens, params, [0])
        residuals += [1e3 * (t1 - t0) - costs.parts(c, w, True) for (t0, _), (t1, w) in zip(seen, seen[1:])]
    return statistics.median_high(residuals) if residuals else 0.0  # a step that ran (the upper of the middle two)


def machine_cpu_s() -> tuple[float, float]:
    """(CPU seconds this process has used, CPU seconds the whole machine has been busy) so far,
    from /proc (Linux; (0, 0) where it is not readable)."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # from field 3 on: utime, stime are fields 14, 15
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return (int(own[11]) + int(own[12])) / tick, (sum(cpu) - cpu[3] - cpu[4]) / tick


def others_meter():
    """A meter of the CPU other processes take from now on: calling it gives their mean use in
    cores since it was made (0.5: half a core; 0 where /proc is not readable). A timing taken while
    they ran measures them as much as this process (on a 2-core CPU a second torch job makes each
    parallel region wait for a descheduled thread)."""
    own0, busy0 = machine_cpu_s()
    t0 = time.perf_counter()

    def cores() -> float:
        own, busy = machine_cpu_s()
        return max(0.0, (busy - busy0) - (own - own0)) / max(time.perf_counter() - t0, 1e-9)
    return cores


def check_costs(costs: Costs, others_cores: float | None = None) -> list[str]:
    """Where the measured profile is not what one machine at rest gives (module doc). others_cores:
    other processes' mean CPU use while it was measured (others_meter), None if unknown. A step
    overhead above a quarter of a plain step is blamed on them only where they ran or nobody knows:
    on a quiet machine it is the loop's own (an AVX2 VM's forwards inside the loop ran 1.2-1.4x their
    isolated minimum with nothing else running: 28.6 ms on a 106.7 ms plain step), every prediction
    carries it, and the predicted step was within 3-8% of the loop's (results/cost_model_accuracy_avx2_fp32.json)."""
    out = []
    if costs.overhead_ms > 0.25 * costs.plain_step_ms and (others_cores is None or others_cores > OTHERS_CORES):
        out.append(f"step overhead {costs.overhead_ms:.1f} ms against a plain step of {costs.plain_step_ms:.1f} ms "
                   f"(expected far less): another process may share the device; the choice may be wrong")
    if costs.overhead_ms < -0.1 * costs.plain_step_ms:
        out.append(f"the loop's steps ran {-costs.overhead_ms:.1f} ms faster than their timed parts: timings unstable")
    ws = sorted(costs.verify_ms)
    for a, b in zip(ws, ws[1:]):
        if costs.verify_ms[b] < 0.9 * costs.verify_ms[a]:
            out.append(f"verify cost falls with width ({a}: {costs.verify_ms[a]:.1f} ms, {b}: "
                       f"{costs.verify_ms[b]:.1f} ms): timings unstable (load on the machine?)")
    if costs.plain_step_ms <= 0 or costs.plain_step_ms > 2 * costs.verify_ms[ws[0]]:
        out.append(f"plain step {costs.plain_step_ms:.1f} ms against a 1-token forward of "
                   f"{costs.verify_ms[ws[0]]:.1f} ms: timings unstable")
    return out


# ---------------------------------------------------------------------------------------------
# Measure, simulate, choose
# ---------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """What auto_draft measured and predicted (the traces and costs per temperature, the ranking)."""

    traces: dict[float, list[Trace]]
    costs: dict[float, Costs]
    rows: list[dict]
    choice: Candidate | None
    warnings: list[str]
    seconds: float
    per_category: dict = field(default_factory=dict)  # choose_per_category's rows ({} below two categories)


def head_depth(head, max_depth: int) -> int:
    """The deepest tree the head drafts, at most max_depth (a Medusa head: its number of heads)."""
    limit = getattr(head, "max_tree_depth", None)
    return max(1, min(max_depth, limit) if limit is not None else max_depth)


def auto_draft(target, head, prompts: list[list[int]], base: DraftSettings | None = None, *,
               temperatures=(0.0,), top_k: int = 0, top_p: float = 1.0, topks=(1, 2, 4, 8), max_depth: int = 6,
               max_new_tokens: int = 48, budget_s: float | None = None, rounds: int = 5, seed: int = 0,
               progress: bool = False, pays: float = PAYS, space: SearchSpace | None = None,
               categories: list[str] | None = None, run_tokens: int | None = None) -> tuple[DraftSettings, Calibration]:
    """Measure, trace, simulate, choose (module doc), within about budget_s seconds: fewer cost
    rounds, shorter traces, then fewer prompts when the whole would not fit (_Calibrating). With
    budget_s None (the default: 120 s on CPU, 60 on GPU) no prompt is left out: each is traced for at
    least MIN_TRACE_TOKENS even where that takes longer, and the warnings say so. `space`: the fields
    the user fixed (SearchSpace; default: nothing fixed over topks and max_depth): only its
    candidates are traced, measured and ranked, and plain decoding is chosen only where nothing was
    fixed. `categories`: each prompt's category (aligned with prompts): with two or more, the best
    shape per category is chosen too (choose_per_category; measured["per_category"]). Traces are at
    most max_new_tokens long; the prediction is for runs of `run_tokens` new tokens per prompt
    (default max_new_tokens: predict). Returns the
    chosen DraftSettings (mode "plain" when nothing pays; chosen_by / measured filled) and the
    Calibration."""
    from tqdm.auto import tqdm

    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"auto_draft: {len(categories)} categories for {len(prompts)} prompts (one per prompt)")

    base = base or DraftSettings()
    space = space or SearchSpace(topks=tuple(topks), max_depth=max_depth)
    cands = space.candidates(head_depth(head, INF))  # before measuring: an impossible space fails at once
    axes = space.axes(head_depth(head, INF))
    bounded = budget_s is not None
    budget_s = budget_s or (120.0 if target.device.type == "cpu" else 60.0)
    temps = [float(t) for t in temperatures] or [0.0]
    t0, warnings, others = time.perf_counter(), [], others_meter()
    traces: dict[float, list[Trace]] = {}
    costs: dict[float, Costs] = {}
    bar = tqdm(total=len(temps) * (rounds + 2 + len(prompts)), desc="draft auto: calibrating", unit="part",
               disable=not progress, dynamic_ncols=True)
    run = _Calibrating(target, head, prompts, _context(prompts, max_new_tokens), base, axes, cands, rounds, seed,
                       max_new_tokens, budget_s, bar, categories, others, bounded)
    for ti, T in enumerate(temps):
        share = (budget_s - (time.perf_counter() - t0)) / (len(temps) - ti)  # this temperature's seconds
        t_start, params = time.perf_counter(), SamplingParams(T, top_k, top_p)
        costs[T], said = run.costs(params, share)
        traces[T], more = run.traces(params, share - (time.perf_counter() - t_start), costs[T])
        warnings += [f"T={T:g}: {w}" for w in said + more + check_plain(traces[T], costs[T])]
    bar.close()
    busy = others()
    if busy > OTHERS_CORES:
        warnings.append(f"other processes used {busy:.2f} cores of this machine while calibrating: the costs "
                        "include them; the choice may be wrong")
    floor = pays if space.any_mode else -math.inf
    run_tokens = run_tokens or max_new_tokens
    choice, rows = choose(traces, costs, cands, floor, run_tokens)
    cal = Calibration(traces, costs, rows, choice, warnings, time.perf_counter() - t0,
                      choose_per_category(traces, costs, cands, floor, run_tokens))
    chosen = _settings(base, cal, target, space, pays)
    return replace(chosen, depth=min(chosen.depth, axes["depth"])), cal  # the sizes eval's other methods run too


@dataclass
class _Calibrating:
    """What one auto_draft measures with: the models, prompts, the timing context, the search axes
    (SearchSpace.axes) and candidates, and the progress bar."""

    target: object
    head: object
    prompts: list
    ctx: list
    base: DraftSettings
    axes: dict
    cands: list
    rounds: int
    seed: int
    max_new_tokens: int
    budget_s: float
    bar: object
    categories: list | None = None
    others: object = None  # others_meter() of the calibration, or None
    bounded: bool = True  # the user set the budget: prompts that do not fit are left out (traces)

    def costs(self, params: SamplingParams, share: float) -> tuple[Costs, list[str]]:
        """The costs at one temperature: interleaved rounds (at least 3, within a quarter of
        `share` seconds) over every verify width and (topk, depth) of the axes, minimum kept;
        then the loop overheads of a mid-size hybrid of the space's head, a depth-1 tree of it and
        lookup alone (Costs.overhead)."""
        topks, depth = self.axes["topks"], self.axes["depth"]
        widths = tuple(sorted(set(VERIFY_WIDTHS) | {max(c.budget + c.lookup_len + 1 for c in self.cands)}))
        m = self.target, self.head, self.ctx, topks, depth, params
        c = measure_costs(*m, rounds=1, widths=widths, tick=self.bar.update)
        one_round = 1e-3 * (sum(c.verify_ms.values()) + sum(c.draft_ms.values()) + c.plain_run_ms + c.plain_prefill_ms)
        more = max(min(2, self.rounds - 1), min(self.rounds - 1, int(0.25 * share / max(one_round, 1e-3)) - 1))
        c = _min_costs(c, measure_costs(*m, rounds=more, widths=widths, tick=self.bar.update, warmup=False))
        self.bar.update(self.rounds - 1 - more)
        said = [f"calibration budget ({self.budget_s:.0f} s): costs measured in {1 + more} of {self.rounds} "
                "rounds"] if 1 + more < self.rounds else []
        k, d = topks[len(topks) // 2], min(3, depth)
        probe = Candidate(k, d, min(16, k + (d - 1) * k * k), max(LOOKUP_LENS))
        c.overhead_ms = measure_loop(self.target, self.head, self.ctx, c, params, probe, self.base.lookup_ngram)
        c.overhead_depth = d
        if d > 1:  # and a depth-1 tree of the widest topk: Costs.overhead prices the depths between
            shallow = Candidate(max(topks), 1, max(topks))
            c.shallow_overhead_ms = measure_loop(self.target, self.head, self.ctx, c, params, shallow,
                                                 self.base.lookup_ngram)
        if any(x.chain for x in self.cands):
            lookup = Candidate(0, 0, 0, max(x.lookup_len for x in self.cands if x.chain))
            c.lookup_overhead_ms = measure_loop(self.target, self.head, self.ctx, c, params, lookup, self.base.lookup_ngram)
        c.plain_overhead_ms = plain_step_median_ms(self.target, self.ctx, 32, params) - c.plain_step_ms
        self.bar.update(1)
        return c, said + check_costs(c, self.others() if self.others else None)

    def traces(self, params: SamplingParams, share: float, costs: Costs) -> tuple[list[Trace], list[str]]:
        """The prompts traced at one temperature within `share` seconds, breadth before length: each
        prompt is traced for the new tokens its part of the remaining time holds at the rate seen so
        far (before the first trace: trace_ms_per_token from `costs`), at most max_new_tokens and at
        least MIN_TRACE_TOKENS; when the rest do not all fit at that length, as many as fit are traced
        at it and the others left out (the first prompt is always traced) where the user set the budget
        (bounded); under the default budget every prompt is traced at least that long, and the warnings
        say how far over it went. Three prompts of 64 tokens predicted tau 1.24 where 12 other prompts
        measured 1.57 (an AVX2 CPU, fp32), and at T = 1 three traced prompts over-predicted tau by
        12-42% where all eight came within 2-11% (a slow AVX2 VM, 120 s vs 360 s): which prompts are
        traced matters more than how far, and more than the default's seconds."""
        t_start, traces, traced_s, traced_tokens = time.perf_counter(), [], 0.0, 0
        lens = tuple(sorted(set(self.axes["lookup_lens"]) - {0}))
        first_rate = 1e-3 * trace_ms_per_token(costs, self.axes["topks"], self.axes["depth"])
        floor, said = min(MIN_TRACE_TOKENS, self.max_new_tokens), []
        for i, p in enumerate(self.prompts):
            rate = traced_s / traced_tokens if traces else first_rate
            left = share - (time.perf_counter() - t_start)
            n = min(self.max_new_tokens, int(left / (len(self.prompts) - i) / max(rate, 1e-9)))
            if n < floor:  # the rest do not all fit: as many as fit, each at the shortest length
                if traces and left < floor * rate and self.bounded:
                    self.bar.update(len(self.prompts) - i)
                    said.append(f"calibration budget ({self.budget_s:.0f} s): traced {len(traces)} of "
                                f"{len(self.prompts)} prompts")
                    break
                n = floor
            t_trace = time.perf_counter()
            traces.append(trace_prompt(self.target, self.head, p, n, params, self.seed + i,
                                       self.axes["topks"], self.axes["depth"], lookup_lens=lens,
                                       lookup_ngram=self.base.lookup_ngram))
            traces[-1].category = self.categories[i] if self.categories is not None else None
            traced_s += time.perf_counter() - t_trace
            traced_tokens += len(traces[-1].tokens)
            self.bar.update(1)
        cut = [len(tr.tokens) for tr in traces if len(tr.tokens) < self.max_new_tokens]  # traces run without stops
        took = time.perf_counter() - t_start
        if not self.bounded and took > 1.05 * share:
            said.append(f"calibration: tracing every prompt for at least {floor} new tokens took {took:.0f} s, "
                        f"{took - share:.0f} s over this temperature's share of the default budget "
                        f"({self.budget_s:.0f} s); --calibration-budget bounds it, with fewer prompts")
        if cut:
            said.append(f"calibration budget ({self.budget_s:.0f} s): {len(cut)} prompts traced for "
                        f"{min(cut)}-{max(cut)} of {self.max_new_tokens} new tokens")
        return traces, said


def trace_ms_per_token(costs: Costs, topks, depth: int) -> float:
    """What trace_prompt spends per new token, from the measured costs (before any trace has run):
    a plain step and each topk's pool of `depth` (the teacher-forced forward is one prefill)."""
    return costs.plain_step_ms + sum(costs.draft_ms.get((k, depth), 0.0) for k in topks)


def _context(prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """A context of the calibration prompts' mean length plus half the new tokens (where a step
    runs on average), cut from the prompts themselves."""
    n = sum(map(len, prompts)) // max(len(prompts), 1) + max_new_tokens // 2
    flat = [t for p in prompts for t in p]
    return (flat * (1 + n // max(len(flat), 1)))[: max(n, 2)]


def _min_costs(a: Costs, b: Costs) -> Costs:
    """Element-wise minimum of two measurements of the same costs (the plain step: the difference
    of the minimum runs)."""
    low = {f: min(getattr(a, f), getattr(b, f)) for f in ("consume_ms", "plain_prefill_ms", "head_prefill_ms",
                                                          "noise_ms_per_row", "plain_run_ms", "lookup_ms")}
    return replace(a, verify_ms={w: min(a.verify_ms[w], b.verify_ms[w]) for w in a.verify_ms},
                   draft_ms={key: min(a.draft_ms[key], b.draft_ms[key]) for key in a.draft_ms}, **low,
                   plain_step_ms=plain_step_ms(low["plain_prefill_ms"], low["plain_run_ms"], a.plain_tokens))


def check_plain(traces: list[Trace], costs: Costs) -> list[str]:
    """The plain runs that made the traces against the timed plain step: much slower = load."""
    model = sum(tr.prefill_ms + (len(tr.tokens) - 1) * costs.plain_step_ms for tr in traces)
    ran = 1e3 * sum(tr.plain_s for tr in traces)
    if model and ran > 1.3 * model:
        return [f"the calibration's plain runs took {ran / 1e3:.1f} s against {model / 1e3:.1f} s from the timed step: "
                "another process may share the device"]
    return []


def _settings(base: DraftSettings, cal: Calibration, target, space: SearchSpace, pays: float = PAYS) -> DraftSettings:
    """The choice as DraftSettings, with the measured costs and the prediction in `measured` (and
    what the user fixed, and whether the choice pays, where they fixed something)."""
    T0 = next(iter(cal.costs))
    c = cal.costs[T0]
    best = cal.rows[0] if cal.rows else None
    n_prompts = len(cal.traces[T0])
    if cal.choice is None:
        chosen = replace(base, mode="plain")
        why = (f"measured: plain decoding, no shape is predicted faster than {PAYS:.2f}x plain on this machine "
               f"(best {best['label']}: {best['speedup']:.2f}x; plain step {c.plain_step():.1f} ms, "
               f"{_cost_words(c, best['candidate'])})" if best else "measured: plain decoding (no candidate)")
    else:
        chosen = cal.choice.settings(base)
        pred = ", ".join(f"T={t}: tau {p['tau']:.2f}, {p['speedup']:.2f}x" for t, p in best["by_temperature"].items())
        why = f"measured: predicted {pred} over plain ({c.plain_step():.1f} ms/step, {_cost_words(c, cal.choice)})"
    if not space.any_mode:
        why += (f"; searched only shapes with {_words(space.fixed)}" + (f" in mode {space.mode}" if space.mode else "")
                + ("" if best["speedup"] > pays else f", none predicted faster than {pays:.2f}x plain: the best kept"))
    if cal.per_category:
        why += "; per category: " + ", ".join(
            f"{cat}: {r['shape']}" + (f" {r['speedup']:.2f}x" if r["choice"] is not None else "")
            for cat, r in cal.per_category.items())
    why += f"; {n_prompts} prompts in {cal.seconds:.0f} s"
    measured = {
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
        "prompts": n_prompts, "seconds": round(cal.seconds, 1), "warnings": list(cal.warnings),
        "fixed": dict(space.fixed, **({"mode": space.mode} if space.mode else {})),
        "predicted": best["by_temperature"] if cal.choice is not None and best else
        {f"{t:g}": {"tau": 1.0, "speedup": 1.0} for t in cal.costs},
        "costs": {f"{t:g}": _costs_dict(cc) for t, cc in cal.costs.items()},
        "top_candidates": [{"shape": r["label"], "speedup": round(r["speedup"], 4), **r["by_temperature"]}
                           for r in cal.rows[:8]],
        **({"per_category": cal.per_category} if cal.per_category else {}),
    }
    return replace(chosen, chosen_by=why, measured=measured)


def _cost_words(c: Costs, cand: Candidate) -> str:
    """The measured costs that decide cand, in words."""
    w = cand.budget + cand.lookup_len + 1 if cand.topk else cand.lookup_len + 1
    draft = f"head draft {c.draft_ms[(cand.topk, cand.depth)]:.1f} ms, " if cand.topk else ""
    return f"verify {w}: {c.verify(w):.1f} ms, {draft}loop overhead {c.overhead(cand):.1f} ms"


def _costs_dict(c: Costs) -> dict:
    return {"verify_ms": {str(w): round(v, 3) for w, v in c.verify_ms.items()},
            "draft_ms": {f"{k}x{d}": round(v, 3) for (k, d), v in c.draft_ms.items()},
            "consume_ms": round(c.consume_ms, 3), "plain_step_ms": round(c.plain_step_ms, 3),
            "plain_overhead_ms": round(c.plain_overhead_ms, 3),
            "overhead_ms": round(c.overhead_ms, 3), "lookup_ms": round(c.lookup_ms, 3),
            "lookup_overhead_ms": None if c.lookup_overhead_ms is None else round(c.lookup_overhead_ms, 3),
            "overhead_depth": c.overhead_depth,
            "shallow_overhead_ms": None if c.shallow_overhead_ms is None else round(c.shallow_overhead_ms, 3),
            "noise_ms_per_row": round(c.noise_ms_per_row, 4)}


def format_choice(settings: DraftSettings) -> str:
    """What auto chose, its prediction and the measured costs, in one line (+ one per warning)."""
    m = settings.measured or {}
    lines = [f"draft auto: {settings.describe()}  ({settings.chosen_by})"]
    lines += [f"draft auto: warning: {w}" for w in m.get("warnings", [])]
    return "\n".join(lines)
