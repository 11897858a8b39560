"""The cost model (draftkit.inference.cost): exact simulation of smaller trees from a recorded big
tree, and a choice that follows the measured costs."""
from __future__ import annotations

import pytest

from draftkit.inference.cost import CostProfile, StepRecord, choose, simulate
from draftkit.inference.drafters import DraftSettings

NEG = float("-inf")


def step(path_nodes, other_nodes):
    """nodes: (score, depth, lookup?, on path?)"""
    return StepRecord([(s, d, lk, True) for s, d, lk in path_nodes] + [(s, d, lk, False) for s, d, lk in other_nodes],
                      len(path_nodes))


# Step 1: the head's best path is accepted three deep; step 2: only lookup's branch is accepted.
RECORDS = [
    step([(-0.1, 1, False), (-0.3, 2, False), (-0.9, 3, False)], [(-0.5, 1, False), (-0.6, 2, False)]),
    step([(NEG, 1, True), (NEG, 2, True), (NEG, 3, True)], [(-0.2, 1, False), (-0.4, 2, False)]),
]


def test_simulate_counts_the_kept_prefix_of_the_path():
    # budget 2: kept head nodes (-0.1, -0.3) in step 1 -> 2 accepted; step 2: nothing (no lookup) -> 0
    tau, shape = simulate(RECORDS, budget=2, depth=3, lookup_len=0, head_off_at=None)
    assert tau == ((2 + 1) + (0 + 1)) / 2 and shape == [(3, True), (3, True)]
    # budget 5 depth 2: the third path node is too deep
    tau, _ = simulate(RECORDS, budget=5, depth=2, lookup_len=0, head_off_at=None)
    assert tau == (3 + 1) / 2
    # lookup branch of 2: step 2 accepts 2 of lookup's 3; budget 3 keeps -0.1 -0.3 -0.5 in step 1 (2 accepted)
    tau, shape = simulate(RECORDS, budget=3, depth=3, lookup_len=2, head_off_at=None)
    assert tau == ((2 + 1) + (2 + 1)) / 2 and shape[1] == (2 + 2 + 1, True)  # 2 head nodes exist, 2 lookup, root
    # head off when lookup proposes >= 2: step 2 verifies lookup's 2 alone
    tau, shape = simulate(RECORDS, budget=3, depth=3, lookup_len=2, head_off_at=2)
    assert shape[1] == (3, False) and tau == ((2 + 1) + (2 + 1)) / 2


def profile(verify_slope: float) -> CostProfile:
    verify = {w: 10.0 + verify_slope * w for w in (1, 2, 4, 8, 16, 32, 64)}
    draft = {(k, d): 1.0 * d for k in (1, 2) for d in range(1, 4)}
    return CostProfile(verify, draft, consume_ms=0.5, overhead_ms=0.0, steps={2: RECORDS})


@pytest.mark.parametrize("slope, small", [(50.0, True), (0.0, False)])
def test_choice_follows_the_measured_verify_cost(slope, small):
    chosen, rows = choose(profile(slope), DraftSettings(), max_depth=3)
    best = rows[0]
    assert chosen.topk == best["topk"] and chosen.budget == best["budget"] and chosen.depth == best["depth"]
    assert rows == sorted(rows, key=lambda r: -r["tokens_per_s"])
    _, shape = simulate(RECORDS, best["budget"], best["depth"], best["lookup_len"], best["head_off_at"])
    width = sum(w for w, _ in shape) / len(shape)
    # expensive verify width -> a narrow tree; free width -> the tree that accepts the most
    if small:
        assert width <= 4 and best["tau"] < max(r["tau"] for r in rows), (best, width)
    else:
        assert best["tau"] == max(r["tau"] for r in rows)
