"""Draft sizes chosen from measured cost: what `draftkit eval --draft auto` runs.

Three measurements on the machine at hand (batch 1, the target's dtype and device):
1. verify cost: the target's forward time for w tokens fed after a context (w = 1..64);
2. draft cost: the head's tree drafting time for each (topk, depth), and the cost of only
   consuming the confirmed positions (what a hybrid step pays when lookup drafts alone);
3. the acceptance profile: the loop on a few prompts with the largest hybrid tree for each topk,
   recording every node of every step (score, depth, from lookup?) and the accepted path.

A smaller tree of the same topk keeps, among the big tree's nodes of depth <= d, the `budget`
best by score (growth is identical up to depth d), and at T = 0 accepts the longest prefix of the
big tree's accepted path that it contains. So tokens per step of every candidate (topk, depth,
budget, lookup_len, head_off_at) follow exactly from the recorded steps (on the big tree's
trajectory), and its cost from (1) and (2). The pick maximises expected tokens / second; the
report says what was measured, the best few candidates and why the winner won.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field, replace

import torch

from draftkit.inference.cache import TargetCache, left_pad
from draftkit.inference.decoder import SpecDecoder
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.tree import SOURCE_HEAD, SOURCE_LOOKUP, TreeShape

VERIFY_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LOOKUP_LENS = (0, 4, 6, 8, 10)
HEAD_OFF = (None, 2, 3, 4, 6, 8)


@dataclass
class StepRecord:
    nodes: list[tuple[float, int, bool, bool]]  # (head score or -inf, depth, on lookup's branch, on the accepted path)
    path_depth: int  # accepted nodes


@dataclass
class CostProfile:
    verify_ms: dict[int, float]
    draft_ms: dict[tuple[int, int], float]  # (topk, depth) -> ms
    consume_ms: float
    overhead_ms: float  # per step, beyond the forward and the drafting (walk, commit, bookkeeping)
    steps: dict[int, list[StepRecord]] = field(default_factory=dict)  # topk -> records

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


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


@torch.inference_mode()
def measure_verify(target, context: list[int], widths=VERIFY_WIDTHS, reps: int = 5) -> dict[int, float]:
    """ms of one target forward of w causal tokens after `context` (median of reps)."""
    ids, valid = left_pad([context], target.device)
    tc = TargetCache(target, 1)
    tc.forward(ids, valid)
    tc.commit(valid)
    out = {}
    for w in widths:
        block = torch.full((1, w), int(context[-1]), dtype=torch.long, device=target.device)
        ar = torch.arange(w, device=target.device)

        def step():
            tc.verify(block, torch.ones(1, w, dtype=torch.bool, device=target.device), tc.next_pos[:, None] + ar,
                      (ar[None, :] <= ar[:, None])[None])
            tc._crop(w)
        out[w] = _time(step, reps)
    return out


@torch.inference_mode()
def measure_draft(target, head, context: list[int], topks, depth: int, reps: int = 5) -> tuple[dict, float]:
    """ms of head.draft_tree for every (topk, d <= depth) after `context`, and of consuming alone."""
    ids, valid = left_pad([context], target.device)
    tc = TargetCache(target, 1, head.feature_layers)
    _, feats = tc.forward(ids, valid)
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    state = head.new_draft_state(1)
    head.tree_root(state, feats, nxt, valid)  # the prompt is in the head's cache; then one new position a step
    one_f, one_t, one_v = feats[:, -1:], nxt[:, -1:], valid[:, -1:]
    out = {}
    for k in topks:
        for d in range(1, depth + 1):
            out[(k, d)] = _time(lambda: head.draft_tree(state, one_f, one_t, one_v, TreeShape(k, d, 10 ** 6)), reps)
    consume = _time(lambda: head.tree_root(state, one_f, one_t, one_v), reps)
    return out, consume


@torch.inference_mode()
def record_profile(target, drafter_for, prompts: list[list[int]], topks, depth: int, max_new_tokens: int,
                   stop_ids=None) -> tuple[dict[int, list[StepRecord]], list[int], float, int]:
    """Run the loop with the biggest tree per topk (drafter_for(topk) -> (drafter, shape)) and
    record every step. Returns the records, every step's verify width, the loop's seconds outside
    prefill and drafting, and its steps (the caller subtracts the forward's share: the rest is the
    per-step overhead of the walk, the cache roll-back and the bookkeeping)."""
    records: dict[int, list[StepRecord]] = {}
    widths, verify_s, steps = [], 0.0, 0
    for k in topks:
        drafter, shape = drafter_for(k)
        dec = SpecDecoder(target, drafter, tree=shape, stop_ids=stop_ids)
        recs = records.setdefault(k, [])

        def observe(tree, verdict):
            on_path = set(verdict.path[0].tolist()[: int(verdict.num_accepted[0])])
            nodes = []
            for i, (t, sc, dep, src) in enumerate(zip(tree.tokens[0].tolist(), tree.score[0].tolist(),
                                                     tree.depth[0].tolist(), tree.source[0].tolist())):
                if t >= 0:
                    nodes.append((sc if src & SOURCE_HEAD else float("-inf"), dep, bool(src & SOURCE_LOOKUP),
                                  (i + 1) in on_path))
            recs.append(StepRecord(nodes, int(verdict.num_accepted[0])))
            widths.append(len(nodes) + 1)
        dec.observer = observe
        for p in prompts:
            _, st = dec.generate([p], max_new_tokens)
            verify_s += st.total_s - st.prefill_s - st.draft_s  # the forward + everything else per step
            steps += st.steps
    return records, widths, verify_s, steps


def simulate(records: list[StepRecord], budget: int, depth: int, lookup_len: int, head_off_at: int | None
             ) -> tuple[float, list[tuple[int, bool]]]:
    """Mean tokens per step of the candidate and, per step, (verify width, head drafted?)."""
    total, shape = 0, []
    for r in records:
        lookup_nodes = [n for n in r.nodes if n[2] and n[1] <= lookup_len]
        head_on = not (head_off_at and len(lookup_nodes) >= head_off_at)
        heads = sorted((n for n in r.nodes if n[0] > float("-inf") and n[1] <= depth), key=lambda n: -n[0])
        kept = set(map(id, heads[:budget])) if head_on else set()
        in_tree = lambda n: id(n) in kept or (n[2] and n[1] <= lookup_len)  # noqa: E731
        width = len({id(n) for n in r.nodes if in_tree(n)}) + 1
        path = sorted((n for n in r.nodes if n[3]), key=lambda n: n[1])
        acc = 0
        for n in path:
            if not in_tree(n):
                break
            acc += 1
        total += acc + 1
        shape.append((width, head_on))
    return total / max(len(records), 1), shape


def choose(profile: CostProfile, base: DraftSettings, max_depth: int) -> tuple[DraftSettings, list[dict]]:
    """Every candidate's expected tokens/s; the best as DraftSettings, and the ranked table."""
    rows = []
    for k, recs in profile.steps.items():
        if not recs:
            continue
        for d in range(1, max_depth + 1):
            for budget in BUDGETS:
                if budget > k + (d - 1) * k * k or (k == 1 and budget != d):
                    continue
                for L in LOOKUP_LENS:
                    for off in HEAD_OFF if L else (None,):
                        if off is not None and off > L:
                            continue
                        tau, shape = simulate(recs, budget, d, L, off)
                        cost = sum(profile.verify(w) + (profile.draft_ms[(k, d)] if on else profile.consume_ms)
                                   + profile.overhead_ms for w, on in shape)
                        rows.append({"topk": k, "depth": d, "budget": budget, "lookup_len": L, "head_off_at": off,
                                     "tau": tau, "ms_per_step": cost / len(shape),
                                     "tokens_per_s": 1e3 * tau * len(shape) / cost})
    rows.sort(key=lambda r: -r["tokens_per_s"])
    best = rows[0]
    mode = "hybrid" if best["lookup_len"] else "tree"
    chosen = replace(base, mode=mode, topk=best["topk"], depth=best["depth"], budget=best["budget"],
                     lookup_len=best["lookup_len"] or base.lookup_len, head_off_at=best["head_off_at"])
    return chosen, rows


