"""Draft trees: their shape, how a head grows one (EAGLE-2), how lookup branches merge in, and the
lossless acceptance rule that walks one.

A tree is drafted after the newest confirmed token (the *root*, the loop's pending token) and is
verified in ONE target forward: the root and the N nodes are fed as N+1 slots, node i at rotary
position next_pos + depth_i, attending to the confirmed cache and to its own ancestors only
(`ancestor_mask`). A chain is the tree whose every node has one child.

Growing (EAGLE-2, Li et al. 2024, "dynamic draft trees"): the score of a node is the cumulative
draft log-probability of its path. Depth 1 holds the root's top-`topk` tokens; at each further
depth the `topk` highest-scoring nodes of the depth before (the frontier) are fed to the head, each
proposes its top-`topk` children, and all of them join the candidate pool. At the end the `budget`
best candidates by score are kept. Scores never increase along a path, and ties are broken towards
the earlier candidate (a parent precedes its children), so the kept set is a connected subtree.

Acceptance rule (`accept_tree`), the same code for every temperature:
    node = root
    loop:  t = a draw from p_node (the target's processed distribution at that node; argmax at T = 0)
           if t is a child of node:  accept it, node = that child          (descend)
           else:                     emit t and stop                        (the correction / bonus)
LOSSLESS, proof sketch: each emitted token is drawn from the target's own distribution given
everything emitted before it (the node's slot saw exactly the root path as context), and whether
the walk continues depends only on that draw. So the emitted sequence is generated token by token
from p, as plain sampling would, whatever the tree: the tree only decides how many of those draws
one forward pays for. At T = 0 the draw is the argmax: the walk is the longest path of target
argmaxes. Children are the drafter's deterministic top-k (never sampled from q), so no residual
distribution is needed; with one child this is the chain rule with one-hot drafts (accept d with
probability p(d), else draw from p without d), which `rejection.py` implements.

Randomness: one noise row 1/Exp(1) per depth per row, drawn from the row's own generator for the
full configured depth every step (`tree_noise`), so a row's stream never depends on other rows.
The walk visits exactly one node per depth, so sharing a noise row between the nodes of a depth
never reuses a draw. Why torch and not Triton: a step costs depth+1 (B, V) argmaxes, each one fused
torch op over the logits of the visited nodes only; a kernel would save launches, not bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from draftkit.inference.rejection import inverse_exponential, race_sample
from draftkit.inference.sampling import SamplingParams, exponential, logits_to_probs

SOURCE_HEAD, SOURCE_LOOKUP = 1, 2  # bit flags of DraftTree.source


@dataclass(frozen=True)
class TreeShape:
    """How big a tree the head grows: `topk` children per expanded node and frontier width, `depth`
    levels, `budget` nodes kept (the verify forward feeds budget + 1 tokens). topk = 1 is a chain."""

    topk: int = 4
    depth: int = 5
    budget: int = 16

    def __post_init__(self):
        for name in ("topk", "depth", "budget"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"tree {name} must be an integer >= 1, got {v!r}")

    @property
    def max_nodes(self) -> int:
        """Nodes the pool can hold (budget is capped by it)."""
        return self.topk + (self.depth - 1) * self.topk * self.topk


@dataclass
class DraftTree:
    """Trees of a batch, padded to N nodes, nodes in topological order (parent index < own index).

    tokens  (B, N) int64 target token ids, -1 = no node (rows are ragged)
    parents (B, N) int64 index of the parent node, -1 = child of the root
    depth   (B, N) int64, 1 for children of the root
    source  (B, N) uint8 bit flags: SOURCE_HEAD | SOURCE_LOOKUP (merged nodes carry both)
    Siblings always hold distinct tokens.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    source: Tensor
    score: Tensor | None = None  # (B, N) float: the head's cumulative log-prob (-inf: not the head's)

    @property
    def num_nodes(self) -> Tensor:
        return (self.tokens >= 0).sum(1)  # (B,)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.tokens.numel() else 0

    @classmethod
    def empty(cls, batch_size: int, device) -> "DraftTree":
        z = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone(), z.to(torch.uint8))

    @classmethod
    def chains(cls, tokens: Tensor, source: int = SOURCE_HEAD) -> "DraftTree":
        """(B, k) chain drafts (-1 = stop) as trees."""
        B, k = tokens.shape
        live = (tokens >= 0).long().cumprod(1).bool()  # a -1 ends the chain
        idx = torch.arange(k, device=tokens.device).expand(B, k)
        return cls(torch.where(live, tokens, -1), idx - 1, idx + 1,
                   torch.where(live, source, 0).to(torch.uint8))

    def ancestor_mask(self) -> Tensor:
        """(B, N+1, N+1) bool over [root, nodes]: entry (i, j) = j is i itself or an ancestor of i."""
        B, N = self.tokens.shape
        dev = self.tokens.device
        parent_slot = torch.where(self.tokens >= 0, self.parents + 1, 0)  # (B, N) slot of the parent
        step = torch.zeros(B, N + 1, N + 1, device=dev)  # step[i, parent(i)] = 1
        step[:, 1:] = torch.nn.functional.one_hot(parent_slot, N + 1).float()
        reach = torch.eye(N + 1, device=dev).expand(B, -1, -1).clone()
        anc = reach.bool()
        for _ in range(self.max_depth):  # follow parents one level per round
            reach = reach @ step
            anc |= reach.bool()
        anc[:, 1:, 0] = True  # the root is everyone's ancestor (dead nodes too: harmless)
        return anc


