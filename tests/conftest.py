"""Shared fixtures: tiny random llama targets (fast), never the hub, never ../shared."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# The recipes say data.responses.engine: auto (vLLM where installed). Most tests run stage 1 on tiny
# models vLLM's CPU attention cannot serve (head_dim 8), which auto answers with hf by itself
# (engines/vllm_data.cpu_refusal); auto means hf here, in this process and in the runs they launch,
# so that it neither looks for vLLM (an import in a subprocess) nor starts it for a tiny target it
# could serve. Tests of auto and of vLLM set the engine themselves.
os.environ["DRAFTKIT_DATA_ENGINE"] = "hf"


def make_tiny_target(vocab: int = 96, hidden: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                     seed: int = 0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftkit.target import Target

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).to(dtype)
    return Target(model, None, name=f"tiny-llama-{seed}")


def batch(target, B=3, T=12, seed=1):
    """Random token ids (B, T) with one right-padded row and 4 'prompt' tokens outside the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -3:] = 0  # a right-padded row
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0  # "prompt" tokens
    return ids, attn, loss_mask


def greedy(logits):
    """The `sample` callback of head.draft for T = 0: argmax, no probabilities."""
    return logits.argmax(-1), None


def fit(head, feats, steps: int, lr: float):
    """AdamW on one fixed batch: (losses per step, the last loss dict)."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = head.loss(feats)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    return losses, out


LOOP_PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20], [30, 31, 40]]


def fit_on_greedy_continuations(target, head, steps: int, lr: float = 2e-2, prompts=LOOP_PROMPTS,
                                new_tokens: int = 16, length: int | None = 10):
    """Train `head` on the target's own greedy continuations of `prompts` (new_tokens each; each
    sequence cut to `length` tokens, None = whole, right-padded), so drafts get accepted and the
    loop's roll-back paths run; returns the reference (plain decoding) outputs."""
    from draftkit.inference.decoder import plain_generate

    ref, _, _ = plain_generate(target, prompts, max_new_tokens=new_tokens)
    seqs = [(p + r)[:length] for p, r in zip(prompts, ref)]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs])  # (B, L)
    attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(tokens=seqs)
    fit(head, target.features(ids, attn, head.feature_layers), steps=steps, lr=lr)
    return ref


@pytest.fixture
def tiny_target():
    return make_tiny_target()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP spinning on a busy 2-core box costs 10x.

    A module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The architectures users bring besides llama, as tiny random targets. Each keeps what sets it apart
# from llama: Qwen2 attention biases, Qwen3 q/k norms, Gemma 3 sliding-window + global layers, a
# scaled embedding and its extra (1 + w) norms, Mistral a sliding window on every layer. Windows of
# 4 tokens, so that the verify loop's rolled-back holes and ragged padding fall inside them.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "mistral")
WINDOW = 4


def make_arch_target(arch: str, vocab: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0,
                     dtype=torch.float32):
    """A tiny random target of `arch` whose greedy output varies (init std 0.2, and the weights
    that start at zero or one, biases and norms, drawn at random so they matter)."""
    import transformers as tf

    from draftkit.target import Target

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=WINDOW), tf.MistralForCausalLM
    elif arch == "gemma3":
        kinds = ["sliding_attention", "sliding_attention", "full_attention"]
        cfg = tf.Gemma3TextConfig(**common, sliding_window=WINDOW, query_pre_attn_scalar=hidden // 4,
                                  layer_types=[kinds[i % 3] for i in range(layers)])
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES}")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # zeros / ones at init: make them count
                p.add_(torch.randn_like(p) * 0.2)
    return Target(model.to(dtype), None, name=f"tiny-{arch}-{seed}")


def save_vllm_target(directory, vocab_size: int = 256, tokenizer=None, eos_token_id: int = 2, pad_token_id: int = 2,
                     bos_token_id: int = 1):
    """A tiny llama vLLM's CPU attention runs (MHA, head_dim 64), saved as an HF directory (with
    `tokenizer` when given), as a Target named by that directory: the verifier its exports name.
    Init std 0.2 and norms drawn at random, so greedy output varies (not one token repeated)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftkit.target import Target

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return Target(model, tokenizer, name=str(directory))


def vllm_python() -> str:
    """The Python that runs vLLM for the engine tests: DRAFTKIT_CHECK_VLLM=0 leaves them out (skip),
    =1 (scripts/test.sh, CI) makes a missing vLLM a failure, unset skips with the reason."""
    from draftkit.engines import vllm as ev

    want = os.environ.get("DRAFTKIT_CHECK_VLLM")
    if want == "0":
        pytest.skip("DRAFTKIT_CHECK_VLLM=0: vLLM engine tests left out")
    try:
        return ev.find_python()
    except ev.EngineUnavailable as e:
        if want == "1":
            pytest.fail(f"DRAFTKIT_CHECK_VLLM=1 but {e}")
        pytest.skip(str(e))


def vllm_suffix_python() -> str:
    """The Python that serves vLLM's suffix method (arctic-inference: scripts/setup_vllm_suffix.sh), for
    its test: DRAFTKIT_CHECK_VLLM_SUFFIX=1 (scripts/test.sh's default with vLLM, so CI builds and runs it)
    makes a missing one a failure, =0 leaves it out, unset (a local run) skips with the reason."""
    from draftkit.engines import vllm as ev

    want = os.environ.get("DRAFTKIT_CHECK_VLLM_SUFFIX")
    if want == "0":
        pytest.skip("DRAFTKIT_CHECK_VLLM_SUFFIX=0: vLLM suffix test left out")
    try:
        return ev.find_suffix_python(ev.find_python())
    except ev.EngineUnavailable as e:
        if want == "1":
            pytest.fail(f"DRAFTKIT_CHECK_VLLM_SUFFIX=1 but {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def engine_python() -> str:
    """vllm_python() for the tests that serve with the real engine (skip or fail as it says)."""
    return vllm_python()


def vllm_world(root, new_tokens: int) -> dict:
    """What the engine tests serve: save_vllm_target in root / "target" (the verifier their exports
    name), 8 random prompts of 4 tokens and its greedy reference of new_tokens each (no stop id):
    {root, target, prompts, ref}; each test file adds the heads it fits."""
    from draftkit.inference.decoder import plain_generate

    target = save_vllm_target(root / "target")
    prompts = torch.randint(3, 256, (8, 4), generator=torch.Generator().manual_seed(1)).tolist()
    ref, _, _ = plain_generate(target, prompts, max_new_tokens=new_tokens, stop_ids=[])
    return {"root": root, "target": target, "prompts": prompts, "ref": ref}
