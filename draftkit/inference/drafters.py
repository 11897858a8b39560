"""What drafts, and how much: `DraftSettings` (the `draft:` section of a head's config.json and the
eval flags) and `HybridDrafter` (lookup and head in one tree).

Every drafter has one interface, the head's (draftkit/heads/base.py):
    state = drafter.new_draft_state(batch_size)
    tokens, probs = drafter.draft(state, feats, next_tokens, valid, k, sample)        # chain mode
    tree = drafter.draft_tree(state, feats, next_tokens, valid, shape)                 # tree mode
Heads, the n-gram lookup (inference/ngram.py) and HybridDrafter all implement it, so SpecDecoder
never asks which one it holds.

Modes:
  chain    the head's chain of k, verified by rejection sampling: at T > 0 drawn from q and
           verified with q (draft_sampling "sample"), or the head's argmax verified as one-hot
           (draft_sampling "greedy", vLLM's default draft_sample_method; see inference/decoder.py)
  tree     the head's EAGLE-2 tree (topk, depth, budget), verified by the tree walk
  hybrid   the head's tree plus the lookup proposal (lookup_len tokens) as a branch of the same
           tree; common prefixes merge. Where lookup finds nothing it is the head's tree alone;
           where it proposes at least `head_off_at` tokens the head only reads the new
           positions and lookup's branch is verified alone (the head's tree would cost its
           drafting for little: lookup's long matches are accepted far more often).
  lookup   prompt lookup alone (no head): a chain of lookup_len tokens
  plain    no drafting: plain decoding (what auto chooses where no shape pays on the machine)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from torch import Tensor

from draftkit.inference.decoder import DRAFT_SAMPLING
from draftkit.inference.errors import SpecError
from draftkit.inference.ngram import NgramDrafter
from draftkit.inference.tree import SOURCE_LOOKUP, DraftTree, TreeShape, add_branches

MODES = ("chain", "tree", "hybrid", "lookup", "plain")


class DraftSettingsError(SpecError):
    """A draft setting out of range, named by field."""


@dataclass
class DraftSettings:
    """How the loop drafts. Written under `draft:` in a head's config.json by `draftkit eval --draft
    auto` (with what it measured) and read back by eval and the exports; every field overridable."""

    mode: str = "hybrid"
    k: int = 4  # chain length (mode chain)
    topk: int = 4  # tree: children per expanded node and frontier width
    depth: int = 5  # tree: levels
    budget: int = 16  # tree: nodes kept from the head (the verify feeds budget + lookup + 1 tokens)
    lookup_len: int = 8  # lookup's branch (hybrid) or chain (lookup mode) length
    lookup_ngram: int = 3  # longest suffix n-gram lookup matches
    head_off_at: int | None = None  # hybrid: lookup proposals this long skip the head's tree (None = never)
    draft_sampling: str = "sample"  # chain: "sample" (draw from q, verify with q) | "greedy" (argmax, q one-hot)
    chosen_by: str = "default"  # "default", "user", or "measured: ..." (what auto saw)
    measured: dict = field(default_factory=dict)  # the cost model's inputs and its pick (auto)

    def __post_init__(self):
        if self.mode not in MODES:
            raise DraftSettingsError(f"draft.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("k", "topk", "depth", "budget", "lookup_len", "lookup_ngram"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DraftSettingsError(f"draft.{name} must be an integer >= 1, got {v!r}")
        if self.head_off_at is not None and (not isinstance(self.head_off_at, int) or self.head_off_at < 1):
            raise DraftSettingsError(f"draft.head_off_at must be an integer >= 1 or null, got {self.head_off_at!r}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise DraftSettingsError(f"draft.draft_sampling must be one of {', '.join(DRAFT_SAMPLING)} "
                                     f"(how a chain's drafts are drawn and verified), got {self.draft_sampling!r}")

    @classmethod
    def from_dict(cls, data: dict | None, where: str = "draft") -> "DraftSettings":
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DraftSettingsError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")
        try:
            return cls(**data)
        except DraftSettingsError as e:
            raise DraftSettingsError(f"{where}: {e}") from e

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def shape(self) -> TreeShape:
        return TreeShape(self.topk, self.depth, self.budget)

    def describe(self) -> str:
        if self.mode == "plain":
            return "plain decoding (no drafting)"
        if self.mode == "chain":
            return f"chain k={self.k}" + (", greedy drafts (q one-hot)" if self.draft_sampling == "greedy" else "")
        if self.mode == "lookup":
            return f"lookup chain {self.lookup_len} (n<={self.lookup_ngram})"
        tree = f"tree topk={self.topk} depth={self.depth} budget={self.budget}"
        if self.mode == "tree":
            return tree
        off = f", head off at lookup >= {self.head_off_at}" if self.head_off_at else ""
        return f"hybrid: {tree} + lookup branch {self.lookup_len}{off}"

    def decoder_args(self, head) -> tuple[Any, dict]:
        """(drafter, SpecDecoder keyword arguments) for this mode over `head` (None: lookup)."""
        if self.mode == "plain":
            raise DraftSettingsError("draft mode plain drafts nothing: decode with plain_generate")
        lookup = NgramDrafter(max_n=self.lookup_ngram)
        if self.mode == "lookup" or head is None:
            return lookup, {"k": self.lookup_len}
        if self.mode == "chain":
            return head, {"k": self.k, "draft_sampling": self.draft_sampling}
        if self.mode == "tree":
            return head, {"tree": self.shape}
        return HybridDrafter(head, lookup, self.lookup_len, self.head_off_at), {"tree": self.shape}


@dataclass
class HybridState:
    head: Any
    lookup: Any


class HybridDrafter:
    """The head's tree with the lookup proposal merged in as a branch (see the module doc)."""

    def __init__(self, head, lookup: NgramDrafter, lookup_len: int, head_off_at: int | None = None):
        self.head, self.lookup, self.lookup_len, self.head_off_at = head, lookup, lookup_len, head_off_at
        self.family = f"{getattr(head, 'family', 'head')}+lookup"
        self.feature_layers = tuple(head.feature_layers)
        self.max_branch_tokens = lookup_len  # the loop sizes its per-step arrays by the deepest branch
        self.max_tree_depth = getattr(head, "max_tree_depth", None)

    def new_draft_state(self, batch_size: int) -> HybridState:
        return HybridState(self.head.new_draft_state(batch_size), self.lookup.new_draft_state(batch_size))

    def draft_tree(self, state: HybridState, feats: Tensor, next_tokens: Tensor, valid: Tensor, shape: TreeShape) -> DraftTree:
        branches = self.lookup.proposals(state.lookup, next_tokens, valid, self.lookup_len)
        running = [bool(v) for v in valid.any(1).tolist()]
        if self.head_off_at and all(len(br) >= self.head_off_at for br, r in zip(branches, running) if r):
            self.head.tree_root(state.head, feats, next_tokens, valid)  # keep the head's cache current
            tree = DraftTree.empty(valid.shape[0], next_tokens.device)
        else:
            tree = self.head.draft_tree(state.head, feats, next_tokens, valid, shape)
        return add_branches(tree, branches, SOURCE_LOOKUP)
