"""Medusa-1 (Cai et al., 2024): K extra heads on the frozen target's last hidden state.

Head i (0-based) reads f_t, the final-norm output the target's lm_head reads at position t:
    z     = f_t + SiLU(W_j f_t + b_j)   for each of its L residual blocks j (W, b start at 0: identity)
    p̂_i   = softmax(lm_head_i(z))       predicts x_{t+i+2}, i.e. i+1 tokens past the target's own x_{t+1}
Self-distilled Medusa-1 loss (target frozen): sum_i w_i KL(p_target(. | position t+i+1) || p̂_i).
Drafting is a chain of independent guesses, no tree and no KV cache: after the target samples
x_new at position p, head i's sample from f_p is draft token i (0-based), i.e. x_{p+i+2}.
Names follow the Medusa reference (medusa_head.{i}.{j}.linear, medusa_head.{i}.{L} = lm_head).
Medusa's typical acceptance rule (a verify rule, not part of the head) lives in inference/typical.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftkit.heads.base import DraftHead, HeadConfig, HeadError, SampleFn
from draftkit.heads.layers import last_valid
from draftkit.heads.losses import kl_rows
from draftkit.target import FINAL


@dataclass
class MedusaConfig(HeadConfig):
    type: str = "medusa"
    # K: heads, i.e. the most tokens one draft proposes (max_draft_tokens).
    num_heads: int = 4
    # L: residual blocks per head (the Medusa paper uses 1).
    num_layers: int = 1
    # True: every head reads through the target's frozen lm_head (V x H fewer params per head);
    # False: each head owns an lm_head, initialised from the target's.
    share_lm_head: bool = False
    # Loss weight of head i: head_weights[i] if given, else weight_decay_per_head ** i (paper: 0.8).
    head_weights: list[float] | None = None
    weight_decay_per_head: float = 0.8
    # The target layer the heads read: the final norm output (see draftkit.target); fixed.
    feature_layers: list[int] = field(default_factory=lambda: [FINAL])

    def weights(self) -> list[float]:
        return list(self.head_weights) if self.head_weights is not None else \
            [self.weight_decay_per_head ** i for i in range(self.num_heads)]


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), zero-initialised so a new block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


@dataclass
class MedusaState:
    """Medusa keeps no cache: only each row's newest confirmed feature (rows that send none keep it)."""

    last: Tensor | None = None  # (B, H)


class MedusaHead(DraftHead):
    family = "medusa"
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig, shared=None):
        super().__init__(config, shared)
        H, V = config.hidden_size, config.vocab_size

        def one_head() -> nn.Sequential:
            blocks = [ResBlock(H) for _ in range(config.num_layers)]  # distinct weights per block
            return nn.Sequential(*blocks, *([] if config.share_lm_head else [nn.Linear(H, V, bias=False)]))

        self.medusa_head = nn.ModuleList(one_head() for _ in range(config.num_heads))
        if shared is not None and not config.share_lm_head:
            with torch.no_grad():
                for head in self.medusa_head:
                    head[-1].weight.copy_(shared.lm_head.weight.to(head[-1].weight))

    @classmethod
    def feature_layers_of(cls, config: MedusaConfig) -> tuple[int, ...]:
        return tuple(config.feature_layers)

    @classmethod
    def validate(cls, config: MedusaConfig, target) -> None:
        super().validate(config, target)
        if list(config.feature_layers) != [FINAL]:
            raise HeadError(f"head.feature_layers: Medusa reads the final norm output [{FINAL}], "
                            f"got {config.feature_layers}")
        if config.num_heads < 1:
            raise HeadError(f"head.num_heads: Medusa needs at least one head, got {config.num_heads}")
        if config.num_layers < (1 if config.share_lm_head else 0):
            raise HeadError(f"head.num_layers: must be >= {int(config.share_lm_head)} "
                            f"(share_lm_head={config.share_lm_head}), got {config.num_layers}")
        if config.head_weights is not None and len(config.head_weights) != config.num_heads:
            raise HeadError(f"head.head_weights: {len(config.head_weights)} weights for {config.num_heads} heads")

    @property
    def max_draft_tokens(self) -> int:
        return self.config.num_heads

    # ---- the network ----
    def head_logits(self, i: int, f: Tensor) -> Tensor:
        """(..., H) final-norm features -> (..., V) float32 logits of head i."""
        head = self.medusa_head[i]
        z = head(f.to(next(head.parameters()).dtype))
        return self.target_logits(z) if self.config.share_lm_head else z.float()

    # ---- training ----
    def loss(self, features) -> dict[str, Tensor]:
        f, final = features.hidden, features.final_hidden  # (B, T, H) both the final norm output
        attn = features.attention_mask.bool()
        lm = (features.loss_mask if features.loss_mask is not None else attn).bool() & attn
        T = f.shape[1]
        total, metrics = 0.0, {}
        for i, w in enumerate(self.config.weights()):
            n = max(T - 2 - i, 0)  # positions t whose x_{t+i+2} exists
            sup = lm[:, 2 + i:] & attn[:, :n]  # (B, n)
            # The target at t+i+1 gives x_{t+i+2}'s distribution; rows in chunks (heads/losses.py).
            kl, pred, top = kl_rows(lambda x, i=i: self.head_logits(i, x), self.target_logits_top1,
                                    f[:, :n][sup], final[:, 1 + i: 1 + i + n][sup], vocab=self.config.vocab_size)
            M = max(kl.shape[0], 1)
            kl = kl.sum() / M
            total = total + w * kl
            metrics[f"kl_{i}"] = kl.detach()
            metrics[f"acc_{i}"] = (pred == top).float().sum().detach() / M
            metrics.setdefault("tokens", torch.tensor(float(pred.shape[0])))
        return {"loss": total, "acc": metrics["acc_0"], **metrics}

    # ---- drafting ----
    def new_draft_state(self, batch_size: int) -> MedusaState:
        return MedusaState()

    def _consume(self, state: MedusaState, feats: Tensor, valid: Tensor) -> Tensor:
        """(B, H) feature of the position whose next token is the newest (rows that send none keep theirs)."""
        f = last_valid(feats, valid)
        if state.last is not None:
            f = torch.where(valid.any(1, keepdim=True), f, state.last)
        state.last = f
        return f

    @torch.no_grad()
    def draft(self, state: MedusaState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample: SampleFn) -> tuple[Tensor, Tensor | None]:
        if not 1 <= k <= self.config.num_heads:
            raise HeadError(f"Medusa drafts 1..{self.config.num_heads} tokens (head.num_heads), asked for k={k}")
        f = self._consume(state, feats, valid)
        tokens, probs = [], []
        for i in range(k):
            tok, prob = sample(self.head_logits(i, f))  # (B,), (B, V) | None
            tokens.append(tok)
            probs.append(prob)
        return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)

    # ---- tree drafting: Medusa's tree is its heads' top-k at each depth, pruned by path score ----
    @property
    def max_tree_depth(self) -> int:
        return self.config.num_heads

    def tree_root(self, state: MedusaState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> Tensor:
        return self._consume(state, feats, valid)

    def tree_logp(self, f: Tensor, depth: int) -> Tensor:
        return torch.log_softmax(self.head_logits(depth - 1, f), dim=-1)  # head d-1 guesses depth d

    def tree_step(self, state: MedusaState, parent_f: Tensor, tokens: Tensor, depth: int, visible: Tensor) -> Tensor:
        return parent_f  # no cache: every node reads the same feature f