def auto_draft(target, head, prompts: list[list[int]], base: DraftSettings | None = None, *, topks=(1, 2, 4, 8),
               max_depth: int = 8, max_budget: int = 64, max_lookup: int = 10, max_new_tokens: int = 48,
               context: list[int] | None = None, progress: bool = False) -> tuple[DraftSettings, dict]:
    """Measure, simulate, choose. Returns the chosen DraftSettings (chosen_by / measured filled)."""
    from draftkit.inference.drafters import HybridDrafter
    from draftkit.inference.ngram import NgramDrafter

    base = base or DraftSettings()
    max_depth = min(max_depth, getattr(head, "max_tree_depth", None) or max_depth)  # DFlash: block_size - 1
    ctx = context or (prompts[0] * (1 + 256 // max(len(prompts[0]), 1)))[:256]
    t0 = time.perf_counter()
    verify_ms = measure_verify(target, ctx)
    draft_ms, consume_ms = measure_draft(target, head, ctx, topks, max_depth)

    def drafter_for(k):
        shape = TreeShape(k, max_depth, max_budget if k > 1 else max_depth)
        return HybridDrafter(head, NgramDrafter(max_n=base.lookup_ngram), max_lookup), shape
    records, widths, verify_s, steps = record_profile(target, drafter_for, prompts, topks, max_depth, max_new_tokens)
    profile = CostProfile(verify_ms, draft_ms, consume_ms, 0.0, records)
    forward = sum(profile.verify(w) for w in widths) / max(len(widths), 1)
    profile.overhead_ms = max(0.0, 1e3 * verify_s / max(steps, 1) - forward)
    chosen, rows = choose(profile, base, max_depth)
    plain = verify_ms[1] + profile.overhead_ms
    why = (f"measured: {len(prompts)} prompts x {max_new_tokens} tokens per topk in {time.perf_counter() - t0:.0f} s; "
           f"predicted tau {rows[0]['tau']:.2f}, {rows[0]['ms_per_step']:.1f} ms/step, "
           f"{rows[0]['tokens_per_s'] / (1e3 / plain):.2f}x plain")
    measured = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
                "verify_ms": {str(w): round(v, 3) for w, v in verify_ms.items()},
                "draft_ms": {f"{k}x{d}": round(v, 3) for (k, d), v in draft_ms.items()},
                "consume_ms": round(consume_ms, 3), "overhead_ms": round(profile.overhead_ms, 3),
                "plain_ms_per_token": round(plain, 3), "top_candidates": rows[:8],
                "steps_recorded": {str(k): len(v) for k, v in records.items()}}
    return replace(chosen, chosen_by=why, measured=measured), {"rows": rows, "profile": profile}


def format_choice(settings: DraftSettings) -> str:
    """What auto chose and why, for the terminal."""
    m = settings.measured or {}
    lines = [f"draft: {settings.describe()}  ({settings.chosen_by})"]
    if m.get("verify_ms"):
        vm = m["verify_ms"]
        lines.append("  verify ms by width: " + ", ".join(f"{w}:{v:.1f}" for w, v in vm.items()))
        lines.append(f"  head consume {m.get('consume_ms', 0):.1f} ms, step overhead {m.get('overhead_ms', 0):.1f} ms, "
                     f"plain {m.get('plain_ms_per_token', 0):.1f} ms/token")
    for r in m.get("top_candidates", [])[:5]:
        lines.append(f"  topk {r['topk']} depth {r['depth']} budget {r['budget']} lookup {r['lookup_len']} "
                     f"head_off {r['head_off_at']}: tau {r['tau']:.2f}, {r['ms_per_step']:.1f} ms/step, "
                     f"{r['tokens_per_s']:.1f} tok/s")
    return "\n".join(lines)