# ---------------------------------------------------------------------------------------------
# Growing a tree from a head (EAGLE-2)
# ---------------------------------------------------------------------------------------------

# step(parent_hidden (B, m, H) | None, tokens (B, m), depth, spec_visible (B, m, n_fed)) -> hidden (B, m, H)
StepFn = Callable[[Tensor | None, Tensor, int, Tensor], Tensor]
# logp(hidden (B, m, H), depth) -> (B, m, V) log-probabilities of the children (target vocabulary)
LogpFn = Callable[[Tensor, int], Tensor]


def grow_tree(root_hidden: Tensor, logp: LogpFn, step: StepFn, shape: TreeShape,
              token_map: Tensor | None = None) -> DraftTree:
    """EAGLE-2 dynamic tree (module doc). root_hidden (B, H): the head's state after the root.

    The head only provides `logp` (children of a fed node) and `step` (feed frontier nodes: their
    parents' hidden, their tokens, depth d (1-based) and which already-fed nodes they may attend to,
    ancestors and themselves). `logp` may be over a draft vocabulary: token_map (V',) then gives
    the target id of each of its entries. Returns the best `budget` candidates as a DraftTree.
    """
    if token_map is not None:
        inner = step
        step = lambda h, tokens, d, visible: inner(h, token_map[tokens], d, visible)  # noqa: E731
    B, dev = root_hidden.shape[0], root_hidden.device
    k = shape.topk
    lp = logp(root_hidden[:, None], 1)[:, 0]  # (B, V)
    score, tok = lp.topk(k, dim=-1)  # (B, k) depth-1 candidates
    pool_tok, pool_par, pool_score, pool_depth = [tok], [torch.full_like(tok, -1)], [score], [torch.ones_like(tok)]
    frontier = torch.arange(k, device=dev).expand(B, k)  # pool indices of the nodes to feed next
    fed_pool = torch.zeros(B, 0, dtype=torch.long, device=dev)  # pool index of each fed slot
    fed_hidden = root_hidden.new_zeros(B, 0, root_hidden.shape[-1])
    anc_pool = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # ancestor-or-self over the pool so far
    for d in range(1, shape.depth):
        tokens, parents, scores = (torch.cat(x, 1) for x in (pool_tok, pool_par, pool_score))
        anc_pool = _extend_ancestry(anc_pool, parents)
        # feed the frontier: each sees the fed slots that are its ancestors, and itself
        f_tok = tokens.gather(1, frontier)  # (B, k)
        f_par = parents.gather(1, frontier)
        if d == 1:
            parent_h = root_hidden[:, None].expand(B, k, -1)
        else:
            par_slot = (fed_pool[:, None, :] == f_par[:, :, None]).float().argmax(-1)  # (B, k) fed slot of parent
            parent_h = fed_hidden.gather(1, par_slot[..., None].expand(-1, -1, fed_hidden.shape[-1]))
        anc_f = anc_pool.gather(1, frontier[..., None].expand(-1, -1, anc_pool.shape[2]))  # (B, k, P)
        visible = torch.cat([anc_f.gather(2, fed_pool[:, None, :].expand(-1, k, -1)),
                             torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)], dim=2)
        hidden = step(parent_h, f_tok, d, visible)  # (B, k, H)
        fed_pool = torch.cat([fed_pool, frontier], 1)
        fed_hidden = torch.cat([fed_hidden, hidden], 1)
        # children: top-k of each frontier node, scored by the path's cumulative log-probability
        child_lp, child_tok = logp(hidden, d + 1).topk(k, dim=-1)  # (B, k, k)
        f_score = scores.gather(1, frontier)
        child_score = (f_score[:, :, None] + child_lp).flatten(1)  # (B, k*k)
        base = tokens.shape[1]
        pool_tok.append(child_tok.flatten(1))
        pool_par.append(frontier[:, :, None].expand(B, k, k).flatten(1))
        pool_score.append(child_score)
        pool_depth.append(torch.full_like(child_tok.flatten(1), d + 1))
        frontier = base + _stable_top(child_score, k)
    tokens, parents, scores, depth = (torch.cat(x, 1) for x in (pool_tok, pool_par, pool_score, pool_depth))
    if token_map is not None:
        tokens = token_map[tokens]
    return _select(tokens, parents, scores, depth, shape.budget)


