"""SGLang's layout pinned to SGLang's own code, not to our importer.

`export --format sglang` followed by `import` is its own inverse, so a convention wrong both ways
(fc halves swapped, an aux-layer id off by one, q and k exchanged) passes a round trip. Here the
export is read by SGLang's rules instead, transcribed (never imported: SGLang is not installed)
from the source at these commits of github.com/sgl-project/sglang:

  python/sglang/srt/models/llama_eagle.py           034b3be819faf3f84c5aae5a4cda27bdf2e12de0
  python/sglang/srt/models/llama_eagle3.py          03d5a7771f6082e7737a5f19cae7d1e863087013
  python/sglang/srt/models/llama.py                 00239548f1cd1a06ca145a5447a86738090a48f1
  python/sglang/srt/model_executor/model_runner.py  0005834cdb2a5b7472789ccbf0d3361b5cf853b8
  python/sglang/srt/speculative/eagle_worker.py     00559eacbf0841146db7e27e445d1971e35e6294

1. The parameters SGLang's modules own (names, shapes), from config.json as their __init__ reads it.
2. Their load_weights: the stacked mapping (q/k/v -> qkv_proj shards "q", "k", "v"; gate/up ->
   gate_up_proj shards 0, 1), the `model.` prefix, what is skipped (EAGLE-1: lm_head.*; EAGLE-3:
   t2d; unknown names: silently, which is why every file tensor must land and every parameter be
   filled), d2t -> hot_token_id = d2t + arange. Then the worker's sharing: EAGLE-1 takes the
   target's embed_tokens and lm_head (set_embed_and_head), EAGLE-3 only embed_tokens (set_embed).
3. Their forward: EAGLE-1 fc(cat(embed, hidden)), llama layers with layer 0's input norm an identity,
   output hidden + residual into the target's lm_head; EAGLE-3 fc over the aux states concatenated in
   layer order, midlayer attention over cat(input_layernorm(embed), hidden_norm(hidden)) with the
   un-normalised hidden as the residual, norm(h + residual), lm_head over the draft vocabulary.
   The aux states: model_runner.py reads eagle_config["eagle_aux_hidden_state_layer_ids"] and
   llama.py captures `hidden_states + residual` before layer id + 1 (the input of that layer).
The draft logits of that reading must equal the head's own, at every position: a convention wrong
in the exporter (planted: fc halves, aux offset, q/k) fails here whatever the importer does.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftkit.export import ExportError, export_head
from draftkit.heads import build_head, load_head
from tests.conftest import make_tiny_target
from tests.test_export import FAMILY_SETTINGS, make_head

# llama.py / llama_eagle3.py load_weights: (param_name, shard_name, shard_id)
STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
ARCH = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}  # each file's EntryClass


def dims(cfg: dict) -> dict:
    """What llama.py's LlamaAttention / LlamaMLP / RMSNorm read from the config."""
    H, nq = cfg["hidden_size"], cfg["num_attention_heads"]
    assert not cfg.get("rope_scaling") and cfg.get("hidden_act", "silu") == "silu"  # the reference below
    return {"H": H, "nq": nq, "nkv": cfg.get("num_key_value_heads", nq), "hd": cfg.get("head_dim", H // nq),
            "I": cfg["intermediate_size"], "eps": cfg["rms_norm_eps"], "theta": cfg.get("rope_theta", 10000)}


# ---- 1. the modules' parameters -----------------------------------------------------------------

def layer_params(prefix: str, d: dict, d_in: int, input_norm: bool, hidden_norm: bool = False) -> dict:
    """llama.py LlamaDecoderLayer (qkv_proj over d_in: llama_eagle3.py's override reads 2H)."""
    p = {f"{prefix}self_attn.qkv_proj.weight": ((d["nq"] + 2 * d["nkv"]) * d["hd"], d_in),
         f"{prefix}self_attn.o_proj.weight": (d["H"], d["nq"] * d["hd"]),
         f"{prefix}mlp.gate_up_proj.weight": (2 * d["I"], d["H"]), f"{prefix}mlp.down_proj.weight": (d["H"], d["I"]),
         f"{prefix}post_attention_layernorm.weight": (d["H"],)}
    if input_norm:  # llama_eagle.py deletes layer 0's
        p[f"{prefix}input_layernorm.weight"] = (d["H"],)
    if hidden_norm:
        p[f"{prefix}hidden_norm.weight"] = (d["H"],)
    return p


def sglang_params(cfg: dict, family: str) -> dict:
    d, V = dims(cfg), cfg["vocab_size"]
    assert not cfg.get("attention_bias") and not cfg.get("tie_word_embeddings")  # else lm_head = embed_tokens
    p = {"model.embed_tokens.weight": (V, d["H"])}
    if family == "eagle":  # llama_eagle.py LlamaModel: fc = nn.Linear(2H, H), bias on (torch's default)
        for i in range(cfg["num_hidden_layers"]):
            p.update(layer_params(f"model.layers.{i}.", d, d["H"], input_norm=i > 0))
        p.update({"model.fc.weight": (d["H"], 2 * d["H"]), "model.fc.bias": (d["H"],),
                  "lm_head.weight": (cfg.get("hot_vocab_size", V), d["H"])})
        return p
    assert cfg["num_hidden_layers"] == 1  # more adds BasicDecoderLayers; draftkit has one midlayer
    p["model.fc.weight"] = (d["H"], 3 * cfg.get("target_hidden_size", d["H"]))
    if cfg.get("bias"):
        p["model.fc.bias"] = (d["H"],)
    p.update(layer_params("model.midlayer.", d, 2 * d["H"], input_norm=True, hidden_norm=True))
    p.update({"model.norm.weight": (d["H"],), "lm_head.weight": (cfg["draft_vocab_size"] or V, d["H"])})
    return p


# ---- 2. load_weights ----------------------------------------------------------------------------

def shard_rows(name: str, shard, d: dict) -> slice:
    """QKVParallelLinear / MergedColumnParallelLinear weight_loader: where a shard's rows go."""
    q, kv, inter = d["nq"] * d["hd"], d["nkv"] * d["hd"], d["I"]
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv),
            0: slice(0, inter), 1: slice(inter, 2 * inter)}[shard]


