"""Medusa's typical acceptance (Cai et al. 2024), the LOSSY verify rule beside the rejection sampler.

`SpecDecoder(acceptance=...)`:
  "rejection" (default)  the rejection sampler (rejection.py): LOSSLESS, every token follows the
                         target's distribution.
  "typical"              typical acceptance: LOSSY. Draft i is accepted while
                         p(d_i) > min(epsilon, delta * exp(-H(p))), p the target's distribution at
                         that position after the same temperature / top-k / top-p; at the first
                         position not accepted (or the bonus position) the token is the target's
                         own: argmax at T = 0, at T > 0 a draw from that same processed distribution
                         (the Medusa paper takes it greedily; we sample so T > 0 stays a sample). The
                         drafter drafts its top-1 chain (greedy `sample`, as Medusa's candidates are
                         the heads' top predictions): the rule never reads q, and a draft sampled
                         from q would often be a low-p token it rejects. At T = 0 p is one-hot, so
                         the rule is exact match: lossless there.
"""
from __future__ import annotations

import torch
from torch import Tensor

from draftkit.inference.errors import SpecError
from draftkit.inference.sampling import SamplingParams, logits_to_probs

ACCEPTANCE_RULES = ("rejection", "typical")
TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3  # Medusa's posterior_threshold / posterior_alpha


def acceptance_label(acceptance: str = "rejection", epsilon: float = TYPICAL_EPSILON,
                     delta: float = TYPICAL_DELTA) -> str:
    """How a report names the rule: 'rejection (lossless)' or 'typical (lossy, eps=..., delta=...)'."""
    if acceptance == "typical":
        return f"typical (lossy, eps={epsilon:g}, delta={delta:g})"
    return "rejection (lossless)"


def check_acceptance(acceptance: str, epsilon: float, delta: float) -> None:
    if acceptance not in ACCEPTANCE_RULES:
        raise SpecError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {acceptance!r}")
    for name, v in (("typical_epsilon", epsilon), ("typical_delta", delta)):
        if not (isinstance(v, (int, float)) and 0.0 <= v < float("inf")):
            raise SpecError(f"{name} must be a finite number >= 0, got {v!r}")


def typical_verify(drafts: Tensor, logits: Tensor, num_draft: Tensor, params: SamplingParams, sample,
                   epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> tuple[Tensor, Tensor]:
    """The verify rule of acceptance="typical" (LOSSY at T > 0), same contract as the rejection sampler.

    drafts (B, w), logits (B, w+1, V) the target's raw logits at the verify positions, num_draft (B,).
    Accepts the longest prefix with p(d_i) > min(epsilon, delta * exp(-H(p_i))), p_i the processed
    target distribution (logits_to_probs: one-hot at T = 0, so exact match there), then takes the
    target's own token at position num_accepted with `sample` (argmax at T = 0, a per-row draw from
    p at T > 0; no residual distribution). Returns (tokens (B, w+1) padded with -1, num_accepted (B,)).
    """
    B, w = drafts.shape
    probs = logits_to_probs(logits[:, :w], params)  # (B, w, V)
    offered = torch.where(torch.arange(w, device=drafts.device)[None] < num_draft[:, None], drafts, -1)
    num_acc = typical_acceptance(offered, probs, epsilon, delta)  # (B,)
    last, _ = sample(logits[torch.arange(B, device=drafts.device), num_acc])  # (B,)
    positions = torch.arange(w + 1, device=drafts.device)[None]  # (1, w+1)
    out = torch.where(positions < num_acc[:, None], torch.nn.functional.pad(drafts, (0, 1), value=-1), -1)
    return out.scatter_(1, num_acc[:, None], last[:, None]), num_acc


def typical_acceptance(draft_tokens: Tensor, target_probs: Tensor, epsilon: float = 0.09,
                       delta: float = 0.3) -> Tensor:
    """Medusa's typical acceptance: LOSSY (output no longer follows the target's distribution).

    draft_tokens (B, k); target_probs (B, k, V) the target's (temperature-processed) distribution
    at each draft position. Draft i is accepted when p(draft_i) > min(epsilon, delta * exp(-H(p)))
    (H = entropy): likely enough, with a bar that drops as the target grows uncertain. Returns
    num_accepted (B,), the accepted prefix length in 0..k; the caller then takes one token from
    the target at position num_accepted, as with any verify rule. Medusa's defaults: the
    posterior_threshold epsilon = 0.09 and posterior_alpha delta = 0.3.
    """
    p = target_probs.float()
    entropy = -(p * torch.log(p.clamp(min=1e-10))).sum(-1)  # (B, k)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    p_draft = p.gather(-1, draft_tokens.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, k)
    ok = (p_draft > threshold) & (draft_tokens >= 0)
    return ok.long().cumprod(1).sum(1)  # (B,) leading run of accepted drafts
