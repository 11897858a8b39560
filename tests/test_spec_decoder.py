"""The draft-verify loop (draftkit.inference.decoder), mirroring the ways it can be wrong.

1. Lossless at T = 0 in fp32: tokens equal the target's own greedy decoding (transformers'
   generate), batch 1 and a ragged batch, for a random head, an oracle drafter (tau == k+1
   exactly) and an always-wrong drafter (tau == 1), and for the n-gram drafter.
2. Ragged stopping: each row stops at its own EOS / max tokens, the others carry on unaffected.
3. bf16: divergences from plain decoding are near-ties (tests/test_greedy_compare.py).
4. T > 0: the emitted tokens follow the target's distribution (first token and the first token a
   verify step decides), and each row's output depends only on its own seed.
5. Bad settings: k out of range, prompts that do not fit.
"""
from __future__ import annotations

import math

import pytest
import torch

from draftkit.heads import build_head
from draftkit.inference.decoder import SpecDecoder, plain_generate
from draftkit.inference.errors import SpecError
from draftkit.inference.ngram import NgramDrafter
from draftkit.inference.sampling import SamplingParams, logits_to_probs

V = 96
LENGTHS = (5, 11, 8, 14)


pytestmark = pytest.mark.usefixtures("one_thread")


def varied_target(dtype=torch.float32, seed=0):
    """A tiny llama whose greedy output varies (init std 0.2; the default 0.02 repeats one token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftkit.target import Target

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      initializer_range=0.2)
    return Target(LlamaForCausalLM(cfg).to(dtype), None, name=f"varied-llama-{seed}")


def make_prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(target, prompts, n):
    out = []
    for p in prompts:
        ids = target.model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


class Oracle:
    """Drafts the reference continuation (right) or that token + 1 (always wrong)."""

    feature_layers = ()

    def __init__(self, prompts, refs, wrong=False):
        self.full = [p + r for p, r in zip(prompts, refs)]
        self.wrong = wrong

    def new_draft_state(self, batch_size):
        return [0] * batch_size  # tokens seen per row: prompt[1:] + outputs so far

    def draft(self, state, feats, next_tokens, valid, k, sample):
        out = torch.zeros(len(state), k, dtype=torch.long)
        for b in range(len(state)):
            state[b] += int(valid[b].sum())
            seq = self.full[b][state[b] + 1: state[b] + 1 + k]
            out[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        return ((out + 1) % V if self.wrong else out), None


@pytest.fixture(scope="module")
def target():
    return varied_target()


@pytest.fixture(scope="module")
def reference(target):
    prompts = make_prompts()
    return prompts, hf_greedy(target, prompts, 40)


def test_plain_generate_equals_transformers_generate(target, reference):
    prompts, ref = reference
    out, stats, _ = plain_generate(target, prompts, 24, stop_ids=[])
    assert out == [r[:24] for r in ref]
    assert stats.new_tokens == 4 * 24


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_fp32_equals_plain_decoding(target, reference, k, batch):
    prompts, ref = reference
    head = build_head({"type": "eagle", "num_layers": 2}, target)
    dec = SpecDecoder(target, head, k, stop_ids=[])
    outs = []
    for i in range(0, len(prompts), batch):
        o, stats = dec.generate(prompts[i: i + batch], 24)
        outs += o
        assert sum(stats.accepted_hist) == stats.row_steps and stats.tau >= 1.0
    assert outs == [r[:24] for r in ref]


@pytest.mark.parametrize("k", [1, 4])
def test_oracle_drafter_accepts_everything(target, reference, k):
    prompts, ref = reference
    n = 1 + 4 * (k + 1)  # the first token from prefill, then 4 full steps
    out, stats = SpecDecoder(target, Oracle(prompts, ref), k, stop_ids=[]).generate(prompts, n)
    assert out == [r[:n] for r in ref]
    assert stats.tau == k + 1 and stats.acceptance_per_position == [1.0] * k
    assert stats.steps == 4 and stats.accepted_hist == [0] * k + [16]


def test_wrong_drafter_accepts_nothing(target, reference):
    prompts, ref = reference
    out, stats = SpecDecoder(target, Oracle(prompts, ref, wrong=True), 3, stop_ids=[]).generate(prompts, 10)
    assert out == [r[:10] for r in ref]
    assert stats.tau == 1.0 and stats.acceptance_per_position == [0.0, None, None]
    assert stats.steps == 9 and stats.accepted_hist == [36, 0, 0, 0]


def test_rows_stop_independently(target, reference):
    """A stop token ends its row only (mid-draft too); the other rows run to max_new_tokens."""
    prompts, ref = reference
    stop = next(ref[0][i] for i in range(4, 12) if ref[0][i] not in ref[0][:i])
    expect = []
    for r in ref:
        cut = r[:20]
        expect.append(cut[: cut.index(stop) + 1] if stop in cut else cut)
    assert any(len(e) < 20 for e in expect) and any(len(e) == 20 for e in expect)
    head = build_head({"type": "eagle"}, target)
    for drafter in (head, Oracle(prompts, ref)):
        out, _ = SpecDecoder(target, drafter, 4, stop_ids=[stop]).generate(prompts, 20)
        assert out == expect


def test_ngram_drafter_is_lossless_and_accepts_repeats():
    repeating = varied_target(seed=0)
    # A target that repeats itself: the default tiny init decodes one token over and over.
    from tests.conftest import make_tiny_target

    flat = make_tiny_target()
    prompts = make_prompts()
    for t in (repeating, flat):
        ref, _, _ = plain_generate(t, prompts, 30, stop_ids=[])
        out, stats = SpecDecoder(t, NgramDrafter(), 4, stop_ids=[]).generate(prompts, 30)
        assert out == ref
    assert stats.tau > 3.0  # on the repeating target most drafts are right


def test_ngram_propose():
    d = NgramDrafter(max_n=3)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]  # trigram match
    assert d.propose([5, 6, 7, 5, 6, 8, 5, 6], 3) == [8, 5, 6]  # latest match with k tokens after
    assert d.propose([1, 2, 3], 2) == []
    assert d.propose([7, 7], 4) == [7]  # a repeat: the only match has one token after it


def _tv(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Total variation of the empirical distribution from p, and 4x its expected sampling noise."""
    n = counts.sum()
    tv = 0.5 * (counts / n - p).abs().sum().item()
    bound = 4 * 0.5 * (p * (1 - p) / n).sqrt().sum().item()
    return tv, bound


