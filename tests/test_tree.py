"""Draft trees (draftkit.inference.tree) and the loop in tree mode, mirroring the ways they can be wrong.

1. The acceptance walk: vectorised == an independent plain-Python oracle (every temperature rule); the output distribution over all outcomes of
   a small tree equals the target's autoregressive distribution (Monte Carlo, 10^6 walks, a bound
   a correct walk exceeds with probability < 1e-6), and three planted bugs fail that same check.
2. Tree structure: the ancestor mask of a hand-drawn tree; EAGLE-2 growth keeps the best-scoring
   connected subtree; top-k 1 is exactly the head's greedy chain; every node's children are what
   the head predicts after that node's path fed one token at a time; lookup branches merge.
3. The loop: fp32 T = 0 output equal to plain decoding for every family, tree shapes, batch 1 and
   ragged > 1; an oracle tree (the right path among wrong siblings) accepts every level; a row's
   sampled output does not depend on the other rows' drafts; at T > 0 the first 3 tokens through
   the hybrid loop (accepted depth-2 nodes, lookup's among them) follow the target's exact joint law.
"""
from __future__ import annotations

import math

import pytest
import torch

from draftkit.heads import build_head
from draftkit.inference.decoder import SpecDecoder
from draftkit.inference.errors import SpecError
from draftkit.inference.drafters import DraftSettings, DraftSettingsError, HybridDrafter
from draftkit.inference.ngram import NgramDrafter
from draftkit.inference.sampling import SamplingParams
from draftkit.inference.tree import (SOURCE_HEAD, SOURCE_LOOKUP, DraftTree, TreeShape, accept_tree,
                                     add_branches, grow_tree, tree_noise)
from tests.conftest import fit, fit_on_greedy_continuations
from tests.test_spec_decoder import (P_FALSE_ALARM, SMALL_V, V, continuation_law, law_p_value, make_prompts,
                                     small_vocab_target, varied_target)
from tests.test_spec_decoder import reference, target  # noqa: F401  (the loop's fixtures: one target, its greedy reference)

pytestmark = pytest.mark.usefixtures("one_thread")


def tree_of(rows: list[list[tuple[int, int]]]) -> DraftTree:
    """Rows of (parent, token) node lists (parent -1 = root, depth derived), padded."""
    N = max(len(r) for r in rows)
    tok = torch.full((len(rows), N), -1)
    par = torch.full((len(rows), N), -1)
    dep = torch.zeros(len(rows), N, dtype=torch.long)
    for b, r in enumerate(rows):
        for i, (p, t) in enumerate(r):
            tok[b, i], par[b, i] = t, p
            dep[b, i] = 1 if p < 0 else dep[b, p] + 1
    return DraftTree(tok, par, dep, torch.where(tok >= 0, SOURCE_HEAD, 0).to(torch.uint8))


# ---------------------------------------------------------------------------------------------
# 1. The walk
# ---------------------------------------------------------------------------------------------

# A tree over V = 4 and the target's distribution at each of its nodes (node i's row i + 1):
#   root -> 0 -> {2 -> 1, 3}
#        -> 1 -> 0
SMALL = [(-1, 0), (-1, 1), (0, 2), (0, 3), (1, 0), (2, 1)]
P_NODES = torch.tensor([
    [0.4, 0.3, 0.2, 0.1],  # root
    [0.1, 0.2, 0.3, 0.4],  # after 0
    [0.5, 0.1, 0.1, 0.3],  # after 1
    [0.25, 0.25, 0.25, 0.25],  # after 0 2
    [0.7, 0.1, 0.1, 0.1],  # after 0 3
    [0.2, 0.2, 0.5, 0.1],  # after 1 0
    [0.1, 0.6, 0.2, 0.1],  # after 0 2 1
], dtype=torch.float64)
N_WALKS = 1_000_000


