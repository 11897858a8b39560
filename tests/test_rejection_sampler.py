"""Rejection sampler tests, mirroring the ways it can be wrong.

1. torch reference == per-row loop oracle (greedy / stochastic, one-hot or given draft probs,
   ragged num_draft including 0, ties, zero probabilities).
2. Triton kernels == torch reference bit for bit, under TRITON_INTERPRET=1 in a subprocess (so
   no other test module can have imported triton in interpreter-less mode first).
3. Distribution: 10^6 vectorised steps match the exact analytic output distribution within a
   derived total-variation bound, and the same statistic rejects two classic bugs.
4. logits_to_probs (temperature, top-k then top-p, greedy one-hot) and the sampler's per-row
   reproducibility.

Run this file as a script (`python tests/test_rejection_sampler.py triton-parity`) to execute
the Triton parity check directly.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftkit.inference.rejection import RejectionSampler, rejection_sample, rejection_sample_loop
from draftkit.inference.sampling import SamplingParams, logits_to_probs, make_generators

REPO_ROOT = Path(__file__).resolve().parents[1]
REGIMES = ("far", "close", "ties", "sparse")


# ---------------------------------------------------------------------------------------------
# Random cases
# ---------------------------------------------------------------------------------------------


def random_case(gen: torch.Generator, B: int, k: int, V: int, regime: str, greedy: bool) -> dict:
    """Inputs for rejection_sample; `regime` steers towards the corners worth hitting."""
    if regime == "ties":  # small integer logits: many exact ties in argmax and in p, q
        p_logits = torch.randint(0, 3, (B, k + 1, V), generator=gen).float()
        q_logits = torch.randint(0, 3, (B, k, V), generator=gen).float()
    else:
        p_logits = 2 * torch.randn(B, k + 1, V, generator=gen)
        # "close": the draft nearly agrees with the target, so long accepted runs and bonuses
        noise_scale = 0.3 if regime == "close" else 2.0
        q_center = p_logits[:, :k] if regime == "close" else 0
        q_logits = q_center + noise_scale * torch.randn(B, k, V, generator=gen)
    if regime == "sparse":  # exact zeros in p and q, also at drafted tokens (q == 0 / p == 0)
        p_logits = p_logits.masked_fill(torch.rand(B, k + 1, V, generator=gen) < 0.5, float("-inf"))
        q_logits = q_logits.masked_fill(torch.rand(B, k, V, generator=gen) < 0.5, float("-inf"))
        p_logits[..., 0] = 0.0  # keep every row normalisable
        q_logits[..., 0] = 0.0
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    if greedy:  # the target's argmax, corrupted now and then, gives every accepted length
        drafts = p[:, :k].argmax(-1)
        corrupt = torch.rand(B, k, generator=gen) < 0.25
        drafts = torch.where(corrupt, torch.randint(0, V, (B, k), generator=gen), drafts)
    elif regime == "sparse":  # uniform drafts do hit q == 0 and p == 0 tokens
        drafts = torch.randint(0, V, (B, k), generator=gen)
    elif k == 0:
        drafts = torch.zeros(B, 0, dtype=torch.long)
    else:  # sampled from the draft distribution, as a real head would
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, k)
    return dict(
        draft_tokens=drafts,
        draft_probs=q,
        target_probs=p_logits if greedy and regime == "ties" else p,  # greedy takes any scores
        num_draft=torch.randint(0, k + 1, (B,), generator=gen),
        accept_uniform=torch.rand(B, k, generator=gen),
        sample_noise=torch.empty(B, V).exponential_(generator=gen).reciprocal(),
        greedy=greedy,
    )


def all_cases(seed: int, n_per_combo: int, max_v: int = 64):
    gen = torch.Generator().manual_seed(seed)
    for i in range(n_per_combo):
        for regime in REGIMES:
            for greedy in (True, False):
                for one_hot in (True, False):
                    B = int(torch.randint(1, 5, (1,), generator=gen))
                    k = int(torch.randint(0, 5, (1,), generator=gen)) if i % 4 else 4
                    V = int(torch.randint(2, max_v + 1, (1,), generator=gen))
                    case = random_case(gen, B, k, V, regime, greedy)
                    if one_hot:
                        case["draft_probs"] = None
                    yield f"{regime}/greedy={greedy}/one_hot={one_hot}/B={B},k={k},V={V}", case


Result = tuple[torch.Tensor, torch.Tensor]  # (output_tokens (B, k+1), num_accepted (B,))


def assert_same(a: Result, b: Result, name: str) -> None:
    assert torch.equal(a[1], b[1]), f"{name}: num_accepted {a[1].tolist()} != {b[1].tolist()}"
    assert torch.equal(a[0], b[0]), f"{name}: tokens {a[0].tolist()} != {b[0].tolist()}"


def check_output_contract(out: torch.Tensor, num_accepted: torch.Tensor, case: dict) -> None:
    """Structure that must hold whatever the random inputs: prefix of drafts, one token, -1s."""
    for b in range(out.shape[0]):
        n_acc, n = int(num_accepted[b]), int(case["num_draft"][b])
        assert 0 <= n_acc <= n
        assert torch.equal(out[b, :n_acc], case["draft_tokens"][b, :n_acc])
        assert out[b, n_acc] >= 0
        assert (out[b, n_acc + 1 :] == -1).all()


# ---------------------------------------------------------------------------------------------
# 1. Reference == loop oracle
# ---------------------------------------------------------------------------------------------


def test_reference_matches_loop_oracle():
    accepted_lengths = set()
    for name, case in all_cases(seed=0, n_per_combo=12):
        ref = rejection_sample(**case)
        assert_same(ref, rejection_sample_loop(**case), name)
        check_output_contract(*ref, case)
        accepted_lengths.update((ref[1] == case["num_draft"]).tolist())
    assert accepted_lengths == {True, False}, "cases must exercise both the bonus and rejections"


def test_greedy_example_by_hand():
    target = torch.tensor([[[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.2, 0.6]]])  # argmax 1, 0, 2
    num_draft = torch.tensor([2])
    full = rejection_sample(torch.tensor([[1, 0]]), None, target, num_draft, None, None, greedy=True)
    assert full[0].tolist() == [[1, 0, 2]] and full[1].tolist() == [2]  # both accepted + bonus
    miss = rejection_sample(torch.tensor([[1, 2]]), None, target, num_draft, None, None, greedy=True)
    assert miss[0].tolist() == [[1, 0, -1]] and miss[1].tolist() == [1]  # corrected at position 1
    none = rejection_sample(torch.tensor([[2, 2]]), None, target, torch.tensor([0]), None, None, True)
    assert none[0].tolist() == [[1, -1, -1]] and none[1].tolist() == [0]  # no drafts: bonus only


# accept iff u * q(d) < p(d), target row 0 = (0.5, 0.5, 0): (draft, q row, u, expected output row)
ACCEPT_EDGES = [
    (0, [0.0, 0.0, 1.0], 0.999, [0, 2]),  # q(d) = 0 < p(d): ratio inf, accepted; bonus = token 2
    (2, [0.0, 0.0, 1.0], 0.0, [0, -1]),  # p(d) = 0: rejected even with u = 0; residual -> 0
    (0, [1.0, 0.0, 0.0], 0.4999, [0, 2]),  # 0.4999 * 1 < 0.5: accepted
    (0, [1.0, 0.0, 0.0], 0.5, [1, -1]),  # 0.5 * 1 < 0.5 is false; residual (0, 0.5, 0) -> 1
]


def accept_edge_case(draft: int, q_row: list[float], u: float) -> dict:
    return dict(
        draft_tokens=torch.tensor([[draft]]),
        draft_probs=torch.tensor([[q_row]]),
        target_probs=torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]]),  # (1, 2, V)
        num_draft=torch.tensor([1]),
        accept_uniform=torch.tensor([[u]]),
        sample_noise=torch.ones(1, 3),
        greedy=False,
    )


@pytest.mark.parametrize("draft, q_row, u, expected", ACCEPT_EDGES)
def test_stochastic_accept_comparison_edges(draft, q_row, u, expected):
    out, num_accepted = rejection_sample(**accept_edge_case(draft, q_row, u))
    assert out.tolist() == [expected] and num_accepted.item() == int(expected[1] != -1)


# ---------------------------------------------------------------------------------------------
# 2. Triton == reference (interpreter, in a subprocess)
# ---------------------------------------------------------------------------------------------


def triton_parity() -> int:
    """Runs under TRITON_INTERPRET=1; raises on the first mismatch, returns the case count."""
    from draftkit.inference.triton_rejection import rejection_sample_triton

    count = 0
    for name, case in all_cases(seed=1, n_per_combo=3, max_v=40):
        ref = rejection_sample(**case)
        # block_v=8 forces several V blocks with a ragged tail, exercising the blocked argmax
        assert_same(ref, rejection_sample_triton(**case, block_v=8), name)
        count += 1
    for draft, q_row, u, _ in ACCEPT_EDGES:  # exact-equality corners of the accept test
        case = accept_edge_case(draft, q_row, u)
        name = f"accept edge {draft, q_row, u}"
        assert_same(rejection_sample(**case), rejection_sample_triton(**case), name)
        count += 1
    # ties across V blocks: the lowest index must win even when it sits in a later lane
    scores = torch.zeros(1, 2, 24)
    scores[0, 0, [5, 9, 18]] = 1.0  # max at 5 (lane 5 of block 0), 9, and 18 (lane 2 of block 2)
    args = (torch.tensor([[5]]), None, scores, torch.tensor([1]), None, None, True)
    assert_same(rejection_sample(*args), rejection_sample_triton(*args, block_v=8), "cross-block tie")
    # the full sampler, logits in, with per-row generators on both backends
    gen = torch.Generator().manual_seed(2)
    all_params = [SamplingParams(), SamplingParams(0.8, top_k=5, top_p=0.9), SamplingParams(1.0)]
    for params in all_params:
        B, k, V = 3, 3, 33
        logits = torch.randn(B, k + 1, V, generator=gen)
        q = logits_to_probs(logits[:, :k] + 0.5 * torch.randn(B, k, V, generator=gen), params)
        drafts = q.argmax(-1)
        num_draft = torch.tensor([3, 0, 2])
        for draft_probs in (None, q):
            outs = [
                RejectionSampler(backend)(
                    drafts, draft_probs, logits, num_draft, params, make_generators([7, 8, 9])
                )
                for backend in ("torch", "triton")
            ]
            assert_same(outs[0], outs[1], f"RejectionSampler {params}")
            count += 1
    return count


def test_triton_matches_reference_interpreted():
    python_path = f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": python_path}
    result = subprocess.run(
        [sys.executable, __file__, "triton-parity"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "triton parity ok" in result.stdout


# ---------------------------------------------------------------------------------------------
# 3. Output distribution
# ---------------------------------------------------------------------------------------------
#
# Setting: k = 2 drafts, V = 5, fixed (context-free) distributions p_0, p_1, p_2 and q_0, q_1,
# drafts d_i ~ q_i independently. One step emits a sequence of 1, 2 or 3 tokens. Exactly:
#   P(d_0 = x and accepted) = q_0(x) * min(1, p_0(x)/q_0(x)) = a_0(x),  a_i := min(p_i, q_i)
#   P(first rejected) = 1 - sum a_0 = sum max(0, p_0 - q_0), and the recovered token is drawn
#   from r_0 := max(0, p_0 - q_0) normalised, so  P(emit (x), stop) = r_0(x). Continuing,
#     P(x)       = r_0(x)
#     P(x, y)    = a_0(x) r_1(y)
#     P(x, y, z) = a_0(x) a_1(y) p_2(z)         (z is the bonus)
#   and the first-token marginal is r_0 + a_0 = p_0: the target's distribution.
# We compare against this over all m = V + V^2 + V^3 outcomes.
#
# Bound: with n i.i.d. samples and empirical frequencies f, E ||f - P||_1 <= sum_j sqrt(P_j
# (1 - P_j) / n) (Jensen per outcome). Changing one sample moves ||f - P||_1 by at most 2/n, so
# McDiarmid gives P(||f - P||_1 >= E + t) <= exp(-n t^2 / 2); t = sqrt(2 ln(1/delta) / n) with
# delta = 1e-6. TV = ||f - P||_1 / 2, so a correct sampler exceeds
#   bound = (sum_j sqrt(P_j (1 - P_j) / n) + sqrt(2 ln(1/delta) / n)) / 2
# with probability < 1e-6 (the seed is fixed anyway; the bound says the seed is not cherry-picked).

N_SAMPLES = 1_000_000
DELTA = 1e-6
P_TARGET = torch.tensor([  # (k+1, V): p_0 differs a lot from q_0, so rejections are common
    [0.5, 0.2, 0.1, 0.1, 0.1],
    [0.1, 0.4, 0.3, 0.1, 0.1],
    [0.3, 0.1, 0.1, 0.2, 0.3],
])
Q_DRAFT = torch.tensor([  # (k, V): q_1 overlaps p_1 by 0.9, so full acceptance is common too
    [0.05, 0.05, 0.1, 0.3, 0.5],
    [0.2, 0.3, 0.3, 0.1, 0.1],
])


def exact_outcome_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(3, V) target, (2, V) draft (rows may be one-hot) -> (V + V^2 + V^3,) float64."""
    p, q = p.double(), q.double()
    a, r = torch.minimum(p[:2], q), (p[:2] - q).clamp_min(0)
    one = r[0]  # (V,)
    two = a[0][:, None] * r[1][None, :]  # (V, V)
    three = a[0][:, None, None] * a[1][None, :, None] * p[2][None, None, :]  # (V, V, V)
    return torch.cat([one, two.flatten(), three.flatten()])


