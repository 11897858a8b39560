"""Targets beyond llama: Qwen2 (attention bias), Qwen3 (q/k norm), Gemma 3 (sliding-window and global
layers, scaled embedding, extra norms) and Mistral (sliding window), as tiny random models.

For each architecture and head family:
1. the feature-layer convention holds (index i = residual stream entering layer i, the embedding
   output at 0 with Gemma's scale applied; -1 = the final norm's output, what the lm_head reads);
2. the head trains (loss falls in a few steps on a fixed batch);
3. the verify loop is lossless in fp32 at T = 0 against transformers' own greedy decoding, batch 1
   and a ragged batch with a head fitted to those continuations, chain, tree and hybrid: drafts are
   accepted (tau >= 1.5, depth >= 2 in trees) and rejected, and on the sliding-window targets a
   verify window is seen reaching past a rolled-back hole or a dropped branch (counted, asserted);
4. every export of every architecture imports back to the same tensors and the same draft logits, or
   refuses naming why. That is a round trip only: a convention wrong both ways passes it. What pins a
   layout to the engine is elsewhere and on llama targets only: vLLM's real load and serve
   (tests/test_engine_vllm.py, tests/test_dflash_engine.py, vLLM's load_weights of DFlash in
   tests/test_dflash_head.py), SGLang's loader transcribed (tests/test_export_sglang.py), the speculators
   package (tests/test_export.py, tests/test_dflash_head.py). No engine loads the Qwen2/Qwen3/Gemma 3/Mistral
   exports here.
"""
from __future__ import annotations

import json

import pytest
import torch

from draftkit.export import ExportError, export_head, import_head
from draftkit.heads import build_head, load_head
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.decoder import SpecDecoder
from draftkit.target import FINAL
from tests.conftest import fit, fit_on_greedy_continuations, make_arch_target
from tests.test_export import draft_logits  # the logits every draft step samples from, on fixed inputs
from tests.test_spec_decoder import hf_greedy  # transformers' own greedy decoding, one row at a time

pytestmark = pytest.mark.usefixtures("one_thread")

# Architectures whose every layer attends to the whole context, and those with sliding windows.
FULL = ("qwen2", "qwen3")
SLIDING = ("gemma3", "mistral")
FAMILIES = {
    "eagle": {"type": "eagle", "num_layers": 1},
    "eagle3": {"type": "eagle3", "draft_vocab_size": 64, "feature_layers": [1, 2, 3]},
    "medusa": {"type": "medusa", "num_heads": 3},
    "mtp": {"type": "mtp"},
    "dflash": {"type": "dflash", "block_size": 4, "feature_layers": [1, 3]},
}
V = 96
LENGTHS = (5, 11, 8, 14)
NEW = 24
# What each engine can carry, per (format, family): the architectures it refuses, and a word of
# the reason the refusal must give. Everything else must export and import back bit-identically.
GEMMA_EMBEDDING = {"gemma3": "sqrt\\(hidden_size\\)"}  # the draft's embedding would lack Gemma's scale
EXPORTS = {
    ("vllm", "eagle"): GEMMA_EMBEDDING, ("sglang", "eagle"): GEMMA_EMBEDDING,
    ("vllm", "eagle3"): GEMMA_EMBEDDING, ("sglang", "eagle3"): GEMMA_EMBEDDING,
    ("speculators", "eagle3"): GEMMA_EMBEDDING,
    ("vllm", "medusa"): {}, ("draftkit", "eagle"): {}, ("draftkit", "eagle3"): {}, ("draftkit", "medusa"): {},
    ("draftkit", "mtp"): {},
    ("vllm", "dflash"): GEMMA_EMBEDDING, ("draftkit", "dflash"): {}, ("speculators", "dflash"): GEMMA_EMBEDDING,
}
# Head settings a format needs beyond FAMILIES: speculators' DFlash has no separate mask vector (the
# verifier's embedding row of mask_token_id), so its head keeps mask_embedding frozen at that row.
EXPORT_HEAD = {("speculators", "dflash"): {"train_mask_embedding": False}}


@pytest.fixture(scope="module", params=FULL + SLIDING)
def arch(request):
    return request.param


# Every architecture, the sliding-window ones included: their windows (4 tokens) are smaller than
# the prompts, so rolled-back holes and left padding fall inside them.
LOSSLESS = FULL + SLIDING


@pytest.fixture(scope="module", params=LOSSLESS)
def lossless_arch(request):
    return request.param


_TARGETS: dict = {}


def target_of(arch: str):
    if arch not in _TARGETS:
        _TARGETS[arch] = make_arch_target(arch)
    return _TARGETS[arch]


def prompts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in LENGTHS]


def test_feature_layer_convention(arch):
    """hidden[:, :, i] = residual stream entering layer i (0 = scaled embedding), -1 = final norm output."""
    target = target_of(arch)
    ids = torch.tensor([prompts()[1]])
    feats = target.features(ids, None, (0, 2, FINAL))
    H = target.hidden_size
    # captured independently: the input of decoder layer 2, and the embedding the model itself uses
    seen = {}

    def grab(module, args, kwargs):
        seen["in2"] = (args[0] if args else kwargs["hidden_states"]).clone()

    hook = target.decoder.layers[2].register_forward_pre_hook(grab, with_kwargs=True)
    out = target.model(ids, output_hidden_states=False)
    hook.remove()
    emb = target.embed_tokens(ids)
    if arch == "gemma3":  # Gemma multiplies the embedding by sqrt(hidden_size) inside the module
        raw = torch.nn.functional.embedding(ids, target.embed_tokens.weight)
        assert torch.allclose(emb, raw * H ** 0.5, atol=1e-5)
    assert torch.equal(feats.hidden[..., :H], emb)
    assert torch.equal(feats.hidden[..., H: 2 * H], seen["in2"])
    assert torch.allclose(target.logits(feats.hidden[..., 2 * H:]), out.logits, atol=1e-5)
    assert torch.equal(feats.final_hidden, feats.hidden[..., 2 * H:])