def exact_outcomes(nodes, p: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(emitted sequence) when every token is drawn from p at its context (plain sampling),
    stopping after the first token that is not a child: the law the walk must follow."""
    children = {}
    for i, (par, t) in enumerate(nodes):
        children.setdefault(par, {})[t] = i
    out = {}

    def visit(node, prefix, prob):
        for t in range(p.shape[1]):
            q = prob * float(p[node + 1, t])
            child = children.get(node, {}).get(t)
            if child is None:
                out[prefix + (t,)] = q
            else:
                visit(child, prefix + (t,), q)
    visit(-1, (), 1.0)
    return out


def walk_samples(walk, seed: int) -> list[tuple[int, ...]]:
    tree = tree_of([SMALL])
    n = N_WALKS
    big = DraftTree(*(x.expand(n, -1) for x in (tree.tokens, tree.parents, tree.depth, tree.source)))
    logits = P_NODES.log().float().expand(n, -1, -1)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.empty(n, 4, 4).exponential_(generator=gen).reciprocal()
    tokens, num_acc = walk(big, logits, noise)
    return tokens, num_acc


def tv_of(tokens: torch.Tensor, num_acc: torch.Tensor, exact: dict) -> tuple[float, float]:
    """Total variation of the walks' outcomes from `exact`, and the bound a correct walk exceeds
    with probability < 1e-6 (E||f - P||_1 by Jensen + McDiarmid, as in test_rejection_sampler)."""
    n, width = tokens.shape
    keep = torch.arange(width)[None] <= num_acc[:, None]
    digits = torch.where(keep, tokens + 1, 0)  # base-5 code of the emitted sequence, 0 = past its end
    codes = (digits * (5 ** torch.arange(width - 1, -1, -1))).sum(1)
    counts = torch.bincount(codes, minlength=5 ** width)
    code_of = {key: sum((t + 1) * 5 ** (width - 1 - i) for i, t in enumerate(key)) for key in exact}
    assert int(counts.sum()) == int(sum(counts[c] for c in code_of.values())), "an impossible outcome"
    freq = torch.tensor([int(counts[code_of[k]]) for k in exact], dtype=torch.float64) / n
    P = torch.tensor(list(exact.values()), dtype=torch.float64)
    bound = ((P * (1 - P) / n).sqrt().sum().item() + math.sqrt(2 * math.log(1e6) / n)) / 2
    return 0.5 * (freq - P).abs().sum().item(), bound


def real_walk(tree, logits, noise):
    v = accept_tree(tree, logits, SamplingParams(temperature=1.0), noise)
    return v.tokens, v.num_accepted


def buggy_walk(reuse_noise=False, parent_context=False, accept_then_resample=False):
    """An independent compact walk with switchable classic bugs (mutants)."""
    def walk(tree, logits, noise):
        n = tree.tokens.shape[0]
        rows = torch.arange(n)
        cur, prev = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        out = torch.full((n, 4), -1)
        num = torch.zeros(n, dtype=torch.long)
        go = torch.ones(n, dtype=torch.bool)
        for j in range(4):
            ctx = prev if parent_context and j > 0 else cur  # (b) the parent's distribution
            p = logits[rows, ctx].softmax(-1)
            t = (p * noise[:, 0 if reuse_noise else j]).argmax(-1)  # (a) one draw reused per depth
            kids = (tree.parents + 1 == cur[:, None]) & (tree.tokens >= 0)
            if accept_then_resample:  # (c) a child kept with prob p(child), else a draw from all of p
                kid_tok = torch.where(kids, tree.tokens, 0)
                pk = torch.where(kids, p.gather(1, kid_tok), 0.0)
                u = noise[:, j, 0].reciprocal()  # Exp(1) -> a uniform via exp(-E)
                u = torch.exp(-u)
                cum = pk.cumsum(1)
                pick = (u[:, None] < cum) & kids
                has = pick.any(1)
                idx = pick.float().argmax(1)
                t = torch.where(has, tree.tokens[rows, idx], t)
            match = kids & (tree.tokens == t[:, None])
            out[:, j] = torch.where(go, t, out[:, j])
            d = go & match.any(1)
            num += d.long()
            prev = torch.where(d, cur, prev)
            cur = torch.where(d, match.float().argmax(1) + 1, cur)
            go = d
        return out, num
    return walk


def processed_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """The target's processed distribution in plain Python (float64), written from the rule and not
    from draftkit's code: temperature, then top-k (ties with the k-th value kept), then top-p (the
    smallest most-likely set holding >= top_p, ties with the last kept value kept), renormalised."""
    z = [x / params.temperature for x in logits]
    if 0 < params.top_k < len(z):
        kth = sorted(z, reverse=True)[params.top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    top = max(z)
    w = [math.exp(x - top) for x in z]
    p = [x / sum(w) for x in w]
    if params.top_p < 1.0:
        mass, cutoff = 0.0, None
        for x in sorted(p, reverse=True):
            if mass >= params.top_p:
                break
            mass, cutoff = mass + x, x
        p = [x if x >= cutoff else 0.0 for x in p]
        p = [x / sum(p) for x in p]
    return p


def walk_oracle(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, noise) -> list[list[int]]:
    """The walk of draftkit.inference.tree's module doc, per row in plain Python over the
    probabilities, sharing no helper with the code it checks: at each node draw t (argmax at T = 0,
    else argmax_v p_v / E_v with the noise row of that depth, which holds 1 / E), emit it, descend
    into the child holding t, stop when there is none."""
    out = []
    for b, (toks, pars) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        node, depth, emitted = -1, 0, []
        while True:
            row = logits[b, node + 1].tolist()
            if not params.greedy:
                row = [w * e for w, e in zip(processed_probs(row, params), noise[b, depth].tolist())]
            t = row.index(max(row))  # ties: the lowest index
            emitted.append(t)
            kids = [i for i, (tok, par) in enumerate(zip(toks, pars)) if tok == t and par == node]
            if not kids:
                break
            node, depth = kids[0], depth + 1
        out.append(emitted)
    return out


def test_walk_matches_an_independent_oracle():
    g = torch.Generator().manual_seed(0)
    trees = tree_of([SMALL, [(-1, 3), (0, 3), (1, 3)], [(-1, 2)], [(-1, 0), (-1, 1), (-1, 2), (1, 0), (3, 1)]])
    B, N = trees.tokens.shape
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=3), SamplingParams(temperature=0.6),
                   SamplingParams(temperature=1.3, top_p=0.7)):
        for trial in range(20):
            logits = torch.randn(B, N + 1, 4, generator=g) * 2
            noise = tree_noise(4, 4, [torch.Generator().manual_seed(trial * 10 + b) for b in range(B)])
            v = accept_tree(trees, logits, params, None if params.greedy else noise, depth=4)
            oracle = walk_oracle(trees, logits, params, noise)
            got = [row[: n + 1] for row, n in zip(v.tokens.tolist(), v.num_accepted.tolist())]
            assert got == oracle, (params, trial)
            # the path points at the accepted nodes, in order
            for b in range(B):
                for j in range(int(v.num_accepted[b])):
                    assert int(trees.tokens[b, v.path[b, j] - 1]) == got[b][j]


def test_greedy_walk_takes_the_longest_argmax_path():
    tree = tree_of([SMALL])
    logits = torch.full((1, 7, 4), -5.0)
    for slot, best in ((0, 0), (1, 2), (3, 1), (6, 3)):  # root->0, 0->2, (0 2)->1, then 3 (a bonus)
        logits[0, slot, best] = 5.0
    v = accept_tree(tree, logits, SamplingParams(), None)
    assert v.tokens[0].tolist() == [0, 2, 1, 3] and v.num_accepted.tolist() == [3]
    assert v.path[0].tolist() == [1, 3, 6]
    assert v.offered[0].tolist() == [True, True, True]


def test_walk_distribution_is_the_targets():
    exact = exact_outcomes(SMALL, P_NODES)
    assert abs(sum(exact.values()) - 1) < 1e-12
    tv, bound = tv_of(*walk_samples(real_walk, seed=0), exact)
    assert bound < 0.01 and tv < bound, (tv, bound)


@pytest.mark.parametrize("mutant, expect_pass", [
    (dict(), True),  # the test-local walk without bugs passes the same check
    (dict(reuse_noise=True), False),  # (a) the same draw at every depth
    (dict(parent_context=True), False),  # (b) a node's draw from its parent's distribution
    (dict(accept_then_resample=True), False),  # (c) children accepted by p(child), residual not excluded
])
def test_distribution_check_rejects_mutants(mutant, expect_pass):
    exact = exact_outcomes(SMALL, P_NODES)
    tv, bound = tv_of(*walk_samples(buggy_walk(**mutant), seed=1), exact)
    assert (tv < bound) == expect_pass, (tv, bound)


# ---------------------------------------------------------------------------------------------
# 2. Structure
# ---------------------------------------------------------------------------------------------


def test_ancestor_mask_by_hand():
    anc = tree_of([SMALL]).ancestor_mask()[0].int().tolist()
    #            root 0  1  2  3  4  5        (slot 0 = root, slot 1 + i = node i)
    expected = [[1, 0, 0, 0, 0, 0, 0],  # root
                [1, 1, 0, 0, 0, 0, 0],  # 0
                [1, 0, 1, 0, 0, 0, 0],  # 1
                [1, 1, 0, 1, 0, 0, 0],  # 0 2
                [1, 1, 0, 0, 1, 0, 0],  # 0 3
                [1, 0, 1, 0, 0, 1, 0],  # 1 0
                [1, 1, 0, 1, 0, 0, 1]]  # 0 2 1
    assert anc == expected


def test_grow_keeps_the_best_connected_subtree():
    """A fake head whose children's log-probs are fixed per token: scores are path sums."""
    lp = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def logp(h, depth):
        return lp.expand(h.shape[0], h.shape[1], 4)

    def step(parent_h, tokens, depth, visible):
        return parent_h

    tree = grow_tree(torch.zeros(1, 2), logp, step, TreeShape(topk=2, depth=3, budget=5))
    nodes = [(int(p), int(t)) for p, t in zip(tree.parents[0], tree.tokens[0])]
    # scores: 0:.5 1:.3 00:.25 01:.15 10:.15 000:.125 ... the best five (ties to the earlier candidate)
    assert nodes == [(-1, 0), (-1, 1), (0, 0), (0, 1), (1, 0)]
    assert tree.depth[0].tolist() == [1, 1, 2, 2, 2]


