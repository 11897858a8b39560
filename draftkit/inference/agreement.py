"""Teacher-forced agreement of a head on a continuation, and the loop's own steps on the same
continuation: what benchmarks/acceptance_gap.py compares to find where acceptance is lost.

A loop step (decoder.py) starts at a *root* r: the newest position whose target feature the head
has (r = L-1 after a prompt of L tokens, then r + accepted + 1); the pending token is x_{r+1}, and
the head drafts d_1..d_k for x_{r+2}..x_{r+k+1}, feeding its own drafts (and, EAGLE, its own
predicted features) from depth 2 on. At T = 0 the step accepts the longest prefix of drafts equal
to what the target says there.

`teacher_forced` gives the head the target's features of the whole sequence (prompt +
continuation) from ONE forward, computed by the trainer's own code (train/data.py FeatureStore:
what the head saw in training), feeds them one position per call through the head's `draft`
(the loop's interface), and drafts k from every root of the continuation. So at the roots the
loop visited, the accepted count equals the teacher-forced leading-agreement count exactly when
the loop's features (its KV-cached prefill and verify blocks) give the head the same drafts as
the training features (fp32 on a tiny target: tests/test_acceptance_gap.py). `replay` plays the
loop's rule on the teacher-forced drafts and counts with SpecStats.record (the loop's own
counter), so its alpha_i and the loop's are the same quantity on the same steps: any difference
is a train/inference mismatch (features, dtype, positions, the head's cache after roll-back).

`loop_trace` runs one prompt through a SpecDecoder and records, through its observer hook, each
step's accepted count and emitted tokens: the continuation as the loop verified it, past
max_new_tokens in the last step (what that step's drafts were checked against).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftkit.inference.decoder import SpecDecoder, _Rows
from draftkit.inference.stats import SpecStats


@dataclass
class LoopTrace:
    """One prompt through the loop (batch 1)."""

    output: list[int]  # what generate returned (cut at EOS / max_new_tokens)
    stats: SpecStats
    accepted: list[int]  # per step: drafts accepted
    continuation: list[int]  # the prefill token + every step's accepted drafts and bonus token
    feats: Tensor  # (M, F) the loop's target features of continuation positions L .. L+M-1 (verify blocks)

    def roots(self, prompt_len: int) -> list[int]:
        """The root (position of the newest feature the head had) of every step."""
        out, r = [], prompt_len - 1
        for a in self.accepted:
            out.append(r)
            r += a + 1
        return out

    def feature_error(self, train_feats: Tensor, prompt_len: int) -> float | None:
        """||loop - training|| / ||training|| of the features at the positions the loop verified
        (train_feats (1, T, F): training_features of prompt + continuation)."""
        m = self.feats.shape[0]
        if not m:
            return None
        ref = train_feats[0, prompt_len: prompt_len + m].float().cpu()
        return float((self.feats - ref).norm() / ref.norm().clamp(min=1e-30))


def loop_trace(decoder: SpecDecoder, prompt: list[int], max_new_tokens: int, params=None) -> LoopTrace:
    """Decode one prompt with `decoder`, recording each verify's accepted count and tokens."""
    from draftkit.inference.sampling import SamplingParams

    steps: list[tuple[int, list[int], Tensor]] = []

    def observe(tree, v) -> None:  # v.tokens (1, D+1): accepted drafts, then the bonus / recovered token
        n = int(v.num_accepted[0])  # slots 0..n of the block: the pending token and the accepted drafts
        steps.append((n, v.tokens[0, : n + 1].tolist(), v.feats[0, : n + 1].float().cpu()))

    before, decoder.observer = decoder.observer, observe
    try:
        outs, stats = decoder.generate([prompt], max_new_tokens, params or SamplingParams())
    finally:
        decoder.observer = before
    continuation = outs[0][:1] + [t for _, toks, _ in steps for t in toks]
    feats = torch.cat([f for _, _, f in steps]) if steps else torch.zeros(0, 0)
    return LoopTrace(outs[0], stats, [n for n, _, _ in steps], continuation, feats)