class Params:
    """SGLang's parameters, filled the way weight_loader fills them (shapes asserted)."""

    def __init__(self, shapes: dict, d: dict):
        self.shapes, self.d = shapes, d
        self.t = {n: torch.full(s, float("nan")) for n, s in shapes.items()}

    def load(self, name: str, w: torch.Tensor, shard=None) -> None:
        if shard is None:  # default_weight_loader: sizes must match
            assert tuple(w.shape) == self.shapes[name], (name, tuple(w.shape), self.shapes[name])
            self.t[name] = w.float().clone()
        else:
            rows = shard_rows(name, shard, self.d)
            assert tuple(w.shape) == (rows.stop - rows.start, self.shapes[name][1]), (name, shard, tuple(w.shape))
            self.t[name][rows] = w.float()

    def unfilled(self, except_: set) -> list[str]:
        return sorted(n for n, t in self.t.items() if n not in except_ and torch.isnan(t).any())


def load_eagle(files: dict, params: Params) -> list[str]:
    """llama_eagle.py load_weights (lm_head.* dropped, `model.` prefixed) into llama.py's
    LlamaForCausalLM.load_weights; returns the names it would only warn about (not found)."""
    warned = []
    for name, w in files.items():
        if "lm_head" in name:
            continue
        name = "model." + name
        for param_name, shard_name, shard in STACKED:
            if shard_name in name:
                name = name.replace(shard_name, param_name)
                assert name in params.t, f"llama.py indexes params_dict[{name!r}]: a KeyError in SGLang"
                params.load(name, w, shard)
                break
        else:
            if name.endswith(".bias") and name not in params.t:
                warned.append(name)  # skipped without a word
            elif name in params.t:
                params.load(name, w)
            else:
                warned.append(name)
    return warned


def load_eagle3(files: dict, params: Params) -> tuple[list[str], torch.Tensor | None]:
    """llama_eagle3.py load_weights; returns (names skipped silently, hot_token_id)."""
    skipped, hot = [], None
    for name, w in files.items():
        if "d2t" in name:
            hot = w.long() + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, shard_name, shard in STACKED:
            if shard_name in name:
                name = name.replace(shard_name, param_name)
                full = f"model.{name}" if name not in params.t else name
                params.load(full, w, shard) if full in params.t else skipped.append(full)
                break
        else:
            full = name if name in params.t else f"model.{name}"
            params.load(full, w) if full in params.t else skipped.append(name)
    return skipped, hot


# ---- 3. the forward -----------------------------------------------------------------------------

def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def add_rms(x, residual, w, eps):
    """RMSNorm(x, residual): the fused add, then the norm; returns (normed, new residual)."""
    residual = x + residual
    return rms(residual, w, eps), residual


