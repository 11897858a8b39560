"""An imported z-lab DFlash draft drafts what z-lab's own forward drafts.

test_dflash_head.py checks that `draftkit import --format vllm` of z-lab's layout puts every tensor
in our head unchanged; a convention wrong in how our head USES them (the fused layers' order, the
rotary position of the block, which norm sits where, the mask slots' embedding) passes that. Here a
tiny random draft in z-lab's layout (the fields of tests/fixtures/zlab-dflash/config.json, random
weights under z-lab's tensor names) is run twice: through our importer and DFlashHead, and through
z-lab's forward, transcribed (not imported: z-lab's package is not installed) in plain torch from
github.com/z-lab/dflash at commit 44947fbf71114e241c96de194f4b382b5dd330d0, dflash/model.py (its
forward is the same at e763f230965aeba7e6c414f1957b5bece9448e1e):

- dflash_generate: the target's prefill gives x_n (its greedy token) and the features
  extract_context_feature(hidden_states, target_layer_ids) = cat(hidden_states[id + 1]) in the order
  of target_layer_ids; each block is output_ids[start : start + B] = [newest token, mask_token_id,
  ...] (the output buffer is pre-filled with mask_token_id), embedded with the target's embed_tokens
  (noise_embedding); position_ids run from the draft cache's length to start + B (the new context
  positions, then the block's); the draft logits are target.lm_head(out[:, 1 - B:]); the draft cache
  is cropped to `start` after each call (the block's K/V never stay), and the next call's context is
  the features of the accepted tokens + 1.
- DFlashDraftModel.forward: target_hidden = hidden_norm(fc(features)) once for all layers; rotary
  cos/sin of Qwen3RotaryEmbedding(config) at position_ids (the draft config's rope_theta); each
  Qwen3DFlashDecoderLayer is pre-norm: h + attn(input_layernorm(h)), then + mlp(post_attention_layernorm).
- Qwen3DFlashAttention: q from the block only (q_proj, per-head q_norm); keys/values from
  cat([k_proj(target_hidden), k_proj(block)]) with per-head k_norm on both parts (the fused context
  gets no input_layernorm); rotary on q with the LAST q_len positions and on k with all; the cache
  appends these keys; eager attention with no mask (is_causal False, attention_mask None: every
  block slot sees every cached context key and every slot of its block), GQA by repeating kv heads,
  scale head_dim ** -0.5; o_proj.
- norm(h) at the end; Qwen3RMSNorm = weight * (x * rsqrt(mean(x^2) + eps)); Qwen3MLP =
  down(silu(gate(x)) * up(x)).

Two blocks of z-lab's loop (the prefill block, then one after 2 accepted drafts, its context the 3
new positions) must give our head's draft logits for the same steps, fp32, to float noise.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftkit.heads import load_head
from tests.test_dflash_head import ZLAB, zlab_tensor_names
from tests.test_train import tiny_model_dir  # noqa: F401  (the tiny Llama target directory)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- z-lab's forward, transcribed ---------------------------------------------------------------
def rms(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rotary(cfg, positions):
    """Qwen3RotaryEmbedding's default rope: (T,) positions -> cos, sin (T, head_dim)."""
    d = cfg["head_dim"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), emb.sin()


