"""The chain's draft rule (`draft_sampling`, draftkit/inference/decoder.py): "sample" draws each draft
from q and verifies with q; "greedy" (vLLM's default draft_sample_method) drafts the argmax and
verifies it as a one-hot q.

1. T = 0: greedy drafts give plain decoding's tokens, ragged batch, a head that is accepted.
2. T > 0: both rules are lossless. The joint law of the first 3 emitted tokens through the real loop
   (the 2nd and 3rd are decided by verify steps: acceptance, the recovered and the bonus token) is
   computed exactly from the target on a vocabulary of 8 and tested by chi-square (p > 1e-6), with
   a drafter whose q is far from p. A drafter that verifies its argmax with its sampled q (the bug
   the rule must not have) fails the same test, and the first position's acceptance rate is the
   greedy rule's exact E[p(argmax q)], not the sampled rule's E[sum min(p, q)].
3. Settings: validated by name, carried by DraftSettings into SpecDecoder.
"""
from __future__ import annotations

import pytest
import torch

from draftkit.heads import build_head
from draftkit.inference.decoder import SpecDecoder, plain_generate
from draftkit.inference.drafters import DraftSettings, DraftSettingsError
from draftkit.inference.errors import SpecError
from draftkit.inference.sampling import SamplingParams, logits_to_probs
from tests.conftest import LOOP_PROMPTS, make_arch_target

pytestmark = pytest.mark.usefixtures("one_thread")

V = 8  # vocabulary of the distribution test: 8^3 = 512 outcomes of 3 tokens
PROMPT = [3, 5, 1, 6]
PARAMS = SamplingParams(temperature=0.8)


class TableDrafter:
    """A drafter whose logits depend only on the previous token: table (V, V). `lie=True` drafts the
    argmax but returns its sampled q: the bug of verifying greedy drafts with q."""

    feature_layers = ()
    family = "table"

    def __init__(self, table: torch.Tensor, lie: bool = False):
        self.table, self.lie = table, lie

    def new_draft_state(self, batch_size):
        return {}

    def draft(self, state, feats, next_tokens, valid, k, sample):
        n = next_tokens.shape[1]
        last = next_tokens.gather(1, (valid.long() * torch.arange(n)).argmax(1, keepdim=True))[:, 0]  # newest token
        tokens, probs = [], []
        for _ in range(k):
            logits = self.table[last]  # (B, V)
            tok, q = sample(logits)
            if self.lie:
                tok, q = logits.argmax(-1), logits_to_probs(logits, PARAMS)
            tokens.append(tok)
            probs.append(q)
            last = tok
        return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)


@pytest.fixture(scope="module")
def small_target():
    return make_arch_target("llama", vocab=V, seed=2)


@pytest.fixture(scope="module")
def law(small_target):
    return exact_law(small_target)


@pytest.fixture(scope="module")
def table(law):
    """Logits after x1: 0.8 log p(. | PROMPT, x1) + N(0, 1.5^2) noise. At the first verify q is then
    far from p (mean TV 0.58) yet often right (the rules accept 25% and 42% of first drafts)."""
    p2 = law.sum(2) / law.sum((1, 2))[:, None]  # (V, V) P(x2 | x1)
    return 0.8 * p2.log() + 1.5 * torch.randn(V, V, generator=torch.Generator().manual_seed(0))