@pytest.mark.parametrize("family, extra", [("eagle", {}), ("eagle", {"draft_vocab_size": 40}),
                                           ("eagle3", {"draft_vocab_size": 50}), ("mtp", {})])
def test_topk_one_tree_is_the_greedy_chain(family, extra):
    target = varied_target()
    head = build_head({"type": family, **extra}, target).eval()
    prompts = make_prompts()[:2]
    from draftkit.inference.cache import TargetCache, left_pad
    ids, valid = left_pad(prompts, target.device)
    tc = TargetCache(target, 2, head.feature_layers)
    _, feats = tc.forward(ids, valid)
    nxt = torch.cat([ids[:, 1:], torch.tensor([[7], [9]])], 1)
    chain, _ = head.draft(head.new_draft_state(2), feats, nxt, valid, 4, lambda x: (x.argmax(-1), None))
    tree = head.draft_tree(head.new_draft_state(2), feats, nxt, valid, TreeShape(1, 4, 4))
    assert tree.tokens.tolist() == chain.tolist()
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("family", ["eagle", "eagle3", "mtp"])
def test_tree_children_are_the_heads_predictions_after_each_path(family, window):
    """Sequential check: feed each depth-2 node's path token by token as a chain (teacher forcing)
    and compare the head's top-k there with the node's children in the tree; with an attention
    window (heads/layers.py: ChainState.window) as well, which tree nodes must apply as chains do."""
    target = varied_target()
    head = build_head({"type": family}, target).eval()
    head.attention_window = window
    prompt = make_prompts()[1:2]
    from draftkit.inference.cache import TargetCache, left_pad
    ids, valid = left_pad(prompt, target.device)
    tc = TargetCache(target, 1, head.feature_layers)
    _, feats = tc.forward(ids, valid)
    nxt = torch.cat([ids[:, 1:], torch.tensor([[7]])], 1)
    k = 3
    tree = head.draft_tree(head.new_draft_state(1), feats, nxt, valid, TreeShape(k, 3, 100))
    toks, pars = tree.tokens[0].tolist(), tree.parents[0].tolist()
    checked = 0
    for i, (t, p) in enumerate(zip(toks, pars)):
        if p < 0 or t < 0:
            continue
        kids = sorted(tt for tt, pp in zip(toks, pars) if pp == i)
        if not kids:
            continue
        path = [toks[p], t]

        def forced(logits, _it=iter(path + [None])):
            want = next(_it)
            return (torch.tensor([want]) if want is not None else logits.argmax(-1)), logits
        _, probs = head.draft(head.new_draft_state(1), feats, nxt, valid, 3, forced)
        top = probs[0, 2].topk(k).indices.sort().values.tolist()
        assert kids == top, (path, kids, top)
        checked += 1
    assert checked >= 1