def encode_outcomes(out: torch.Tensor, num_accepted: torch.Tensor, V: int) -> torch.Tensor:
    """(n, 3) tokens -> (n,) outcome index in [0, V + V^2 + V^3), sequences ordered by length."""
    t = out.clamp_min(0)
    length = num_accepted + 1
    idx = torch.where(length == 1, t[:, 0], V + t[:, 0] * V + t[:, 1])
    return torch.where(length == 3, V + V**2 + (t[:, 0] * V + t[:, 1]) * V + t[:, 2], idx)


def tv_bound(P: torch.Tensor, n: int, delta: float = DELTA) -> float:
    expected_l1 = (P * (1 - P) / n).sqrt().sum().item()
    return (expected_l1 + math.sqrt(2 * math.log(1 / delta) / n)) / 2


def total_variation(samples: torch.Tensor, P: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=P.numel()).double() / samples.numel()
    return 0.5 * (freq - P).abs().sum().item()


def sample_outcomes(sample_fn, one_hot_drafts: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N_SAMPLES independent steps of `sample_fn` (rejection_sample's signature), vectorised.

    The random inputs are drawn here exactly as RejectionSampler draws them (U[0,1) accept
    uniforms, 1/Exp(1) noise); test_sampler_matches_function_with_same_draws pins that down, so
    the 10^6 rows need not pay for RejectionSampler's softmax over a 5-wide vocabulary.
    """
    gen = torch.Generator().manual_seed(seed)
    n, V = N_SAMPLES, P_TARGET.shape[1]
    if one_hot_drafts:  # the head drafted greedily: d_i = argmax q_i, q_i = one-hot(d_i)
        drafts = Q_DRAFT.argmax(-1).expand(n, 2)
        q, draft_probs = torch.nn.functional.one_hot(drafts[0], V).float(), None
    else:
        drafts = torch.stack([torch.multinomial(q_i, n, replacement=True, generator=gen) for q_i in Q_DRAFT], 1)
        q, draft_probs = Q_DRAFT, Q_DRAFT.expand(n, 2, V)
    accept_uniform = torch.rand(n, 2, generator=gen)  # (n, k)
    sample_noise = torch.empty(n, V).exponential_(generator=gen).reciprocal()  # (n, V)
    out, num_accepted = sample_fn(
        drafts, draft_probs, P_TARGET.expand(n, 3, V), torch.full((n,), 2), accept_uniform, sample_noise, False
    )
    return encode_outcomes(out, num_accepted, V), exact_outcome_distribution(P_TARGET, q)


def buggy_rejection_sample(recover_from_residual: bool = True, emit_bonus: bool = True):
    """A compact independent implementation with switchable classic bugs (mutants)."""

    def sample(draft_tokens, draft_probs, target_probs, num_draft, accept_uniform, sample_noise, greedy):
        B, k = draft_tokens.shape
        rows = torch.arange(B)
        V = target_probs.shape[-1]
        q = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(draft_tokens, V).float()
        p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
        q_d = q.gather(-1, draft_tokens[..., None])[..., 0]
        accepted = (accept_uniform * q_d < p_d) & (torch.arange(k) < num_draft[:, None])
        n_acc = accepted.long().cumprod(1).sum(1)
        p_last = target_probs[rows, n_acc]
        q_last = q[rows, n_acc.clamp(max=k - 1)]
        residual = (p_last - q_last).clamp_min(0) if recover_from_residual else p_last  # bug (a): p
        last = (torch.where((n_acc < num_draft)[:, None], residual, p_last) * sample_noise).argmax(-1)
        prefix = torch.where(accepted.long().cumprod(1).bool(), draft_tokens, -1)  # (B, k)
        out = torch.cat([prefix, torch.full((B, 1), -1)], 1)  # (B, k+1)
        bonus_ok = emit_bonus | (n_acc < num_draft)  # bug (b): nothing after a full acceptance
        out[rows[bonus_ok], n_acc[bonus_ok]] = last[bonus_ok]
        # a missing bonus shortens the emitted sequence: report it as one token fewer
        return out, torch.where(bonus_ok, n_acc, n_acc - 1)

    return sample


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_output_distribution_matches_target(one_hot_drafts):
    samples, P = sample_outcomes(rejection_sample, one_hot_drafts, seed=0)
    bound = tv_bound(P, N_SAMPLES)
    assert bound < 0.02  # the check is meaningful: far below the bugs' effects (>= 0.18)
    assert total_variation(samples, P) < bound
    # the headline guarantee on its own: first emitted token ~ p_0
    V = P_TARGET.shape[1]
    first_of_two, first_of_three = (samples - V) // V, (samples - V - V**2) // V**2
    first = torch.where(samples < V, samples, torch.where(samples < V + V**2, first_of_two, first_of_three))
    p0 = P_TARGET[0].double()
    assert total_variation(first, p0) < tv_bound(p0, N_SAMPLES)


@pytest.mark.parametrize(
    "mutant, expect_pass",
    [
        (dict(), True),  # the test-local implementation without bugs passes the same check
        (dict(recover_from_residual=False), False),  # (a) recovered token drawn from p
        (dict(emit_bonus=False), False),  # (b) no bonus token after a full acceptance
    ],
)
def test_distribution_check_rejects_mutants(mutant, expect_pass):
    samples, P = sample_outcomes(buggy_rejection_sample(**mutant), one_hot_drafts=False, seed=1)
    assert (total_variation(samples, P) < tv_bound(P, N_SAMPLES)) == expect_pass


# ---------------------------------------------------------------------------------------------
# 4. logits_to_probs and the sampler
# ---------------------------------------------------------------------------------------------


def test_greedy_probs_are_one_hot_argmax_lowest_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 5.0]])
    for params in (SamplingParams(), SamplingParams(top_k=1, top_p=0.1)):
        probs = logits_to_probs(logits, params)
        assert probs.dtype == torch.float32
        assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_scaling():
    logits = torch.randn(2, 3, 11)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(probs, (logits / 0.7).softmax(-1))


def test_top_k_keeps_k_largest_and_ties():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0, -1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, True, False]
    assert (probs[1] > 0).tolist() == [True, True, True, False, False]  # tied with the 2nd: kept
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    torch.testing.assert_close(probs[0, [1, 3]], torch.tensor([2.0, 3.0]).softmax(-1))


def test_top_p_keeps_smallest_nucleus_in_vocab_order():
    probs = torch.tensor([0.05, 0.3, 0.15, 0.5])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()
    out = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.375, 0.0, 0.625]))  # 0.5 + 0.3 >= 0.7
    out = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 1.0]))  # 0.5 alone reaches 0.5
    out = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.3, 0.15, 0.5]) / 0.95)


def test_top_p_keeps_ties_at_the_cutoff_whatever_their_order():
    """Tied tokens at the nucleus edge all survive, so the result is the same for any vocabulary
    order (a sort may order equal values differently on CPU and GPU)."""
    logits = torch.tensor([0.2, 0.4, 0.2, 0.1, 0.2, 0.1]).log()
    out = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))  # 0.4 + the three 0.2s
    torch.testing.assert_close(out, torch.tensor([0.2, 0.4, 0.2, 0.0, 0.2, 0.0]) / 1.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        perm = torch.randperm(6, generator=gen)
        torch.testing.assert_close(logits_to_probs(logits[perm], SamplingParams(1.0, top_p=0.5)), out[perm])


def test_top_k_is_applied_before_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top-k=2 renormalises to (0.571, 0.429): the first token alone reaches top_p = 0.5.
    # (top-p first would keep {0, 1}: the mass above token 1 is then only 0.4.)
    out = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_sampling_params_validation():
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_sampler_greedy_with_filters_returns_target_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4, 50, generator=gen)  # (B, k+1, V)
    target = logits.argmax(-1)
    drafts = target[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 50  # row 1 mismatches at position 1
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_k=3, top_p=0.5)):
        out, n_acc = RejectionSampler()(drafts, None, logits, torch.tensor([3, 3, 0, 2]), params)
        assert n_acc.tolist() == [3, 1, 0, 2]
        assert out.tolist() == [target[0].tolist(), [*target[1, :2].tolist(), -1, -1],
                                [target[2, 0].item(), -1, -1, -1], [*target[3, :3].tolist(), -1]]


def test_standard_exponential_law():
    """-log(U) is Exp(1): mean 1, P(E > t) = exp(-t) (200k draws: 5 sigma ~0.005), and never 0."""
    from draftkit.inference.sampling import standard_exponential

    e = standard_exponential((200_000,), torch.Generator().manual_seed(0))
    assert e.dtype == torch.float32 and (e > 0).all()
    assert abs(e.mean().item() - 1.0) < 0.012
    for t in (0.1, 0.5, 1.0, 2.0, 4.0):
        assert abs((e > t).float().mean().item() - math.exp(-t)) < 0.005, t


def test_per_row_random_draws():
    from draftkit.inference.sampling import exponential, uniform

    u = uniform((3, 4), make_generators([1, 2, 3]))
    assert u.shape == (3, 4) and ((0 <= u) & (u < 1)).all()
    assert torch.equal(u[1], uniform((1, 4), make_generators([2]))[0])  # row 1 only sees seed 2
    e = exponential((2, 5), make_generators([5, 6]))
    assert torch.equal(e[1], exponential((1, 5), make_generators([6]))[0])  # row 1 only sees seed 6
    assert not torch.equal(e[0], e[1])
    with pytest.raises(ValueError):
        uniform((2, 4), make_generators([1]))


def test_sampler_matches_function_with_same_draws():
    """RejectionSampler = logits_to_probs + per-row draws (k uniforms, then V exponentials, in
    that order from each row's generator) + rejection_sample."""
    from draftkit.inference.sampling import exponential, uniform

    gen = torch.Generator().manual_seed(5)
    B, k, V = 4, 3, 12
    logits = torch.randn(B, k + 1, V, generator=gen)
    params = SamplingParams(temperature=0.9, top_k=8)
    q = logits_to_probs(logits[:, :k] + torch.randn(B, k, V, generator=gen), params)
    drafts, num_draft = q.argmax(-1), torch.tensor([3, 2, 0, 3])
    seeds = [21, 22, 23, 24]
    got = RejectionSampler("torch")(drafts, q, logits, num_draft, params, make_generators(seeds))
    generators = make_generators(seeds)
    u = uniform((B, k), generators)
    noise = exponential((B, V), generators).reciprocal()
    want = rejection_sample(drafts, q, logits_to_probs(logits, params), num_draft, u, noise, False)
    assert_same(got, want, "sampler vs function")


def test_sampler_rows_reproducible_regardless_of_batch():
    gen = torch.Generator().manual_seed(4)
    B, k, V = 3, 3, 16
    logits = torch.randn(B, k + 1, V, generator=gen)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    q = logits_to_probs(logits[:, :k] + torch.randn(B, k, V, generator=gen), params)
    drafts, num_draft = q.argmax(-1), torch.full((B,), k)
    seeds = [11, 12, 13]
    batch = RejectionSampler()(drafts, q, logits, num_draft, params, make_generators(seeds))
    for b in range(B):
        s = slice(b, b + 1)
        generators = make_generators([seeds[b]])
        alone = RejectionSampler()(drafts[s], q[s], logits[s], num_draft[s], params, generators)
        assert torch.equal(alone[0][0], batch[0][b]) and alone[1].item() == batch[1][b].item()


if __name__ == "__main__":
    if sys.argv[1:] == ["triton-parity"]:
        print(f"triton parity ok: {triton_parity()} cases")
    else:
        sys.exit(pytest.main([__file__, "-q"]))