def test_sampling_follows_the_target_distribution(target):
    """T > 0: token 1 (prefill) and token 2 (decided by the rejection sampler) ~ the target."""
    params = SamplingParams(temperature=1.0, top_k=40)
    prompt = make_prompts((6,), seed=3)[0]
    n = 3000
    head = build_head({"type": "eagle"}, target)  # a random head: its q is far from p
    out, stats = SpecDecoder(target, head, 2, stop_ids=[]).generate([prompt] * n, 2, params, seeds=list(range(n)))
    assert stats.tau < 2.5  # drafts do get rejected, so the residual path is exercised
    toks = torch.tensor(out)  # (n, 2)
    with torch.no_grad():
        p1 = logits_to_probs(target.model(torch.tensor([prompt])).logits[0, -1], params)  # (V,)
        ctx = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
        p2_given = logits_to_probs(target.model(ctx).logits[:, -1], params)  # (V, V)
    p2 = p1 @ p2_given
    for counts, p in ((torch.bincount(toks[:, 0], minlength=V).float(), p1),
                      (torch.bincount(toks[:, 1], minlength=V).float(), p2)):
        tv, bound = _tv(counts, p)
        assert tv < bound, (tv, bound)
    # the same statistic notices a wrong distribution (the draft's, say): the test has teeth
    q = torch.softmax(torch.randn(V) * 2, 0)
    tv, bound = _tv(torch.bincount(toks[:, 1], minlength=V).float(), q)
    assert tv > bound


def test_rows_depend_only_on_their_seed(target):
    params = SamplingParams(temperature=0.8)
    prompts = make_prompts()
    head = build_head({"type": "eagle"}, target)
    dec = SpecDecoder(target, head, 3, stop_ids=[])
    batch, _ = dec.generate(prompts, 12, params, seeds=[10, 11, 12, 13])
    again, _ = dec.generate(prompts, 12, params, seeds=[10, 11, 12, 13])
    alone, _ = dec.generate(prompts[2:3], 12, params, seeds=[12])
    other, _ = dec.generate(prompts[2:3], 12, params, seeds=[99])
    assert batch == again and alone[0] == batch[2] and other[0] != batch[2]


def test_bad_settings(target):
    head = build_head({"type": "eagle"}, target)
    with pytest.raises(SpecError, match="k"):
        SpecDecoder(target, head, 0)

    class Short(Oracle):
        max_draft_tokens = 2
        family = "short"
    with pytest.raises(SpecError, match="max_draft_tokens=2"):
        SpecDecoder(target, Short([], []), 3)
    dec = SpecDecoder(target, head, 4)
    with pytest.raises(SpecError, match="context"):
        dec.generate([[3] * 120], 10)
    with pytest.raises(SpecError, match="no prompts"):
        dec.generate([], 10)
    assert math.isfinite(dec.generate([[3, 4, 5]], 2)[1].tau)