def test_add_branches_merges_common_prefixes():
    tree = tree_of([[(-1, 5), (0, 6)], [(-1, 1)]])
    merged = add_branches(tree, [[5, 6, 7], []])
    assert merged.tokens.tolist() == [[5, 6, 7], [1, -1, -1]]
    assert merged.parents[0].tolist() == [-1, 0, 1] and merged.depth[0].tolist() == [1, 2, 3]
    assert merged.source[0].tolist() == [SOURCE_HEAD | SOURCE_LOOKUP] * 2 + [SOURCE_LOOKUP]
    assert merged.source[1].tolist()[0] == SOURCE_HEAD
    other = add_branches(tree, [[9], [1, 2]])
    assert other.tokens.tolist()[0] == [5, 6, 9] and other.parents[0].tolist() == [-1, 0, -1]


def test_settings_validate_and_describe():
    s = DraftSettings.from_dict({"mode": "hybrid", "topk": 2, "depth": 3, "budget": 8, "lookup_len": 6})
    assert s.describe() == "hybrid: tree topk=2 depth=3 budget=8 + lookup branch 6"
    assert DraftSettings.from_dict(s.to_dict()) == s
    with pytest.raises(DraftSettingsError, match="draft.topk"):
        DraftSettings(topk=0)
    with pytest.raises(DraftSettingsError, match="unknown field.*width"):
        DraftSettings.from_dict({"width": 3})
    with pytest.raises(DraftSettingsError, match="mode"):
        DraftSettings(mode="beam")