def _stable_top(score: Tensor, n: int) -> Tensor:
    """Indices of the n highest scores, ties to the lower index (so a parent beats its child)."""
    return torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]


def _extend_ancestry(anc: Tensor, parents: Tensor) -> Tensor:
    """Grow the (B, P, P) ancestor-or-self matrix to the pool's new size P' (parents (B, P')).
    New candidates' parents are all older candidates, so one gather of their rows suffices."""
    B, P = anc.shape[:2]
    P2 = parents.shape[1]
    out = torch.zeros(B, P2, P2, dtype=torch.bool, device=parents.device)
    out[:, :P, :P] = anc
    par = parents[:, P:]  # (B, P2 - P)
    rows = out.gather(1, par.clamp(min=0)[..., None].expand(-1, -1, P2))  # (B, P2 - P, P2)
    out[:, P:] = rows & (par >= 0)[..., None]
    idx = torch.arange(P, P2, device=parents.device)
    out[:, idx, idx] = True
    return out


def _select(tokens, parents, scores, depth, budget: int) -> DraftTree:
    """Keep the `budget` best candidates (finite score), in pool order, parents re-indexed."""
    B, P = tokens.shape
    n = min(budget, P)
    scores = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("-inf")))
    keep_idx = _stable_top(scores, n).sort(dim=1).values  # (B, n) pool order = topological order
    kept_ok = torch.isfinite(scores.gather(1, keep_idx))
    new_index = torch.full((B, P), -1, dtype=torch.long, device=tokens.device)
    new_index.scatter_(1, keep_idx, torch.arange(n, device=tokens.device).expand(B, n))
    par = parents.gather(1, keep_idx)
    new_par = torch.where(par >= 0, new_index.gather(1, par.clamp(min=0)), -1)
    # Parents rank before their children (score never rises along a path; ties go to the earlier
    # candidate), so a kept node's parent is kept unless it had score -inf, and then so does the node.
    ok = kept_ok & ((par < 0) | (new_par >= 0))
    toks = torch.where(ok, tokens.gather(1, keep_idx), -1)
    return DraftTree(toks, torch.where(ok, new_par, -1), torch.where(ok, depth.gather(1, keep_idx), 0),
                     ok.to(torch.uint8) * SOURCE_HEAD,
                     torch.where(ok, scores.gather(1, keep_idx), float("-inf")))


# ---------------------------------------------------------------------------------------------
# Merging a lookup branch into a tree
# ---------------------------------------------------------------------------------------------