@dataclass
class Agreement:
    """The head's teacher-forced drafts on one sequence (prompt + continuation).

    Continuation roots are r = L-1 .. T-2 (row i = root L-1+i); depth d (column d-1) predicts
    x_{r+1+d}, drafted after the head's own drafts d_1..d_{d-1}."""

    prompt_len: int
    tokens: list[int]  # (T,) prompt + continuation
    hits: Tensor  # (R, k) bool: d_d == x_{r+1+d} (False where the sequence ends: see known)
    in_topk: Tensor  # (R, k) bool: x_{r+1+d} among the head's top-k logits at depth d
    known: Tensor  # (R, k) bool: x_{r+1+d} exists in the sequence
    context_hits: Tensor | None  # (T-1,) bool: root r = 0..T-2: depth-1 draft == the target's top-1 at r+1
    target_top1: Tensor  # (T,) the target's argmax after each position (the one forward)
    target_top1_prob: Tensor | None = None  # (T,) the target's probability of that argmax (its confidence)

    def leading(self, row: int, k: int) -> int:
        """Drafts a T = 0 step from continuation root row `row` accepts: the leading hits (<= k)."""
        h = self.hits[row, :k].tolist()
        return next((i for i, x in enumerate(h) if not x), len(h))


class _Recorder:
    """The `sample` callback of head.draft at T = 0: argmax, and the top-k target ids of every call
    (`sample` sees logits over the head's draft vocabulary, `vocab` its target ids, None: the target's)."""

    def __init__(self, topk: int, vocab: Tensor | None):
        self.topk, self.vocab, self.calls = topk, vocab, []

    def __call__(self, logits: Tensor) -> tuple[Tensor, None]:
        top = logits.topk(min(self.topk, logits.shape[-1]), dim=-1).indices[0]  # (topk,)
        self.calls.append(top if self.vocab is None else self.vocab[top])
        return logits.argmax(-1), None


def training_features(target, layers: tuple[int, ...], seq: list[int], storage: str = "target"):
    """(feats (1, T, F) of `layers`, the target's top-1 (T,), its float32 probability (T,)) of `seq`
    as the trainer computes them: train/data.py FeatureStore (online, one forward), then the
    recipe's train.feature_storage round trip (bf16 / fp8 as stored on disk; "target" keeps the
    target's dtype)."""
    from draftkit.train.data import FeatureStore, decode, encode

    f = FeatureStore(target, layers, None).batch([{"input_ids": seq, "loss_mask": [1] * len(seq)}], 0)
    feats = f.hidden
    if storage != "target":
        feats = decode(encode(feats[0], storage, len(layers)), "", target.dtype)[None]
    logits = target.logits(f.final_hidden[0])
    top1 = logits.argmax(-1)  # (T,) as FeatureStore stores "top1"
    prob = logits.float().softmax(-1).gather(-1, top1[:, None])[:, 0]
    return feats, top1, prob