# ---------------------------------------------------------------------------------------------
# 3. The loop
# ---------------------------------------------------------------------------------------------


SHAPES = [TreeShape(1, 3, 3), TreeShape(3, 4, 10), TreeShape(4, 2, 20)]


@pytest.mark.parametrize("family, extra", [("eagle", {"draft_vocab_size": 40}), ("eagle3", {"draft_vocab_size": 50}),
                                           ("mtp", {}), ("medusa", {"num_heads": 4})])
def test_tree_greedy_fp32_equals_plain_decoding(target, reference, family, extra):
    """A head fitted to these prompts' continuations, so deep nodes are accepted (tau asserted) and
    the roll-back keeps paths through the tree, not just the root."""
    prompts, ref = reference
    torch.manual_seed(0)
    head = build_head({"type": family, **extra}, target)
    fit_on_greedy_continuations(target, head, steps=60, prompts=prompts, new_tokens=24, length=None)
    head.eval()
    for shape in SHAPES:
        for batch in (1, 4):
            outs, stats = [], None
            for i in range(0, len(prompts), batch):
                o, s = SpecDecoder(target, head, tree=shape, stop_ids=[]).generate(prompts[i: i + batch], 24)
                outs += o
                assert sum(s.accepted_hist) == s.row_steps
                stats = s if stats is None else stats.__iadd__(s)
            assert outs == [r[:24] for r in ref], (family, shape, batch)
            deep = sum(stats.accepted_hist[2:])  # steps that accepted a node at depth >= 2
            assert stats.tau >= 2.0 and deep > 0, (family, shape, stats.to_dict())