def add_branches(tree: DraftTree, branches: list[list[int]], source: int = SOURCE_LOOKUP) -> DraftTree:
    """Merge one chain per row (from the root) into the tree: nodes it shares with the tree (same
    tokens along the same path) get the source flag, the rest are appended. Rows: branches[b]."""
    B = tree.tokens.shape[0]
    rows = []
    score = tree.score if tree.score is not None else torch.full(tree.tokens.shape, float("-inf"))
    tok_l, par_l, dep_l, src_l, sc_l = (x.tolist() for x in (tree.tokens, tree.parents, tree.depth, tree.source, score))
    for b in range(B):
        toks, pars, deps, srcs, scs = ([v for v, t in zip(x[b], tok_l[b]) if t >= 0]
                                       for x in (tok_l, par_l, dep_l, src_l, sc_l))
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks))}
        node = -1
        for depth, t in enumerate(branches[b] if b < len(branches) else [], start=1):
            i = children.get((node, t))
            if i is None:
                i = len(toks)
                toks.append(t), pars.append(node), deps.append(depth), srcs.append(0), scs.append(float("-inf"))
                children[(node, t)] = i
            srcs[i] |= source
            node = i
        rows.append((toks, pars, deps, srcs, scs))
    N = max((len(r[0]) for r in rows), default=0)
    dev = tree.tokens.device

    def pad(i, fill, dtype=torch.long):
        return torch.tensor([r[i] + [fill] * (N - len(r[i])) for r in rows], dtype=dtype, device=dev).view(B, N)
    return DraftTree(pad(0, -1), pad(1, -1), pad(2, 0), pad(3, 0, torch.uint8), pad(4, float("-inf"), torch.float32))


# ---------------------------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------------------------


@dataclass
class TreeVerdict:
    """What `accept_tree` decided, per row.

    tokens   (B, D+1) the emitted tokens: accepted nodes' tokens then the correction / bonus, -1 pad
    num_accepted (B,) accepted nodes (0..D)
    path     (B, D) block slot (1 + node index) of each accepted node, in order, -1 pad
    offered  (B, D) bool: the walk stood at depth i with at least one child to try
    """

    tokens: Tensor
    num_accepted: Tensor
    path: Tensor
    offered: Tensor


def tree_noise(depth: int, vocab: int, generators) -> Tensor:
    """(B, depth+1, V) float32 1/Exp(1), each row from its own generator (a fixed amount per step)."""
    return inverse_exponential(exponential((len(generators), depth + 1, vocab), generators))


def accept_tree(tree: DraftTree, logits: Tensor, params: SamplingParams, noise: Tensor | None,
                depth: int | None = None) -> TreeVerdict:
    """The walk of the module doc, vectorised over rows. logits (B, N+1, V): the target's raw
    logits at [root, nodes]; noise (B, >= D+1, V) from tree_noise (unused when greedy)."""
    B, N = tree.tokens.shape
    D = tree.max_depth if depth is None else depth
    dev = logits.device
    rows = torch.arange(B, device=dev)
    alive = tree.tokens >= 0
    out = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    path = torch.full((B, D), -1, dtype=torch.long, device=dev)
    offered = torch.zeros(B, D, dtype=torch.bool, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # slot: 0 = root, 1 + i = node i
    walking = torch.ones(B, dtype=torch.bool, device=dev)
    num_acc = torch.zeros(B, dtype=torch.long, device=dev)
    for j in range(D + 1):
        t = draw(logits[rows, cur], params, None if noise is None else noise[:, j])  # (B,)
        out[:, j] = torch.where(walking, t, out[:, j])
        kids = alive & (tree.parents + 1 == cur[:, None])  # (B, N) children of the current node
        if j < D:
            offered[:, j] = walking & kids.any(1)
        match = kids & (tree.tokens == t[:, None])
        descend = walking & match.any(1) & (j < D)
        nxt = match.float().argmax(1) + 1 if N else cur
        if j < D:
            path[:, j] = torch.where(descend, nxt, -1)
        num_acc += descend.long()
        cur = torch.where(descend, nxt, cur)
        walking = descend
        if not bool(walking.any()):
            break
    return TreeVerdict(out, num_acc, path, offered)


def draw(logits: Tensor, params: SamplingParams, noise: Tensor | None) -> Tensor:
    """(B, V) raw logits -> (B,) the target's token: argmax, or the exponential race with noise."""
    if params.greedy:
        return logits.argmax(-1)
    return race_sample(logits_to_probs(logits, params), noise)