class ZlabDraft:
    """DFlashDraftModel with its DynamicCache: one list of (k, v) per layer, cropped by the loop."""

    def __init__(self, cfg: dict, w: dict):
        self.cfg, self.w = cfg, w
        self.cache = [None] * cfg["num_hidden_layers"]

    def seq_length(self) -> int:
        return 0 if self.cache[0] is None else self.cache[0][0].shape[2]

    def crop(self, n: int) -> None:
        self.cache = [None if c is None else (c[0][:, :, :n], c[1][:, :, :n]) for c in self.cache]

    def attention(self, i: int, x, ctx, cos, sin):
        c, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        hd, nh, nkv, eps = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
        T, S = x.shape[1], ctx.shape[1]
        q = rms((x @ w[p + "q_proj.weight"].T).view(1, T, nh, hd), w[p + "q_norm.weight"], eps).transpose(1, 2)
        k = torch.cat([ctx @ w[p + "k_proj.weight"].T, x @ w[p + "k_proj.weight"].T], 1).view(1, S + T, nkv, hd)
        v = torch.cat([ctx @ w[p + "v_proj.weight"].T, x @ w[p + "v_proj.weight"].T], 1).view(1, S + T, nkv, hd)
        k, v = rms(k, w[p + "k_norm.weight"], eps).transpose(1, 2), v.transpose(1, 2)
        q = q * cos[-T:] + rot_half(q) * sin[-T:]  # the last q_len positions
        k = k * cos + rot_half(k) * sin
        if self.cache[i] is not None:
            k, v = torch.cat([self.cache[i][0], k], 2), torch.cat([self.cache[i][1], v], 2)
        self.cache[i] = (k, v)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)  # repeat_kv
        att = torch.softmax((q @ k.transpose(-1, -2)) * hd ** -0.5, dim=-1, dtype=torch.float32).to(q.dtype)
        return (att @ v).transpose(1, 2).reshape(1, T, nh * hd) @ w[p + "o_proj.weight"].T

    def forward(self, position_ids, noise_embedding, target_hidden):
        c, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        h = noise_embedding
        ctx = rms(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        cos, sin = rotary(c, position_ids)
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            h = h + self.attention(i, rms(h, w[p + "input_layernorm.weight"], eps), ctx, cos, sin)
            m = rms(h, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return rms(h, w["norm.weight"], eps)


def zlab_features(hidden_states, layer_ids):
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)  # extract_context_feature


# ---- the test ----------------------------------------------------------------------------------------
def write_draft(out: Path, cfg: dict) -> None:
    """config.json + model.safetensors under z-lab's names; weights small enough that the attention
    is not one-hot (a position convention must show), norms away from 1 (each must matter)."""
    H, hd, I = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    G = len(cfg["dflash_config"]["target_layer_ids"])
    shape = {"fc": (G * H,), "q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
             "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    g = torch.Generator().manual_seed(5)
    state = {}
    for n in zlab_tensor_names(cfg):
        kind = n.split(".")[-2]
        if kind == "fc":
            state[n] = torch.randn(H, G * H, generator=g) * (G * H) ** -0.5
        elif kind in shape:
            state[n] = torch.randn(*shape[kind], generator=g) * shape[kind][1] ** -0.5 * 1.5
        else:  # a norm: (H,) or (head_dim,)
            size = hd if kind in ("q_norm", "k_norm") else H
            state[n] = 1.0 + 0.4 * torch.randn(size, generator=g)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(state, out / "model.safetensors")


def test_imported_zlab_draft_drafts_as_zlabs_own_forward(tiny_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from draftkit.export import import_head
    from draftkit.target import load_target

    cfg = json.loads((ZLAB / "config.json").read_text())
    # target_layer_ids out of order (z-lab concatenates in the listed order) and a rope_theta of
    # the draft's own (z-lab's rotary reads the draft config), so neither convention passes by luck
    cfg["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": [2, 0]}
    cfg["rope_theta"] = 500.0
    write_draft(tmp_path / "zlab", cfg)
    target = load_target(str(tiny_model_dir), dtype="float32")
    head = load_head(import_head(tmp_path / "zlab", "vllm", tmp_path / "ours", target=target), target).eval()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    w = load_file(tmp_path / "zlab" / "model.safetensors")
    dc = cfg["dflash_config"]
    B, ids_z, mask_id = cfg["block_size"], dc["target_layer_ids"], dc["mask_token_id"]

    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 380, (1, 9), generator=g)
    n = prompt.shape[1]
    with torch.no_grad():
        # z-lab's loop, two blocks. Block 1: context = the prompt (positions 0..n-1), block at n.
        out = hf(prompt, output_hidden_states=True)
        x_n = out.logits[:, -1].argmax(-1)
        draft = ZlabDraft(cfg, w)
        block = torch.cat([x_n[:, None], torch.full((1, B - 1), mask_id)], 1)
        h = draft.forward(torch.arange(draft.seq_length(), n + B), hf.model.embed_tokens(block),
                          zlab_features(out.hidden_states, ids_z))
        ref1 = hf.lm_head(h[:, 1 - B:])
        draft.crop(n)
        d = ref1.argmax(-1)  # (1, B-1) the drafts
        # the target verifies block [x_n, d_1, ..]; say d_1, d_2 are accepted: 3 new positions
        # n..n+2 of context, the pending token the target's own at n+2, the next block at n+3
        seq = torch.cat([prompt, x_n[:, None], d[:, :B - 1]], 1)
        full = hf(seq, output_hidden_states=True)
        pending = full.logits[:, n + 2].argmax(-1)
        start = n + 3
        block = torch.cat([pending[:, None], torch.full((1, B - 1), mask_id)], 1)
        h = draft.forward(torch.arange(draft.seq_length(), start + B), hf.model.embed_tokens(block),
                          zlab_features(full.hidden_states, ids_z)[:, n:start])
        ref2 = hf.lm_head(h[:, 1 - B:])

        # ours: the draft-loop API, fed what our loop feeds (our target's features of our layer ids)
        ours = target.features(seq[:, :start], None, head.feature_layers).hidden
        state = head.new_draft_state(1)
        got1 = head.block_logits(state, ours[:, :n], torch.cat([prompt[:, 1:], x_n[:, None]], 1),
                                 torch.ones(1, n, dtype=torch.bool), B - 1)
        got2 = head.block_logits(state, ours[:, n:start], torch.cat([seq[:, n + 1:start], pending[:, None]], 1),
                                 torch.ones(1, 3, dtype=torch.bool), B - 1)
    assert ref1.std(-1).min() > 0.05  # the tiny target's lm_head (init std 0.02) gives logits of ~0.1
    torch.testing.assert_close(got1, ref1, rtol=1e-5, atol=1e-6, msg=lambda m: f"block 1 (prefill): {m}")
    torch.testing.assert_close(got2, ref2, rtol=1e-5, atol=1e-6, msg=lambda m: f"block 2 (3 new positions): {m}")
    assert head.feature_layers == (3, 1)  # z-lab's [2, 0], each + 1, in z-lab's order