def test_trained_head_tree_and_hybrid_are_lossless_and_accept(tiny_target):
    head = build_head({"type": "eagle"}, tiny_target)
    from tests.conftest import LOOP_PROMPTS
    ref = fit_on_greedy_continuations(tiny_target, head, steps=150)
    head.eval()
    for settings in (DraftSettings(mode="tree", topk=3, depth=4, budget=12),
                     DraftSettings(mode="hybrid", topk=2, depth=3, budget=6, lookup_len=5)):
        drafter, kw = settings.decoder_args(head)
        out, stats = SpecDecoder(tiny_target, drafter, stop_ids=[], **kw).generate(LOOP_PROMPTS, 16)
        assert out == ref
        assert stats.tau > 1.5, stats.to_dict()  # the trained head's drafts are accepted
        assert stats.accepted_by_source.get("head", 0) + stats.accepted_by_source.get("both", 0) > 0


class OracleTree:
    """The reference continuation as one branch, with a wrong sibling (+1, with its own child) at
    every level: the walk must find the right branch at each depth."""

    feature_layers = ()
    family = "oracle-tree"

    def __init__(self, prompts, refs):
        self.full = [p + r for p, r in zip(prompts, refs)]

    def new_draft_state(self, batch_size):
        return [0] * batch_size

    def draft_tree(self, state, feats, next_tokens, valid, shape):
        rows = []
        for b in range(len(state)):
            state[b] += int(valid[b].sum())
            seq = self.full[b][state[b] + 1: state[b] + 1 + shape.depth]
            nodes, parent = [], -1
            for t in seq:
                nodes.append((parent, (t + 1) % V))  # wrong sibling first
                nodes.append((len(nodes) - 1, t))  # ... with a child of its own
                nodes.append((parent, t))
                parent = len(nodes) - 1
            rows.append(nodes or [(-1, 0)])
        return tree_of(rows)


def test_oracle_tree_accepts_every_level(target, reference):
    prompts, ref = reference
    depth = 3
    n = 1 + 4 * (depth + 1)
    out, stats = SpecDecoder(target, OracleTree(prompts, ref), tree=TreeShape(2, depth, 9),
                             stop_ids=[]).generate(prompts, n)
    assert out == [r[:n] for r in ref]
    assert stats.tau == depth + 1 and stats.acceptance_per_position == [1.0] * depth
    assert stats.steps == 4


def test_rows_do_not_depend_on_other_rows_drafts(target):
    """T > 0, lookup drafts of different widths per row: a row decoded alone or in a batch gives
    the same tokens (its random numbers come from its own generator, a fixed count per step)."""
    params = SamplingParams(temperature=0.9)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 13], [20, 21, 20, 21, 20]]
    seeds = [3, 4, 5]
    for kw in ({"k": 4}, {"tree": TreeShape(1, 4, 4)}):
        batch, _ = SpecDecoder(target, NgramDrafter(), stop_ids=[], **kw).generate(prompts, 16, params, seeds)
        for i in range(3):
            alone, _ = SpecDecoder(target, NgramDrafter(), stop_ids=[], **kw).generate(prompts[i:i + 1], 16,
                                                                                     params, seeds[i:i + 1])
            assert alone[0] == batch[i], (kw, i)


