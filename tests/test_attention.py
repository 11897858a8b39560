"""draftkit.attention: the CPU GQA attention gives transformers' sdpa logits exactly, without KV copies."""
import pytest
import torch

from draftkit.attention import NAME, use_gqa_attention
from tests.conftest import make_tiny_target


def _padded_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as regeneration and the verify loop's ragged rows have
    mask[2, :7] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_equals_sdpa_on_padded_prefill_and_cached_steps(dtype):
    target = make_tiny_target(heads=4, kv_heads=2, dtype=dtype)
    model = target.model.eval()
    ids, mask = _padded_batch(target.vocab_size)
    step = torch.tensor([[5, 6], [7, 8], [9, 10]])

    def run():
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            m2 = torch.cat([mask, torch.ones_like(step)], 1)  # a 2-token verify-style step on the cache
            nxt = model(input_ids=step, attention_mask=m2, past_key_values=out.past_key_values, use_cache=True)
        real = mask.bool()
        return out.logits[real], nxt.logits

    model.set_attn_implementation("sdpa")
    ref = run()
    assert use_gqa_attention(model) and model.config._attn_implementation == NAME
    got = run()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_switch_only_where_it_applies():
    mha = make_tiny_target(heads=4, kv_heads=4).model  # no grouped heads: nothing to save
    mha.set_attn_implementation("sdpa")
    assert not use_gqa_attention(mha) and mha.config._attn_implementation == "sdpa"
    eager = make_tiny_target().model
    eager.set_attn_implementation("eager")  # the user's choice of another implementation stays
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"


def test_load_target_uses_it_on_cpu(tmp_path):
    from transformers import AutoTokenizer

    from draftkit.target import load_target
    from tests.test_distill import FIXTURES

    src = make_tiny_target(heads=4, kv_heads=2).model
    src.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(FIXTURES / "tokenizer").save_pretrained(tmp_path)
    assert load_target(str(tmp_path), dtype="float32").model.config._attn_implementation == NAME
