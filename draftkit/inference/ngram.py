"""Prompt-lookup (n-gram) drafting: the baseline that needs no head (Saxena 2023; vLLM's `ngram`).

Find the most recent earlier occurrence of the last n tokens (prompt and output so far), longest
n first, and propose the k tokens that followed it. Strong when the output copies the prompt
(summaries, code edits, extraction), useless on free text, and nearly free to run.

It implements the draft interface of a head (`new_draft_state`, `draft`), so SpecDecoder treats
it like one. It reads no target features (`feature_layers == ()`), drafts deterministically
(probs None = one-hot, which the rejection sampler handles at any temperature), and returns -1
where it has nothing to propose: a row without a match drafts 0 tokens and the step costs one
plain target forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftkit.inference.tree import SOURCE_LOOKUP, DraftTree, add_branches


@dataclass
class NgramState:
    history: list[list[int]] = field(default_factory=list)  # per row: every confirmed token


class NgramDrafter:
    family = "ngram"
    draft_source = SOURCE_LOOKUP  # how the loop labels accepted tokens (draftkit.inference.tree)
    feature_layers: tuple[int, ...] = ()
    max_draft_tokens = None

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def new_draft_state(self, batch_size: int) -> NgramState:
        return NgramState([[] for _ in range(batch_size)])

    def draft(self, state: NgramState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample=None) -> tuple[Tensor, None]:
        out = torch.full((valid.shape[0], k), -1, dtype=torch.long)
        for b, proposal in enumerate(self.proposals(state, next_tokens, valid, k)):
            out[b, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
        return out.to(next_tokens.device), None

    def proposals(self, state: NgramState, next_tokens: Tensor, valid: Tensor, k: int) -> list[list[int]]:
        """Take in the newly confirmed tokens, then up to k proposed tokens per row ([] = no match;
        a row that got nothing new has stopped: no need to draft for it)."""
        out = []
        for b, (toks, mask) in enumerate(zip(next_tokens.tolist(), valid.tolist())):
            hist = state.history[b]
            hist.extend(t for t, m in zip(toks, mask) if m)
            out.append(self.propose(hist, k) if any(mask) else [])
        return out

    def draft_tree(self, state: NgramState, feats: Tensor, next_tokens: Tensor, valid: Tensor, shape) -> DraftTree:
        """Lookup alone in tree mode: its proposal as a one-branch tree of up to shape.depth tokens."""
        tree = DraftTree.empty(valid.shape[0], next_tokens.device)
        return add_branches(tree, self.proposals(state, next_tokens, valid, shape.depth), SOURCE_LOOKUP)

    def propose(self, hist: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier match of hist's longest matching suffix.

        The latest match with k tokens after it wins; failing that, the match with the most (in a
        repetition the latest match is the one right before the suffix, followed by 1 token).
        """
        L = len(hist)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix, best = hist[L - n:], []
            for start in range(L - n - 1, -1, -1):  # latest first; a match ends before the suffix
                if hist[start: start + n] == suffix:
                    follow = hist[start + n: start + n + k]
                    if len(follow) == k:
                        return follow
                    best = follow if len(follow) > len(best) else best
            if best:
                return best
        return []