def test_tree_sampling_follows_the_joint_law_of_the_target():
    """T > 0 through the whole loop in hybrid mode (the head's EAGLE-2 tree plus a lookup branch):
    the first 3 emitted tokens (prefill's, then the walk's draws at the root and at an accepted
    depth-1 node, so the third token is most often an accepted depth-2 node's) follow the target's
    exact joint law over V^3 (chi-square, false alarm < 1e-6). A head fitted to the target makes
    deep acceptance common; the prompt repeats itself, so lookup proposes a branch."""
    target = small_vocab_target()
    params = SamplingParams(temperature=1.0)
    prompt, n = [3, 4, 5, 3, 4, 5, 3, 4], 10_000
    torch.manual_seed(1)
    head = build_head({"type": "eagle", "num_layers": 1}, target)
    seqs = torch.randint(0, SMALL_V, (16, 16), generator=torch.Generator().manual_seed(0))
    fit(head, target.features(torch.cat([torch.tensor(prompt).expand(16, -1), seqs], 1), None, head.feature_layers),
        steps=100, lr=1e-2)  # q ~ p at T = 1: its top-3 children hold most of the target's mass
    drafter, kw = DraftSettings(mode="hybrid", topk=3, depth=3, budget=12, lookup_len=3).decoder_args(head.eval())
    dec = SpecDecoder(target, drafter, stop_ids=[], **kw)
    first = []
    dec.observer = lambda tree, verdict: first.append((tree, verdict)) if not first else None
    out, stats = dec.generate([prompt] * n, 3, params, seeds=list(range(n)))
    p = law_p_value(out, continuation_law(target, prompt, 3, params))
    assert p > P_FALSE_ALARM, p
    tree, v = first[0]
    accepted_source = tree.source.gather(1, v.path.clamp(min=1) - 1)  # (B, D) flags of the accepted nodes
    deep = v.num_accepted >= 2
    assert deep.float().mean() > 0.4, deep.float().mean()  # the third token: mostly a depth-2 node's
    assert int((deep & (accepted_source[:, 1] & SOURCE_LOOKUP).bool()).sum()) > 50  # ... some from lookup
    assert stats.accepted_by_source.get("lookup", 0) > 0 and stats.accepted_by_source.get("head", 0) > 0


def test_bad_tree_settings(target):
    medusa = build_head({"type": "medusa", "num_heads": 2}, target)
    with pytest.raises(SpecError, match="deeper than"):
        SpecDecoder(target, medusa, tree=TreeShape(2, 3, 6))
    mtp2 = build_head({"type": "mtp", "num_depths": 2}, target)
    with pytest.raises(SpecError, match="deeper than"):
        SpecDecoder(target, mtp2, tree=TreeShape(2, 2, 6))
    SpecDecoder(target, mtp2, tree=TreeShape(4, 1, 4))  # depth 1 works for any D

    class ChainOnly:
        feature_layers = ()
        family = "chain-only"
    with pytest.raises(SpecError, match="cannot draft trees"):
        SpecDecoder(target, ChainOnly(), tree=TreeShape())
    with pytest.raises(SpecError, match="typical"):
        SpecDecoder(target, build_head({"type": "eagle"}, target), tree=TreeShape(), acceptance="typical")
    with pytest.raises(ValueError, match="tree budget"):
        TreeShape(2, 2, 0)


def test_hybrid_without_a_match_is_the_heads_tree(target):
    """No repeated n-gram in the prompt: the hybrid's tree is exactly the head's tree."""
    head = build_head({"type": "eagle"}, target).eval()
    hybrid = HybridDrafter(head, NgramDrafter(), 5)
    prompt = [[3, 4, 5, 6, 7, 8, 9]]
    from draftkit.inference.cache import TargetCache, left_pad
    ids, valid = left_pad(prompt, target.device)
    tc = TargetCache(target, 1, head.feature_layers)
    _, feats = tc.forward(ids, valid)
    nxt = torch.cat([ids[:, 1:], torch.tensor([[11]])], 1)
    shape = TreeShape(2, 3, 6)
    a = hybrid.draft_tree(hybrid.new_draft_state(1), feats, nxt, valid, shape)
    b = head.draft_tree(head.new_draft_state(1), feats, nxt, valid, shape)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