def rope(x, d):  # (T, n, hd), neox style (get_rope's default for llama), positions 0..T-1
    hd = d["hd"]
    inv = 1.0 / d["theta"] ** (torch.arange(0, hd, 2).float() / hd)
    f = torch.arange(x.shape[0]).float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(p, prefix, x, d):
    """LlamaAttention: qkv split [q, kv, kv], rope on q and k, causal GQA, scaling hd^-0.5, o_proj."""
    T, hd = x.shape[0], d["hd"]
    q, k, v = (x @ p[f"{prefix}self_attn.qkv_proj.weight"].T).split([d["nq"] * hd, d["nkv"] * hd, d["nkv"] * hd], -1)
    q, k, v = rope(q.view(T, d["nq"], hd), d), rope(k.view(T, d["nkv"], hd), d), v.view(T, d["nkv"], hd)
    rep = d["nq"] // d["nkv"]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, -1)
    return o @ p[f"{prefix}self_attn.o_proj.weight"].T


def mlp(p, prefix, x, d):
    gate_up = x @ p[f"{prefix}mlp.gate_up_proj.weight"].T
    return (F.silu(gate_up[:, : d["I"]]) * gate_up[:, d["I"]:]) @ p[f"{prefix}mlp.down_proj.weight"].T  # SiluAndMul


def llama_layer(p, prefix, x, residual, d):
    """llama.py LlamaDecoderLayer.forward (a missing input_layernorm: llama_eagle.py's identity)."""
    norm = p.get(f"{prefix}input_layernorm.weight")
    if residual is None:
        residual, h = x, (rms(x, norm, d["eps"]) if norm is not None else x)
    else:
        h, residual = add_rms(x, residual, norm, d["eps"])
    h, residual = add_rms(attention(p, prefix, h, d), residual, p[f"{prefix}post_attention_layernorm.weight"], d["eps"])
    return mlp(p, prefix, h, d), residual


def eagle_logits(p, cfg, tokens, hidden):
    """llama_eagle.py: (T,) next tokens and (T, H) target hidden -> (T, V) logits (target's lm_head)."""
    d = dims(cfg)
    x = torch.cat([p["model.embed_tokens.weight"][tokens], hidden], -1) @ p["model.fc.weight"].T + p["model.fc.bias"]
    residual = None
    for i in range(cfg["num_hidden_layers"]):
        x, residual = llama_layer(p, f"model.layers.{i}.", x, residual, d)
    return (x + residual) @ p["lm_head.weight"].T


def eagle3_logits(p, cfg, tokens, aux, hot):
    """llama_eagle3.py: (T,) next tokens, (T, 3 Ht) aux states in layer order -> (T, V) target-vocab
    logits (-inf off hot_token_id)."""
    d, pre = dims(cfg), "model.midlayer."
    embeds = p["model.embed_tokens.weight"][tokens]
    hs = aux @ p["model.fc.weight"].T + (p["model.fc.bias"] if "model.fc.bias" in p else 0)
    residual = hs
    x = torch.cat([rms(embeds, p[f"{pre}input_layernorm.weight"], d["eps"]), rms(hs, p[f"{pre}hidden_norm.weight"], d["eps"])], -1)
    h, residual = add_rms(attention(p, pre, x, d), residual, p[f"{pre}post_attention_layernorm.weight"], d["eps"])
    out, _ = add_rms(mlp(p, pre, h, d), residual, p["model.norm.weight"], d["eps"])
    draft = out @ p["lm_head.weight"].T  # (T, N)
    full = draft.new_full((draft.shape[0], cfg["vocab_size"]), float("-inf"))
    full[:, hot] = draft
    return full


def captured(target, ids: torch.Tensor, cfg: dict) -> torch.Tensor:
    """model_runner.py + llama.py set_eagle3_layers_to_capture: ids from eagle_config (absent:
    [2, N // 2, N - 3]), each + 1, and `hidden_states + residual` taken before those layers (the
    layer's input), concatenated in layer order: (T, 3 H)."""
    layer_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = target.decoder.layers
    capture = [i + 1 for i in layer_ids] if layer_ids is not None else [2, len(layers) // 2, len(layers) - 3]
    assert min(capture) >= 1, "llama.py adds a residual that is None before layer 0: SGLang would crash"
    seen = {}
    hooks = [layers[i].register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
                                                 with_kwargs=True) for i in capture]
    try:
        target.decoder(input_ids=ids[None])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i] for i in range(len(layers)) if i in capture], -1)


