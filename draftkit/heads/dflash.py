"""DFlash (z-lab, 2026: "Block Diffusion for Flash Speculative Decoding"): a block of tokens in ONE forward.

A few transformer layers, conditioned on the target, denoise a block of B positions after the last
confirmed token at once. For a block anchored at position a (x_a the newest confirmed token, the
one the target has not seen yet):
    c_s   = hidden_norm(fc([h^(l1)_s; ...; h^(lG)_s]))        the target's G layers fused, s < a
    z_0   = [embed(x_a), m, m, ..., m]                        B inputs: x_a, then B-1 mask embeddings
    layer j (pre-norm Qwen3 block, q/k per-head RMSNorm, rotary positions a .. a+B-1):
        queries from norm(z), keys/values = [k_proj_j(c_s), s < a] ++ [k_proj_j(norm(z)), the block]
        (the context c enters every layer's attention as extra K/V; it is never a query; no layer
        norm on it beyond hidden_norm)
    p̂_i   = softmax(lm_head(norm(z_L)_i))   i = 1..B-1 predicts x_{a+i}; output 0 is unused
Attention: a block position sees the context strictly before its anchor (c_s, s < a: the target
has not run on x_a yet) and ALL B positions of its own block (bidirectional; they hold only x_a and
mask embeddings, no later token), never another block. The token embedding and lm_head are the
target's, frozen (as every reference); fc, hidden_norm, the layers and norm are the head's.

Training (SpecForge's OnlineDFlashModel, speculators' DFlash): for each sample, up to `num_anchors`
random anchors a (ours: a >= 1 with x_{a+1} a loss token), one block per anchor, all blocks in one
forward (each sees the context before its own anchor, its own block only). Block position i of
anchor a is supervised at x_{a+i} when that is a real loss token, with weight exp(-(i-1)/gamma)
(the paper's Eq. 4; SpecForge's --loss-decay-gamma, suggested 7 for B = 16, 5 for 10, 4 for 8),
loss = sum w KL / sum w. Labels: SpecForge takes cross-entropy on the sample's tokens, speculators
the KL to the verifier's distribution; ours is the KL to the target's distribution at a+i-1 (rebuilt
from its final hidden state, or its stored top-k with train.target_topk), as every draftkit family
(on regenerated data its argmax IS the sample's token).

Drafting in our loop (the block as a CHAIN): the head caches, per layer, the context K/V of the
CONFIRMED positions only (their target features; rows ragged, holes masked, rotary positions per
row). Each draft call appends the newly confirmed positions' K/V, then runs one forward over
[pending, m * (B-1)] at positions next_pos .. next_pos+B-1 WITHOUT caching the block's K/V, and
samples positions 1..k (k <= B-1) each from its own p̂_i. Position i's distribution does not depend
on the drafts before it, so q_i is exactly what the rejection sampler needs: lossless at T = 0 and
T > 0. Roll-back is free: the next call brings the features of the accepted positions only.
Draft cost: one forward whatever k (EAGLE pays one per token). Trees (draft.mode tree / hybrid):
EAGLE-2's growth where a depth-d node's children are position d's top-k whatever its ancestors,
from the same single forward; the loop's tree walk verifies any tree losslessly.

Mask embedding: the references embed the mask slots with the target's embedding row of a reserved
`mask_token_id` (Qwen3 has spare rows; SmolLM2's 49152 rows are all tokens). Ours is a trained
vector `mask_embedding` (H,), started from that row (train_mask_embedding: false keeps it there);
vLLM takes it as `mask_embedding.pt` beside the weights (DFlashQwen3Model.has_separate_mask_embedding).
vLLM feeds every mask slot as the INPUT ID mask_token_id and substitutes the vector wherever an
input id equals it, the anchor slot included: when the confirmed token is mask_token_id itself, vLLM
embeds it as a mask where our loop embeds the token. Lossless either way (the target verifies), but
acceptance drops there, so mask_token_id should be a token the text never holds: default V-1 (on
SmolLM2 an ordinary BPE token; set head.mask_token_id to an unused id where the tokenizer has one).

vLLM 0.32 layout (model_executor/models/qwen3_dflash.py, DFlashQwen3ForCausalLM, architecture
"DFlashDraftModel"): config.json is a Qwen3 config of the draft (num_hidden_layers = our
num_layers, the target's widths, block_size) with dflash_config = {mask_token_id, target_layer_ids};
target_layer_ids name the target layer whose OUTPUT is taken: ours minus 1 (vLLM adds 1 back to get
eagle_aux_hidden_state_layer_ids, our convention). Tensors: fc.weight (H, G*H), hidden_norm.weight,
layers.{j}.self_attn.{q,k,v,o}_proj.weight, layers.{j}.self_attn.{q,k}_norm.weight (head_dim),
layers.{j}.{input,post_attention}_layernorm.weight, layers.{j}.mlp.{gate,up,down}_proj.weight,
norm.weight; embed_tokens / lm_head come from the target unless shipped (d2t with a draft vocabulary).
Our parameter names are those.

Sizing for the embedded target (SmolLM2-135M: hidden 576, 30 layers, V 49152): the published drafts
use 5 layers under 32-64-layer 4-8B targets (~1/8 of the target's depth) and blocks of 16 where
they accept 6+ tokens. Here EAGLE heads accept ~1.4 tokens per step, so a block of 8 (k <= 7)
covers every length the target accepts, and 2 layers (~1/15 of the target) keep the draft at a few
per cent of a target step while giving the block positions a second round to exchange information.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftkit.heads.base import DraftHead, HeadConfig, HeadError, SampleFn
from draftkit.heads.layers import (MLP, LayerDims, LayerKV, RMSNorm, append_positions, apply_rope, last_valid,
                                   within_window)
from draftkit.heads.losses import kl_rows
from draftkit.heads.vocab import DraftVocab, check_draft_vocab_size


@dataclass
class DFlashConfig(HeadConfig):
    type: str = "dflash"
    # Draft transformer layers (the published drafts: 5 on 4-8B targets; see the module doc).
    num_layers: int = 2
    # B: positions per block = the pending token + B-1 mask slots, so at most B-1 drafts per step.
    block_size: int = 8
    # Target layers fused by fc, in draftkit's convention (index i = residual stream entering
    # decoder layer i = transformers hidden_states[i]). None = z-lab's build_target_layer_ids for
    # num_layers draft layers (N//2 for one; evenly from 1 to N-3 otherwise, those are OUTPUT ids)
    # plus one: [2, 28] for the 30-layer SmolLM2 with 2 layers.
    feature_layers: list[int] | None = None
    # Token id whose embedding the mask slots carry (vLLM's dflash_config.mask_token_id); None =
    # the last id V-1. Ours is trained (mask_embedding), started from that row.
    mask_token_id: int | None = None
    # false: keep mask_embedding frozen at the target's row of mask_token_id, the references'
    # convention (z-lab, SpecForge, speculators embed the mask slots with the frozen embedding);
    # needed for the speculators format, which has no separate mask vector.
    train_mask_embedding: bool = True
    # Loss weight of block position i >= 1: exp(-(i-1)/gamma) (DFlash Eq. 4); None = all equal.
    loss_decay_gamma: float | None = 4.0
    # Blocks per sample per training step (SpecForge --num-anchors, default 512 at length 2048+).
    num_anchors: int = 64
    # Draft over the N most frequent response tokens (the target's lm_head rows, frozen; d2t/t2d
    # as EAGLE-3) instead of all V. None = the full vocabulary.
    draft_vocab_size: int | None = None

    def fill_from_target(self, target) -> None:
        super().fill_from_target(target)
        if self.feature_layers is None:
            self.feature_layers = [i + 1 for i in zflash_layer_ids(target.num_layers, self.num_layers)]
        if self.mask_token_id is None:
            self.mask_token_id = target.vocab_size - 1

    def position_weights(self) -> list[float]:
        """Loss weight of block positions 0..B-1 (position 0, the anchor token, is never supervised)."""
        g = self.loss_decay_gamma
        return [0.0] + [math.exp(-(i - 1) / g) if g else 1.0 for i in range(1, self.block_size)]


def zflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default target_layer_ids (OUTPUT-of-layer ids): N//2 for one draft layer, else
    num_draft_layers ids spread evenly over 1 .. N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, span = 1, num_target_layers - 4
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def block_attention(q: Tensor, k_blk: Tensor, v_blk: Tensor, k_ctx: Tensor, v_ctx: Tensor,
                    ctx_visible: Tensor, block: int) -> Tensor:
    """Attention of A blocks of `block` queries: each sees the context keys it may (ctx_visible)
    and every key of its own block, nothing of the other blocks; no dense (A*B, S + A*B) mask.

    q (N, h, A*B, d); k_blk, v_blk (N, kv, A*B, d); k_ctx, v_ctx (N, kv, S, d);
    ctx_visible (N, A, S) bool, the same for a block's every query, or (N, A, B, S) per query
    (a sliding window) -> (N, h, A*B, d).
    """
    N, h, AB, d = q.shape
    kv, A = k_blk.shape[1], AB // block
    if A == 1:  # drafting: one block, so one fused kernel over [context ; block] costs no dense mask worth avoiding
        vis = ctx_visible.expand(N, block, -1) if ctx_visible.dim() == 3 else ctx_visible[:, 0]  # (N, B, S)
        mask = torch.cat([vis, vis.new_ones(N, block, block)], dim=-1)[:, None]  # (N, 1, B, S + B)
        return torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2), attn_mask=mask,
            enable_gqa=h != kv)
    qg = q.view(N, kv, h // kv, A, block, d)  # query head j reads kv head j // (h / kv)
    kb, vb = k_blk.view(N, kv, A, block, d), v_blk.view(N, kv, A, block, d)
    scale = d ** -0.5
    s_ctx = torch.einsum("nkgabd,nksd->nkgabs", qg, k_ctx) * scale  # (N, kv, g, A, B, S)
    vis = ctx_visible[:, :, None] if ctx_visible.dim() == 3 else ctx_visible  # (N, A, 1 | B, S)
    s_ctx = s_ctx.masked_fill(~vis[:, None, None], float("-inf"))
    s_blk = torch.einsum("nkgabd,nkacd->nkgabc", qg, kb) * scale  # (N, kv, g, A, B, B)
    p = torch.cat([s_ctx, s_blk], dim=-1).float().softmax(-1).to(q.dtype)
    S = k_ctx.shape[2]
    out = (torch.einsum("nkgabs,nksd->nkgabd", p[..., :S], v_ctx)
           + torch.einsum("nkgabc,nkacd->nkgabd", p[..., S:], vb))
    return out.reshape(N, h, AB, d)


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm) whose keys/values are [context ; own block]."""

    def __init__(self, d: LayerDims):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = d.num_attention_heads, d.num_key_value_heads, d.head_dim
        H = d.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, d.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, d.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, T, H) -> rotated, normalised keys and values (N, kv, T, d)."""
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(N, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_ctx: Tensor, v_ctx: Tensor,
                ctx_visible: Tensor, block: int) -> Tensor:
        N, T, _ = x.shape  # T = A * block
        q = self.q_norm(self.q_proj(x).view(N, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)
        y = block_attention(apply_rope(q, cos, sin), k, v, k_ctx, v_ctx, ctx_visible, block)
        return self.o_proj(y.transpose(1, 2).reshape(N, T, -1))


class DFlashLayer(nn.Module):
    """Pre-norm block; the context K/V come in from outside (context_kv), already rotated."""

    def __init__(self, d: LayerDims):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = DFlashAttention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = MLP(d)

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return self.self_attn.keys_values(ctx, cos, sin)  # the fused context: no input norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_ctx: Tensor, v_ctx: Tensor,
                ctx_visible: Tensor, block: int) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, ctx_visible, block)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DFlashState:
    """Per layer, the context K/V of every confirmed position fed so far (never a block's).
    window: as ChainState's (heads/layers.py), by rotary position."""

    kv: list[LayerKV]
    slot_valid: Tensor  # (B, S) bool: slot holds a real confirmed position
    next_pos: Tensor  # (B,) rotary position of the next confirmed position = of the pending token
    window: int | None = None
    slot_pos: Tensor | None = None  # (B, S) rotary position of every slot (kept when window is set)


class DFlashHead(DraftVocab, DraftHead):
    family = "dflash"
    config_class = DFlashConfig
    topk_teacher = True  # the final hidden state is only the label
    # vLLM's rule: its DFlash proposer runs 1 + k query slots (the pending token and k masks,
    # v1/spec_decode/dflash.py), not the trained B; with k < B - 1 its blocks are shorter and, the
    # attention being bidirectional, its drafts differ. True drafts as vLLM does (the engine loop).
    engine_block: bool = False

    def __init__(self, config: DFlashConfig, shared=None):
        super().__init__(config, shared)
        H, G = config.hidden_size, len(config.feature_layers or ())
        self.fc = nn.Linear(G * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config.layer_dims()) for _ in range(config.num_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H), requires_grad=config.train_mask_embedding)
        self.init_draft_vocab(config.draft_vocab_size or config.vocab_size, config.vocab_size)
        object.__setattr__(self, "_vocab_w", None)
        if shared is not None:
            with torch.no_grad():  # the references' mask input: the target's row of mask_token_id
                self.mask_embedding.copy_(shared.embed_tokens.weight[config.mask_token_id].float())

    @classmethod
    def feature_layers_of(cls, config: DFlashConfig) -> tuple[int, ...]:
        return tuple(config.feature_layers or ())

    @classmethod
    def validate(cls, config: DFlashConfig, target) -> None:
        if not config.feature_layers:
            raise HeadError(f"head.feature_layers: DFlash fuses at least one target layer, got {config.feature_layers}")
        super().validate(config, target)
        for name, low in (("num_layers", 1), ("block_size", 2), ("num_anchors", 1)):
            if getattr(config, name) < low:
                raise HeadError(f"head.{name}: must be >= {low}, got {getattr(config, name)}")
        if not 0 <= config.mask_token_id < target.vocab_size:
            raise HeadError(f"head.mask_token_id: {config.mask_token_id} must be in 0..{target.vocab_size - 1}")
        if config.loss_decay_gamma is not None and not config.loss_decay_gamma > 0:
            raise HeadError(f"head.loss_decay_gamma: must be > 0 (or null: equal weights), got {config.loss_decay_gamma}")
        if config.draft_vocab_size is not None:
            check_draft_vocab_size(config.draft_vocab_size, target)

    @property
    def max_draft_tokens(self) -> int:
        return self.config.block_size - 1

    @property
    def has_draft_vocab(self) -> bool:
        return self.d2t.shape[0] < self.t2d.shape[0]

    def draft_vocab_changed(self) -> None:
        object.__setattr__(self, "_vocab_w", None)

    def vocab_logits(self, h: Tensor) -> Tensor:
        """(..., H) final-norm outputs -> (..., N) float32 logits of the frozen lm_head (draft rows)."""
        return self.target_rows_logits(h) if self.has_draft_vocab else self.target_logits(h)

    # ---- the network ----
    def context(self, hidden: Tensor) -> Tensor:
        """(N, T, G*H) target features -> (N, T, H) the fused context c."""
        return self.hidden_norm(self.fc(hidden.to(self.fc.weight.dtype)))

    def block_inputs(self, first_ids: Tensor, block: int) -> Tensor:
        """(N, A) anchor tokens -> (N, A*block, H): each block [embed(x_a), m, ..., m]."""
        dtype = self.fc.weight.dtype
        N, A = first_ids.shape
        x = self.mask_embedding.to(dtype).expand(N, A, block, -1).clone()
        x[:, :, 0] = self.embed(first_ids, dtype)
        return x.view(N, A * block, -1)

    def run_blocks(self, first_ids: Tensor, positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
                   ctx_visible: Tensor, block: int | None = None) -> Tensor:
        """first_ids (N, A), positions (N, A*block) of the block slots, per-layer context K/V,
        ctx_visible (N, A, S) or (N, A, block, S) -> (N, A*block, H) final-norm outputs. block: slots per block (B)."""
        block = block or self.config.block_size
        x = self.block_inputs(first_ids, block)
        cos, sin = self.cos_sin(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, ctx_visible, block)
        return self.norm(x)

    # ---- training ----
    def anchors(self, features) -> tuple[Tensor, Tensor]:
        """Up to num_anchors block starts per row, drawn at random among a >= 1 with x_{a+1} a
        real loss token (a fixed draw in eval mode) -> (anchors (N, A) long, keep (N, A) bool)."""
        ids, attn = features.input_ids, features.attention_mask.bool()
        lm = (features.loss_mask if features.loss_mask is not None else attn).bool() & attn
        N, T = ids.shape
        ok = torch.zeros_like(attn)
        ok[:, 1:-1] = attn[:, 1:-1] & lm[:, 2:]
        gen = None if self.training else torch.Generator(device=ids.device).manual_seed(0)
        score = torch.rand(N, T, generator=gen, device=ids.device).masked_fill(~ok, 2.0)
        A = max(1, min(self.config.num_anchors, int(ok.sum(1).max())))
        picked = score.topk(A, dim=1, largest=False).indices.sort(dim=1).values  # (N, A)
        keep = ok.gather(1, picked)
        return picked.where(keep, 0), keep

    def block_outputs(self, features, anchors: Tensor) -> Tensor:
        """The training forward: every block of `anchors` (N, A) in one pass -> (N, A, B, H)."""
        N, T = features.input_ids.shape
        B, dev = self.config.block_size, anchors.device
        ctx = self.context(features.hidden)  # (N, T, H)
        cos_c, sin_c = self.cos_sin(torch.arange(T, device=dev).expand(N, -1), ctx.dtype)
        ctx_kv = [layer.context_kv(ctx, cos_c, sin_c) for layer in self.layers]
        # block a sees the context strictly before a (the target has not run on x_a yet), real tokens only
        visible = (torch.arange(T, device=dev)[None, None] < anchors[..., None]) & features.attention_mask.bool()[:, None]
        positions = (anchors[..., None] + torch.arange(B, device=dev)).view(N, -1)  # (N, A*B)
        first = features.input_ids.gather(1, anchors)
        return self.run_blocks(first, positions, ctx_kv, visible).view(N, anchors.shape[1], B, -1)

    def loss(self, features) -> dict[str, Tensor]:
        c = self.config
        ids, attn = features.input_ids, features.attention_mask.bool()
        lm = (features.loss_mask if features.loss_mask is not None else attn).bool() & attn
        N, T = ids.shape
        anchors, keep = self.anchors(features)
        out = self.block_outputs(features, anchors)  # (N, A, B, H)
        label = anchors[..., None] + torch.arange(c.block_size, device=ids.device)  # (N, A, B) x_{a+i}
        inside = label < T
        lab = label.clamp(max=T - 1)
        sup = keep[..., None] & inside & lm.gather(1, lab.view(N, -1)).view_as(lab)
        sup[..., 0] = False  # position 0 holds x_a itself
        teacher_at = (lab - 1).clamp(min=0).view(N, -1)  # the target's distribution of x_{a+i} sits at a+i-1
        rows = lambda x: None if x is None else x.gather(  # noqa: E731  (M, ...) at the supervised slots
            1, teacher_at[..., None].expand(-1, -1, x.shape[-1]) if x.dim() == 3 else teacher_at
        ).view(*sup.shape, *x.shape[2:])[sup]
        if features.topk_ids is not None:  # the target's stored top-k (train.target_topk)
            teacher = (self.topk_on_draft_vocab, rows(features.topk_ids), rows(features.topk_logp))
        else:  # the target's logits, rebuilt from its final hidden state
            teacher = (self.teacher_logits, rows(features.final_hidden), rows(features.top1))
        kl, guess, top = kl_rows(self.vocab_logits, teacher[0], out[sup], *teacher[1:], vocab=self.d2t.shape[0])
        pos = torch.arange(c.block_size, device=ids.device).expand_as(sup)[sup]  # (M,) block position
        # Eq. 4's weight; rows whose target top-1 lies outside a draft vocabulary are left out (EAGLE-3)
        w = torch.tensor(c.position_weights(), device=ids.device)[pos] * self.t2d[top].float()
        hit = (self.draft_ids[guess] == top).float().detach()
        metrics = {}
        for i in self.agreement_positions:  # top-1 agreement per block position and the rows it counts
            n = (pos == i).sum().float()
            metrics[f"acc_{i}"], metrics[f"tokens_{i}"] = hit[pos == i].sum() / n.clamp(min=1), n
        return {"loss": (kl * w).sum() / w.sum().clamp(min=1e-6), **metrics, "acc": metrics["acc_1"],
                "kl": kl.detach().sum() / max(kl.shape[0], 1), "tokens": metrics["tokens_1"]}

    @property
    def agreement_positions(self) -> tuple[int, ...]:
        """Block positions 1..B-1: the held-aside eval reports each one's agreement (heldout_acc_i)."""
        return tuple(range(1, self.config.block_size))

    def teacher_logits(self, final: Tensor, top1: Tensor | None) -> tuple[Tensor, Tensor]:
        """The target's (M, N) logits over the draft vocabulary and its (M,) top-1, from its final hidden."""
        if self.has_draft_vocab:
            return self.target_on_draft_vocab(final, top1)
        with torch.no_grad():
            logits = self.target_logits(final)
            return logits, logits.argmax(-1) if top1 is None else top1

    # ---- drafting ----
    def new_draft_state(self, batch_size: int) -> DFlashState:
        dev = self.fc.weight.device
        return DFlashState([LayerKV() for _ in self.layers], torch.zeros(batch_size, 0, dtype=torch.bool, device=dev),
                           torch.zeros(batch_size, dtype=torch.long, device=dev), window=self.attention_window)

    def consume(self, state: DFlashState, feats: Tensor, valid: Tensor) -> None:
        """Append the context K/V of the newly confirmed positions (B, n) (valid marks real ones)."""
        positions = (state.next_pos[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)
        ctx = self.context(feats)
        cos, sin = self.cos_sin(positions, ctx.dtype)
        for layer, cache in zip(self.layers, state.kv):
            cache.extend(*layer.context_kv(ctx, cos, sin))
        state.slot_valid = torch.cat([state.slot_valid, valid.bool()], dim=1)
        state.slot_pos = append_positions(state.slot_pos, positions, state.window)
        state.next_pos = state.next_pos + valid.long().sum(1)

    def block_logits(self, state: DFlashState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int) -> Tensor:
        """Consume the newly confirmed positions, run the block once: (B, k, N) logits of positions 1..k."""
        if k > self.max_draft_tokens:
            raise HeadError(f"dflash head with block_size {self.config.block_size} drafts at most "
                            f"{self.max_draft_tokens} tokens, asked for {k}")
        self.consume(state, feats, valid)
        pending = last_valid(next_tokens, valid)  # (B,) the newest token, not yet seen by the target
        block = k + 1 if self.engine_block else self.config.block_size
        positions = state.next_pos[:, None] + torch.arange(block, device=pending.device)
        kv = [(c.k, c.v) for c in state.kv]
        near = within_window(positions, state.slot_pos, state.window)  # (B, block, S) | None
        visible = state.slot_valid[:, None] if near is None else (state.slot_valid[:, None] & near)[:, None]
        h = self.run_blocks(pending[:, None], positions, kv, visible, block)  # (B, block, H)
        return self.vocab_logits(h[:, 1:k + 1])

    @torch.no_grad()
    def draft(self, state: DFlashState, feats: Tensor, next_tokens: Tensor, valid: Tensor, k: int,
              sample: SampleFn) -> tuple[Tensor, Tensor | None]:
        logits = self.block_logits(state, feats, next_tokens, valid, k)  # (B, k, N)
        tokens, probs = [], []
        for i in range(k):  # independent positions: q_i does not depend on the drafts before it
            tok, prob = self.sample_draft(logits[:, i], sample)  # over the draft vocabulary, q as (B, V)
            tokens.append(tok)
            probs.append(prob)
        return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)

    # ---- tree drafting: the block's per-position top-k ----
    @property
    def max_tree_depth(self) -> int:
        return self.max_draft_tokens

    def tree_root(self, state: DFlashState, feats: Tensor, next_tokens: Tensor, valid: Tensor) -> None:
        """Feed the confirmed positions only (HybridDrafter's head-off steps keep the cache current)."""
        self.consume(state, feats, valid)

    @torch.no_grad()
    def draft_tree(self, state: DFlashState, feats: Tensor, next_tokens: Tensor, valid: Tensor, shape):
        """EAGLE-2's growth over the block's positions: a node at depth d scores its children with
        position d's log-probabilities, whatever its ancestors (the block drafts them in parallel);
        one head forward for the whole tree. The loop's tree walk verifies it losslessly."""
        from draftkit.inference.tree import grow_tree

        logp = torch.log_softmax(self.block_logits(state, feats, next_tokens, valid, shape.depth), -1)  # (B, D, N)
        root = logp.new_zeros(logp.shape[0], 1)  # the tree carries no hidden state
        return grow_tree(root, lambda h, d: logp[:, d - 1, None].expand(-1, h.shape[1], -1),
                         lambda h, tokens, d, visible: h.new_zeros(*tokens.shape, 1), shape,
                         self.draft_vocab)