@torch.no_grad()
def teacher_forced(head, prompt: list[int], continuation: list[int], feats: Tensor, top1: Tensor, k: int,
                   topk: int = 4, autocast: torch.dtype | None = None, context: bool = True,
                   top1_prob: Tensor | None = None) -> Agreement:
    """Draft k from every continuation root of prompt + continuation (see the module doc), given
    its training features `feats` (1, T, F) and the target's top-1 (T,) (training_features; its
    probability `top1_prob`, if given, is kept for Tally's split by the target's confidence).

    context: also draft depth 1 from every prompt root (checked against the target's top-1, as
    data.loss_on "all" trains); else the prompt is consumed in one call, as the loop's prefill.
    autocast: run the head under torch.autocast (the trainer's train.autocast), else as it is.
    """
    seq = list(prompt) + list(continuation)
    L, T = len(prompt), len(seq)
    if L < 1 or T < L + 1 or feats.shape[1] != T:
        raise ValueError(f"teacher_forced: need a prompt, a continuation and their {T} features, got {L} + "
                         f"{T - L} tokens and features {tuple(feats.shape)}")
    dev = feats.device
    ids = torch.tensor([seq], device=dev)  # (1, T)
    state, rec = head.new_draft_state(1), _Recorder(topk, head.draft_vocab)
    drafts: list[tuple[int, Tensor, list[Tensor]]] = []  # (root, drafts (kk,), top-k ids per depth)
    start = 0 if context else L - 1
    with torch.autocast(dev.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        for r in range(start, T - 1):
            lo = 0 if r == start else r  # one new position per call; the first consumes 0..start
            valid = torch.ones(1, r + 1 - lo, dtype=torch.bool, device=dev)
            rec.calls = []
            kk = k if r >= L - 1 else 1
            tokens, _ = head.draft(state, feats[:, lo: r + 1], ids[:, lo + 1: r + 2], valid, kk, rec)
            drafts.append((r, tokens[0], rec.calls))
    return _agreement(seq, L, k, drafts, top1, context, top1_prob)


def _agreement(seq: list[int], L: int, k: int, drafts, top1: Tensor, context: bool,
               top1_prob: Tensor | None = None) -> Agreement:
    """Compare each root's drafts with the sequence (and depth 1 with the target's top-1)."""
    T = len(seq)
    R = T - L
    hits = torch.zeros(R, k, dtype=torch.bool)
    in_topk, known = torch.zeros_like(hits), torch.zeros_like(hits)
    ctx = torch.zeros(T - 1, dtype=torch.bool) if context else None
    top1 = top1.cpu()
    for r, toks, tops in drafts:
        if ctx is not None:
            ctx[r] = int(toks[0]) == int(top1[r + 1])
        if r < L - 1:
            continue
        for d in range(min(k, T - r - 2)):  # x_{r+2+d} must exist
            want = seq[r + 2 + d]
            known[r - L + 1, d] = True
            hits[r - L + 1, d] = int(toks[d]) == want
            in_topk[r - L + 1, d] = bool((tops[d].cpu() == want).any())
    return Agreement(L, seq, hits, in_topk, known, ctx, top1, None if top1_prob is None else top1_prob.float().cpu())


def replay(agreement: Agreement, k: int, max_new_tokens: int, stop_ids) -> tuple[SpecStats, list[int]]:
    """The loop's T = 0 rule on the teacher-forced drafts: steps from root L-1, each accepting the
    leading hits, stopping as the loop's rows do (decoder._Rows); counted by SpecStats.record.
    Returns the counts and each step's accepted count."""
    a = agreement
    stats, rows = SpecStats(k), _Rows(1, max_new_tokens, stop_ids, "cpu")
    rows.add(0, [a.tokens[a.prompt_len]])  # the prefill's token
    row, accepted = 0, []
    ark = torch.arange(k)[None]
    while rows.any_active and row < a.hits.shape[0]:
        n = a.leading(row, k)
        offered = ark <= n  # a chain of k: depths up to the first miss were looked at
        stats.record(offered, torch.tensor([n]), torch.tensor([True]))
        start = a.prompt_len + row + 1  # the accepted drafts and the bonus token follow the pending one
        rows.add(0, a.tokens[start: start + n + 1])
        accepted.append(n)
        row += n + 1
    stats.new_tokens = rows.new_tokens()
    return stats, accepted


# ---------------------------------------------------------------------------------------------
# Counting many prompts
# ---------------------------------------------------------------------------------------------

BUCKETS = (0, 256, 512, 1024)  # context-position buckets of the drafted token: [0, 256) .. [1024, inf)
CONFIDENCE = (0.0, 0.3, 0.5, 0.7, 0.9)  # bins of the target's probability of the drafted token: [0, .3) .. [.9, 1]


def bucket_of(position: int) -> str:
    """The label of the position bucket `position` (0-based index in prompt + continuation) falls in."""
    i = max(j for j, lo in enumerate(BUCKETS) if position >= lo)
    return f">{BUCKETS[-1]}" if i == len(BUCKETS) - 1 else f"{BUCKETS[i]}-{BUCKETS[i + 1]}"


def confidence_bin(p: float) -> str:
    """The label of the CONFIDENCE bin the target's probability `p` falls in."""
    i = max(j for j, lo in enumerate(CONFIDENCE) if p >= lo)
    return f"{CONFIDENCE[i]:.1f}-{CONFIDENCE[i + 1] if i + 1 < len(CONFIDENCE) else 1.0:.1f}"


def rate(hits: int, n: int) -> float | None:
    return hits / n if n else None


class Tally:
    """Counts over the prompts of one group (a category, the held-aside prompts, all of them).

    Per depth d (own drafts fed): known / top-1 / top-k hits over every continuation root;
    `cond` the roots whose depths 1..d-1 all hit (the steps a T = 0 loop would reach depth d from)
    with `cond_hit` (depth d hit too: the teacher-forced alpha_d) and `cond_true` (the head hits the
    same token at depth 1 from root r+d-1, i.e. with the target's true features and tokens: the
    control that isolates compounding). Depth-1 hits by position bucket of the drafted token, on
    the continuation and (context) against the target's top-1 at every position; the split at
    `max_length` inside sequences that cross it; depth-1 hits by the target's own probability of
    the drafted token (how settled the text is where the head drafts: where the target itself is
    unsure, its argmax is harder to foresee); depth-1 hits on tokens the context already holds after
    the same token (a bigram seen before: what prompt lookup drafts) and on the others;
    draft-vocabulary misses of the continuation; and, with a loop trace, the loop's counts, the
    replay's, and the steps where they differ.
    """

    def __init__(self, k: int, max_length: int):
        self.k, self.max_length = k, max_length
        self.prompts = self.prompt_tokens = self.tokens = self.oov = self.top1_n = self.top1_differ = 0
        z = lambda: [0] * k  # noqa: E731
        self.known, self.top1, self.topk, self.cond, self.cond_hit, self.cond_true = z(), z(), z(), z(), z(), z()
        self.cont_pos: dict[str, list[int]] = {}
        self.ctx_pos: dict[str, list[int]] = {}
        self.conf: dict[str, list[int]] = {}  # confidence bin -> [n, depth-1 hits]
        self.conf_sum = 0.0
        self.copy = {"seen bigram": [0, 0], "new bigram": [0, 0]}  # [n, depth-1 hits]
        self.split = [0, 0, 0, 0]  # n, hits before max_length; n, hits from it on
        self.loop = SpecStats(k)
        self.replayed = SpecStats(k)
        self.steps = self.steps_differ = 0
        self.traced = False
        self.feature_errors: list[float] = []

    def add(self, a: Agreement, vocab: set[int] | None, trace: LoopTrace | None = None,
            max_new_tokens: int = 0, stop_ids=(), feature_error: float | None = None) -> None:
        self.prompts += 1
        self.prompt_tokens += a.prompt_len
        self._depths(a)
        self._positions(a)
        self._confidence(a)
        self._copies(a)
        cont = a.tokens[a.prompt_len:]
        self.tokens += len(cont)
        self.oov += sum(t not in vocab for t in cont) if vocab is not None else 0
        top1 = a.target_top1[a.prompt_len - 1: len(a.tokens) - 1].tolist()  # the target's argmax for each
        self.top1_n += len(cont)
        self.top1_differ += sum(x != y for x, y in zip(top1, cont))
        if trace is not None:
            self._loop(a, trace, max_new_tokens, stop_ids)
        if feature_error is not None:
            self.feature_errors.append(feature_error)

    def _depths(self, a: Agreement) -> None:
        hits, known = a.hits.tolist(), a.known.tolist()
        for i, (h, kn) in enumerate(zip(hits, known)):
            for d in range(self.k):
                if not kn[d]:
                    break
                self.known[d] += 1
                self.top1[d] += h[d]
                self.topk[d] += bool(a.in_topk[i, d])
                if all(h[:d]):
                    self.cond[d] += 1
                    self.cond_hit[d] += h[d]
                    self.cond_true[d] += hits[i + d][0]  # row i+d drafts the same token at depth 1

    def _positions(self, a: Agreement) -> None:
        for i, (h, kn) in enumerate(zip(a.hits[:, 0].tolist(), a.known[:, 0].tolist())):
            if kn:
                c = self.cont_pos.setdefault(bucket_of(a.prompt_len + i + 1), [0, 0])
                c[0], c[1] = c[0] + 1, c[1] + h
        if a.context_hits is None:
            return
        crosses = len(a.tokens) > self.max_length
        for r, h in enumerate(a.context_hits.tolist()):
            c = self.ctx_pos.setdefault(bucket_of(r + 2), [0, 0])
            c[0], c[1] = c[0] + 1, c[1] + h
            if crosses:
                j = 0 if r + 2 < self.max_length else 2
                self.split[j] += 1
                self.split[j + 1] += h

    def _confidence(self, a: Agreement) -> None:
        """Depth 1 from row i drafts x_{L+1+i}; the target's distribution for it comes after position L+i."""
        if a.target_top1_prob is None:
            return
        probs = a.target_top1_prob.tolist()
        for i, (h, kn) in enumerate(zip(a.hits[:, 0].tolist(), a.known[:, 0].tolist())):
            if kn:
                p = probs[a.prompt_len + i]
                c = self.conf.setdefault(confidence_bin(p), [0, 0])
                c[0], c[1] = c[0] + 1, c[1] + h
                self.conf_sum += p

    def _copies(self, a: Agreement) -> None:
        """Row i drafts x_t, t = L+1+i: "seen bigram" when (x_{t-1}, x_t) occurs in x_0..x_{t-1}."""
        seq, L = a.tokens, a.prompt_len
        seen = {(seq[j - 1], seq[j]) for j in range(1, L + 1)}  # the bigrams up to x_L
        for i, (h, kn) in enumerate(zip(a.hits[:, 0].tolist(), a.known[:, 0].tolist())):
            t = L + 1 + i
            if kn:
                c = self.copy["seen bigram" if (seq[t - 1], seq[t]) in seen else "new bigram"]
                c[0], c[1] = c[0] + 1, c[1] + h
            if t < len(seq):
                seen.add((seq[t - 1], seq[t]))

    def _loop(self, a: Agreement, trace: LoopTrace, max_new_tokens: int, stop_ids) -> None:
        self.traced = True
        self.loop += trace.stats
        stats, _ = replay(a, self.k, max_new_tokens, stop_ids)
        self.replayed += stats
        rows = [r - a.prompt_len + 1 for r in trace.roots(a.prompt_len)]
        self.steps += len(rows)
        self.steps_differ += sum(n != a.leading(i, self.k) for n, i in zip(trace.accepted, rows))

    def to_dict(self) -> dict:
        k = range(self.k)
        out = {
            "prompts": self.prompts, "mean_prompt_tokens": rate(self.prompt_tokens, self.prompts),
            "continuation_tokens": self.tokens, "outside_draft_vocab": rate(self.oov, self.tokens),
            "target_top1_differs_from_continuation": rate(self.top1_differ, self.top1_n),
            "tf_top1": [rate(self.top1[d], self.known[d]) for d in k],
            "tf_topk": [rate(self.topk[d], self.known[d]) for d in k],
            "tf_alpha": [rate(self.cond_hit[d], self.cond[d]) for d in k],
            "tf_alpha_true_features": [rate(self.cond_true[d], self.cond[d]) for d in k],
            "tf_reached": list(self.cond),
            "by_position": {b: {"n": n, "top1": rate(h, n)} for b, (n, h) in sorted(self.cont_pos.items(), key=_order)},
            "context_by_position": {b: {"n": n, "top1": rate(h, n)}
                                    for b, (n, h) in sorted(self.ctx_pos.items(), key=_order)},
            "context_split": {"max_length": self.max_length, "n_before": self.split[0],
                              "top1_before": rate(self.split[1], self.split[0]), "n_from": self.split[2],
                              "top1_from": rate(self.split[3], self.split[2])},
            "by_target_confidence": {b: {"n": n, "top1": rate(h, n)} for b, (n, h) in sorted(self.conf.items())},
            "mean_target_confidence": rate(self.conf_sum, sum(n for n, _ in self.conf.values())),
            "by_copy": {c: {"n": n, "top1": rate(h, n)} for c, (n, h) in self.copy.items()},
        }
        if self.traced:
            out.update(loop_tau=self.loop.tau, loop_alpha=self.loop.acceptance_per_position,
                       replay_tau=self.replayed.tau, replay_alpha=self.replayed.acceptance_per_position,
                       loop_steps=self.steps, steps_differing=rate(self.steps_differ, self.steps),
                       loop_new_tokens=self.loop.new_tokens, loop_seconds=self.loop.total_s,
                       loop_feature_rel_error=(sum(self.feature_errors) / len(self.feature_errors)
                                               if self.feature_errors else None))
        return out


def _order(item) -> int:
    label = item[0]
    return BUCKETS[-1] + 1 if label.startswith(">") else int(label.split("-")[0])