def final_hidden(target, ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-1 in SGLang drafts from the target's output hidden state (after its final norm)."""
    return target.decoder(input_ids=ids[None]).last_hidden_state[0]


# ---- the test -------------------------------------------------------------------------------------

def sglang_reads(out, target) -> tuple[dict, dict, torch.Tensor | None]:
    """(config, filled parameters, hot_token_id) of SGLang's loader on an export directory; every file
    tensor lands, every parameter is filled (the worker's shared ones from the target)."""
    cfg = json.loads((out / "config.json").read_text())
    family = {v: k for k, v in ARCH.items()}[cfg["architectures"][0]]
    params = Params(sglang_params(cfg, family), dims(cfg))
    files = load_file(out / "model.safetensors")
    if family == "eagle":
        missed, hot = load_eagle(files, params), None
        params.t["model.embed_tokens.weight"] = target.embed_tokens.weight.float()  # set_embed_and_head
        params.t["lm_head.weight"] = target.lm_head.weight.float()
    else:
        missed, hot = load_eagle3(files, params)
        assert hot is not None, "no d2t: SGLang would draft ids of the draft vocabulary as target ids"
        params.t["model.embed_tokens.weight"] = target.embed_tokens.weight.float()  # set_embed
    assert missed == [], f"SGLang would not load {missed}"
    assert params.unfilled(set()) == [], f"SGLang parameters left uninitialised: {params.unfilled(set())}"
    return cfg, params.t, hot


def our_logits(head, target, ids: torch.Tensor) -> torch.Tensor:
    """The head's first draft logits after each prefix (position t reads ids[:t + 1]): (T - 1, V),
    -inf off the draft vocabulary (sample sees the draft vocabulary's logits; mapped back here)."""
    feats = target.features(ids[None], None, head.feature_layers).hidden
    rows = []
    for t in range(1, ids.shape[0]):
        def sample(logits):
            rows.append((logits if head.draft_vocab is None else head.to_target_logits(logits))[0].float())
            return logits.argmax(-1), None
        head.draft(head.new_draft_state(1), feats[:, :t], ids[None, 1: t + 1], torch.ones(1, t, dtype=torch.bool), 1,
                   sample)
    return torch.stack(rows)


KINDS = {**{k: FAMILY_SETTINGS[k] for k in ("eagle", "eagle_nobias", "eagle3")},
         "eagle3_default_layers": {"type": "eagle3", "draft_vocab_size": 64}}  # (2, N // 2, N - 3)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(layers=8)


@pytest.mark.parametrize("kind", list(KINDS))
def test_sglang_reads_our_export_as_the_head_drafts(kind, target, tmp_path, monkeypatch):
    """SGLang's loader and forward (module doc) on the export give the head's draft logits exactly
    (fp32, to rounding) at every position of two prompts."""
    monkeypatch.setitem(FAMILY_SETTINGS, kind, KINDS[kind])
    src = make_head(kind, target, tmp_path / "head")
    head = load_head(src, target).eval()
    cfg, p, hot = sglang_reads(export_head(src, "sglang", tmp_path / "s"), target)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(3, target.vocab_size, (10,), generator=g)
        with torch.no_grad():
            if head.family == "eagle":
                ref = eagle_logits(p, cfg, ids[1:], final_hidden(target, ids)[:-1].float())
            else:
                ref = eagle3_logits(p, cfg, ids[1:], captured(target, ids, cfg)[:-1].float(), hot)
            ours = our_logits(head, target, ids)
        assert torch.equal(torch.isinf(ref), torch.isinf(ours)), "the draft vocabulary maps to other target ids"
        finite = ~torch.isinf(ref)
        torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers, why", [([0, 2, 3], "layer 0"), ([3, 1, 2], "ascending order"),
                                         ([2, 2, 3], "ascending order")])
def test_layers_sglang_cannot_serve_are_refused(layers, why, tmp_path):
    """llama.py adds `hidden_states + residual` with residual None before layer 0 (the embedding),
    and captures each listed layer once, concatenated in layer order: a head reading layer 0, or
    layers out of order or twice, would be served wrongly (or crash), so the export refuses it."""
    target = make_tiny_target()
    head = build_head({"type": "eagle3", "draft_vocab_size": 64, "feature_layers": layers}, target)
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ExportError, match=why):
        export_head(tmp_path / "head", "sglang", tmp_path / "s")