def exact_law(target) -> torch.Tensor:
    """(V, V, V) P(x1, x2, x3 | PROMPT) of plain sampling with PARAMS, from full forwards."""
    with torch.no_grad():
        def probs(ctx: torch.Tensor) -> torch.Tensor:
            return logits_to_probs(target.model(ctx).logits[:, -1].float(), PARAMS)
        p1 = probs(torch.tensor([PROMPT]))[0]  # (V,)
        x1 = torch.arange(V)
        p2 = probs(torch.cat([torch.tensor(PROMPT).expand(V, -1), x1[:, None]], 1))  # (V, V)
        x12 = torch.cartesian_prod(x1, x1)  # (V*V, 2)
        p3 = probs(torch.cat([torch.tensor(PROMPT).expand(V * V, -1), x12], 1)).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against p; outcomes with expected count < 5 are pooled."""
    n = counts.sum()
    expected = n * p.double()
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def run_loop(target, drafter, draft_sampling: str, n: int, tokens: int = 3):
    dec = SpecDecoder(target, drafter, k=2, stop_ids=[], draft_sampling=draft_sampling)
    out, stats = dec.generate([PROMPT] * n, tokens, PARAMS, seeds=list(range(n)))
    toks = torch.tensor(out)  # (n, tokens)
    code = (toks * V ** torch.arange(tokens - 1, -1, -1)).sum(1)  # outcome index in base V, x1 first
    counts = torch.bincount(code, minlength=V ** tokens)
    return counts, stats


N = 20000


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
def test_both_draft_rules_are_lossless(small_target, law, table, draft_sampling):
    counts, stats = run_loop(small_target, TableDrafter(table), draft_sampling, N)
    assert stats.accepted_at[0] > 0.15 * stats.reached[0]  # drafts are accepted: the verify decides
    assert chi2_pvalue(counts, law.flatten()) > 1e-6


def test_greedy_drafts_verified_with_sampled_q_fail(small_target, law, table):
    """The planted bug, as a drafter: argmax drafts with their softmax q handed to the sampler."""
    counts, _ = run_loop(small_target, TableDrafter(table, lie=True), "sample", N)
    assert chi2_pvalue(counts, law.flatten()) < 1e-6


def test_greedy_rule_accepts_argmax_with_probability_p(small_target, law, table):
    """alpha_1 of the greedy rule is E_x1[p(argmax q | x1)]; of the sample rule E_x1[sum min(p, q)]
    (2 tokens: every row stops after its first verify, so alpha_1 is the first verify's)."""
    p1, p2 = law.sum((1, 2)), law.sum(2) / law.sum((1, 2))[:, None]  # (V,), (V, V) P(x2 | x1)
    q = logits_to_probs(table, PARAMS)  # (V, V) q(. | x1)
    alpha_greedy = float((p1 * p2.gather(1, q.argmax(1, keepdim=True))[:, 0]).sum())
    alpha_sample = float((p1 * torch.minimum(p2, q).sum(1)).sum())
    for rule, alpha in (("greedy", alpha_greedy), ("sample", alpha_sample)):
        _, stats = run_loop(small_target, TableDrafter(table), rule, 4000, tokens=2)
        assert stats.reached[0] == 4000
        got = stats.accepted_at[0] / stats.reached[0]
        sigma = (alpha * (1 - alpha) / stats.reached[0]) ** 0.5
        assert abs(got - alpha) < 5 * sigma, (rule, got, alpha, sigma)
    assert abs(alpha_greedy - alpha_sample) > 0.05  # the two rules are told apart


def test_greedy_drafts_at_t0_are_plain_decoding():
    target = make_arch_target("llama", seed=1)
    ref, _, _ = plain_generate(target, LOOP_PROMPTS, 24, stop_ids=[])
    head = build_head({"type": "medusa"}, target).eval()  # identity blocks: the target's own next-token guess
    eagle = build_head({"type": "eagle"}, target).eval()
    for drafter, k in ((head, 3), (eagle, 4)):
        out_g, st_g = SpecDecoder(target, drafter, k=k, stop_ids=[], draft_sampling="greedy").generate(LOOP_PROMPTS, 24)
        out_s, st_s = SpecDecoder(target, drafter, k=k, stop_ids=[]).generate(LOOP_PROMPTS, 24)
        assert out_g == ref and out_s == ref
        assert st_g.accepted_hist == st_s.accepted_hist  # at T = 0 both rules draft the argmax
        assert sum(st_g.accepted_at) > 0, drafter.family  # drafts accepted: the roll-back paths run


def test_draft_sampling_settings(small_target, table):
    with pytest.raises(DraftSettingsError, match="draft.draft_sampling must be one of sample, greedy"):
        DraftSettings(mode="chain", draft_sampling="argmax")
    with pytest.raises(SpecError, match="draft_sampling must be one of sample, greedy"):
        SpecDecoder(small_target, TableDrafter(table), k=2, draft_sampling="probabilistic")
    s = DraftSettings.from_dict({"mode": "chain", "k": 3, "draft_sampling": "greedy"})
    drafter, kw = s.decoder_args(TableDrafter(table))
    assert kw == {"k": 3, "draft_sampling": "greedy"} and SpecDecoder(small_target, drafter, **kw).draft_sampling == "greedy"
    assert s.describe() == "chain k=3, greedy drafts (q one-hot)" and DraftSettings().draft_sampling == "sample"
    assert DraftSettings.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_sampling_over_the_draft_vocabulary_keeps_the_law(family):
    """Heads sample over their N draft ids (head.sample_draft), not a -inf-padded row of V: q must be
    the full-vocabulary q of the padded logits (temperature, top-k, top-p), the tokens target ids
    drawn with frequencies q (4,000 rows, one generator each: 5 sigma < 0.04), and greedy the
    padded row's argmax, ties included (draft ids ascend with target ids)."""
    from draftkit.inference.decoder import sample_fn
    from draftkit.inference.sampling import make_generators

    target = make_arch_target("llama")
    head = build_head({"type": family, "draft_vocab_size": 16}, target)
    head.set_draft_vocab(counts=torch.arange(target.vocab_size).flip(0) % 7)  # scattered ids, not a prefix
    ids = head.draft_vocab
    assert ids.shape == (16,) and (ids.diff() > 0).all() and ids[-1] > 16
    logits = (torch.randn(1, 16, generator=torch.Generator().manual_seed(0)) * 2).expand(4000, 16)
    full = head.to_target_logits(logits)  # (4000, V), -inf off the draft vocabulary
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
                   SamplingParams(temperature=1.2, top_p=0.7)):
        tok, q = head.sample_draft(logits, sample_fn(params, make_generators(range(4000))))
        want = logits_to_probs(full, params)  # (4000, V)
        torch.testing.assert_close(q, want, rtol=1e-6, atol=1e-7)
        freq = torch.bincount(tok, minlength=target.vocab_size).float() / tok.shape[0]
        assert (freq - want[0]).abs().max() < 0.04, params
        assert want[0][tok].min() > 0  # never a token the padded law gives 0 (off vocab, top-k, top-p)
    tied = logits[:1].clone()
    tied[0, [3, 9]] = tied.max() + 1  # a tie between draft ids 3 and 9
    tok, q = head.sample_draft(tied, sample_fn(SamplingParams(), make_generators([0])))
    assert q is None and tok.tolist() == head.to_target_logits(tied).argmax(-1).tolist() == [ids[3].item()]