@pytest.mark.parametrize("family", FAMILIES)
def test_head_trains(arch, family):
    target = target_of(arch)
    torch.manual_seed(0)
    head = build_head(dict(FAMILIES[family]), target)
    ids = torch.randint(3, V, (3, 12), generator=torch.Generator().manual_seed(1))
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(tokens=ids)
    losses, out = fit(head, target.features(ids, None, head.feature_layers), steps=8, lr=1e-2)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_lossless_batch1(lossless_arch, family):
    target = target_of(lossless_arch)
    rows = prompts()
    ref = hf_greedy(target, rows, NEW)
    torch.manual_seed(0)
    head = build_head(dict(FAMILIES[family]), target)
    dec = SpecDecoder(target, head, 3, stop_ids=[])
    assert [dec.generate([p], NEW)[0][0] for p in rows] == ref


@pytest.fixture
def window_crossings(monkeypatch):
    """Counts verify queries whose sliding window reaches a visible key more than `window` slots
    back: a rolled-back hole or an unvisited tree branch lies between, so a window counted in slots
    would drop a key the plain decoding sees. Proof that the position-bounded window was needed."""
    from draftkit.inference.cache import MaskSpec

    build, seen = MaskSpec.build, [0]

    def spy(self, allowed, q_pos, k_pos):
        if self.window:
            T, S = allowed.shape[1:]
            q_slot = torch.arange(S - T, S)[:, None]  # (T, 1) slots of the queries
            far = q_slot - torch.arange(S)[None] >= self.window  # (T, S)
            inside = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < self.window)  # (B, T, S)
            seen[0] += int((inside & far).any(-1).sum())
        return build(self, allowed, q_pos, k_pos)

    monkeypatch.setattr(MaskSpec, "build", spy)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_lossless_ragged_trained_head(lossless_arch, family, window_crossings):
    """A head fitted to 3 of the 4 rows' continuations: drafts are accepted in those and rejected in
    the fourth, so the batch carries holes and left padding through every sliding window."""
    target = target_of(lossless_arch)
    torch.manual_seed(0)
    head = build_head(dict(FAMILIES[family]), target)
    rows = prompts()
    fit_on_greedy_continuations(target, head, steps=40, prompts=rows[:3], new_tokens=NEW, length=None)  # row 4 unseen
    head.eval()
    ref = hf_greedy(target, rows, NEW)
    sliding = lossless_arch in SLIDING
    out, stats = SpecDecoder(target, head, 3, stop_ids=[]).generate(rows, NEW)
    assert out == ref
    assert stats.tau >= 1.5, stats.to_dict()  # drafts accepted: the roll-back paths ran with the window
    assert (window_crossings[0] > 0) == sliding  # ... and a window reached past a rolled-back hole
    # a tree (and the hybrid with lookup): non-accepted branches are dropped inside the window too
    for settings in (DraftSettings(mode="tree", topk=2, depth=3, budget=6),
                     DraftSettings(mode="hybrid", topk=2, depth=2, budget=4, lookup_len=3)):
        drafter, kw = settings.decoder_args(head)
        window_crossings[0] = 0
        out, stats = SpecDecoder(target, drafter, stop_ids=[], **kw).generate(rows, NEW)
        assert out == ref, settings.mode
        assert stats.tau >= 1.5 and sum(stats.accepted_hist[2:]) > 0, (settings.mode, stats.to_dict())
        assert (window_crossings[0] > 0) == sliding, settings.mode


def make_head(family: str, target, directory, **settings):
    """A head with random weights everywhere it trains; frozen parameters (DFlash's mask vector with
    train_mask_embedding false: the target's row) keep what the head was built with."""
    head = build_head({**FAMILIES[family], **settings}, target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(counts=torch.randint(0, 1000, (target.vocab_size,), generator=g))
    head.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("fmt,family", EXPORTS)
def test_export_loads_or_refuses_naming_why(arch, fmt, family, tmp_path):
    target = target_of(arch)
    src = make_head(family, target, tmp_path / "head", **EXPORT_HEAD.get((fmt, family), {}))
    why = EXPORTS[(fmt, family)].get(arch)
    if why is not None:
        with pytest.raises(ExportError, match=why) as e:
            export_head(src, fmt, tmp_path / "out", target=target)
        assert arch in str(e.value) and "draftkit" in str(e.value)  # names the target and what still works
        return
    out = export_head(src, fmt, tmp_path / "out", target=target)
    contract = json.loads((out / "config.json").read_text())["draftkit_contract"]
    assert contract["target"]["model_type"] == target.config.model_type
    back = import_head(out, fmt, tmp_path / "back", target=target)
    a, b = load_head(src, target), load_head(back, target)
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    # the loop's drafts: what the config carries (feature layers, block size, mask id) as well as the weights
    for x, y in zip(draft_logits(a, target), draft_logits(b, target), strict=True):
        assert torch.equal(x, y)
