"""draftkit.distill: prompt sources, Magpie synthesis, cached regeneration, loss masks.

Runs on a tiny random Llama and the fixture ChatML tokenizer (tests/fixtures/tokenizer, rebuilt
by tests/fixtures/make_tokenizer.py); nothing here reads ../shared or a real target.
"""

import json
import logging
import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftkit.config import DataConfig
from draftkit.distill import (
    Conversation, DataContext, GenerationSettings, GroundedSettings, Prompt, grounded_prompts, PromptSource,
    SynthesisSettings, build_samples, synthesize_cached, load_prompts, magpie_prefix, prepare_samples, regenerate,
    synthesize_prompts, tokenize_conversation,
)

FIXTURES = Path(__file__).parent / "fixtures"
DATA = FIXTURES / "data"
FAST = GenerationSettings(max_new_tokens=8, temperature=0.0, batch_size=4)


def ctx(model, tokenizer, cache_dir, target_id="tiny", **kw) -> DataContext:
    """The data context of these tests: no progress bars; kw: the other DataContext fields."""
    return DataContext(model, tokenizer, cache_dir, target_id, progress=False, **kw)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random Llama that ends its turn with probability ~0.2 per token.

    A random model almost never samples `<|im_end|>` on its own (1 in 384), so the LM head gets a
    bias: +4.5 on the end-of-turn token, and `<|im_start|>` / `<|endoftext|>` suppressed.
    """
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    m = LlamaForCausalLM(cfg)
    head = torch.nn.Linear(32, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 4.5
        head.bias[tokenizer.convert_tokens_to_ids("<|im_start|>")] = -30.0
        head.bias[tokenizer.convert_tokens_to_ids("<|endoftext|>")] = -30.0
    m.lm_head = head
    return m.eval().requires_grad_(False)


@pytest.fixture
def generated_rows(model, monkeypatch):
    """Wrap model.generate; the list collects the batch size of every call."""
    rows, original = [], model.generate

    def counting_generate(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", counting_generate)
    return rows


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _user_prompts(n: int, tag: str = "p") -> list[Prompt]:
    return [Prompt([{"role": "user", "content": f"{tag} question number {i}?"}], None, f"{tag}:{i}")
            for i in range(n)]


# ----------------------------------------------------------------------------- sources

def _by_id(path: Path) -> dict[str, Prompt]:
    return {p.id: p for p in load_prompts([PromptSource(str(path))], None, seed=0)}


def test_sharegpt_keeps_context_up_to_last_user_turn():
    got = _by_id(DATA / "sharegpt.json")
    assert set(got) == {"sharegpt:sg0", "sharegpt:sg1"}  # sg2 has no user turn
    assert got["sharegpt:sg0"].messages == [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am a model."},
        {"role": "user", "content": "Have a nice day!"},
    ]
    assert got["sharegpt:sg1"].messages[0] == {"role": "system", "content": "Answer briefly."}


def test_openai_messages():
    got = _by_id(DATA / "openai.jsonl")
    assert len(got) == 3
    assert got["openai:0"].messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Write a short poem about the sea."},
    ]
    assert got["openai:2"].messages[-1] == {"role": "user", "content": "Second question?"}
    assert len(got["openai:2"].messages) == 3


def test_turns_first_turn_and_category():
    got = _by_id(DATA / "mtbench.jsonl")
    assert got["mtbench:81"].messages == [{"role": "user", "content": "Compose a travel blog post about Hawaii."}]
    assert got["mtbench:81"].category == "writing"
    assert got["mtbench:91"].category == "math"


def test_prompt_and_alpaca_shapes():
    prompts = _by_id(DATA / "prompt.jsonl")
    assert sorted(p.messages[0]["content"] for p in prompts.values()) == [  # the blank one is dropped
        "Explain how a rainbow forms.", "Translate German to English: Guten Morgen."]
    alpaca = _by_id(DATA / "alpaca.json")
    assert alpaca["alpaca:0"].messages == [{"role": "user", "content": "Translate to English.\n\nGuten Morgen"}]
    assert alpaca["alpaca:1"].messages == [{"role": "user", "content": "Name a colour of the sky."}]


def test_save_to_disk_directory(tmp_path):
    records = [{"prompt": "alpha?"}, {"prompt": "beta?"}]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(records[:1])}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_prompts([PromptSource(str(tmp_path / "flat"))], None, 0)) == 2
    got = load_prompts([PromptSource(str(tmp_path / "dict"), split="test")], None, 0)
    assert [p.messages[0]["content"] for p in got] == ["alpha?"]


def test_unknown_shape_names_file_and_keys():
    with pytest.raises(ValueError, match=r"unknown\.jsonl.*'answer', 'question'"):
        load_prompts([PromptSource(str(DATA / "unknown.jsonl"))], None, 0)


def test_empty_after_filtering_names_sources(tmp_path):
    blank = _write_jsonl(tmp_path / "blank.jsonl", [{"prompt": " "}, {"prompt": ""}])
    with pytest.raises(ValueError, match="blank.jsonl"):
        load_prompts([PromptSource(str(blank))], 10, 0)


def test_weights_mix_deterministically(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(50)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(50)])
    srcs = [PromptSource(str(a), weight=3.0), PromptSource(str(b), weight=1.0)]
    got = load_prompts(srcs, 20, seed=1)
    assert sum(p.id.startswith("a:") for p in got) == 15 and len(got) == 20
    assert [p.id for p in got] == [p.id for p in load_prompts(srcs, 20, seed=1)]
    assert [p.id for p in got] != [p.id for p in load_prompts(srcs, 20, seed=2)]
    # a source short of its quota gives everything; the other fills the gap
    short = _write_jsonl(tmp_path / "short.jsonl", [{"prompt": f"s{i}"} for i in range(3)])
    got = load_prompts([PromptSource(str(short)), PromptSource(str(b))], 20, seed=0)
    assert sum(p.id.startswith("short:") for p in got) == 3 and len(got) == 20


# ----------------------------------------------------------------------------- synthesis

def test_magpie_prefix(tokenizer):
    assert magpie_prefix(tokenizer) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")


def test_synthesize_prompts(model, tokenizer, generated_rows):
    settings = SynthesisSettings(batch_size=8, max_new_tokens=12, min_chars=1)
    got = synthesize_prompts(model, tokenizer, 4, settings, seed=0, progress=False)
    assert 1 <= len(got) <= 4 and generated_rows
    texts = [p.messages[0]["content"] for p in got]
    assert len(set(texts)) == len(texts)
    assert all(p.messages[0]["role"] == "user" and len(p.messages) == 1 and t.strip() for p, t in zip(got, texts))
    again = synthesize_prompts(model, tokenizer, 4, settings, seed=0, progress=False)
    assert [p.id for p in again] == [p.id for p in got]


def test_synthesize_gives_up_after_max_attempts(model, tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        hopeless = SynthesisSettings(batch_size=4, max_new_tokens=4, min_chars=10_000)
        got = synthesize_prompts(model, tokenizer, 3, hopeless, max_attempts=8, progress=False)
    assert got == [] and "only 0 of 3" in caplog.text


# ----------------------------------------------------------------------------- regeneration

def test_regenerate_then_cache_hit(model, tokenizer, tmp_path, generated_rows):
    prompts = _user_prompts(6)
    first = regenerate(ctx(model, tokenizer, tmp_path), prompts, FAST)
    assert sum(generated_rows) == 6 and len(first) == 6
    assert all(c.num_tokens <= FAST.max_new_tokens for c in first)
    assert all(c.num_tokens == FAST.max_new_tokens for c in first if c.truncated)
    generated_rows.clear()
    again = regenerate(ctx(model, tokenizer, tmp_path), prompts, FAST)
    assert generated_rows == []  # served from the cache
    assert again == first
    # a different target or different settings is a different key
    regenerate(ctx(model, tokenizer, tmp_path, "other"), prompts[:2], FAST)
    assert sum(generated_rows) == 2


def test_interrupted_run_continues(model, tokenizer, tmp_path, generated_rows):
    prompts = _user_prompts(7)
    done = regenerate(ctx(model, tokenizer, tmp_path), prompts[:3], FAST)
    generated_rows.clear()
    (next(tmp_path.rglob("*.jsonl")).parent / ".junk.123.tmp").write_text("{half a rec")  # killed mid-write
    full = regenerate(ctx(model, tokenizer, tmp_path), prompts, FAST)
    assert sum(generated_rows) == 4
    assert full[:3] == done and [c.prompt.id for c in full] == [p.id for p in prompts]


def test_ranks_split_work_and_share_results(model, tokenizer, tmp_path, generated_rows):
    prompts = _user_prompts(6)
    # Simulate two ranks in one process: rank 0's barrier runs rank 1 to completion.
    rank1 = []
    second = ctx(model, tokenizer, tmp_path, rank=1, world_size=2, barrier=lambda: None)
    first = ctx(model, tokenizer, tmp_path, rank=0, world_size=2,
                barrier=lambda: rank1.append(regenerate(second, prompts, FAST)))
    out0 = regenerate(first, prompts, FAST)
    assert sum(generated_rows) == 6 and len(generated_rows) == 2  # 3 prompts per rank
    assert out0 == rank1[0] and len(out0) == 6
    with pytest.raises(ValueError, match="barrier"):
        regenerate(ctx(model, tokenizer, tmp_path, rank=0, world_size=2), _user_prompts(2, "q"), FAST)


def test_truncated_responses_are_flagged(model, tokenizer, tmp_path):
    never_ends = GenerationSettings(max_new_tokens=3, batch_size=2)
    with torch.no_grad():
        model.lm_head.bias[tokenizer.eos_token_id] = -30.0
        try:
            convs = regenerate(ctx(model, tokenizer, tmp_path), _user_prompts(2), never_ends)
        finally:
            model.lm_head.bias[tokenizer.eos_token_id] = 4.5
    assert all(c.truncated and c.num_tokens == 3 for c in convs)


# ----------------------------------------------------------------------------- samples

def _conv(messages, response, truncated=False):
    return Conversation(Prompt(messages, None, "x"), response, truncated, 0)


def _masked_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer):
    context = [{"role": "user", "content": "Who are you?"},
               {"role": "assistant", "content": "A dataset reply."},
               {"role": "user", "content": "What is the capital of France?"}]
    sample = tokenize_conversation(tokenizer, _conv(context, "The capital of France is Paris."))
    mask = sample["loss_mask"]
    assert _masked_text(tokenizer, sample) == "The capital of France is Paris.<|im_end|>"
    ones = [i for i, m in enumerate(mask) if m]
    assert ones == list(range(ones[0], ones[-1] + 1))  # one contiguous span
    assert tokenizer.decode(sample["input_ids"][ones[-1] + 1:]) == "\n"  # template tail stays out
    assert tokenizer.decode(sample["input_ids"][: ones[0]]).endswith("<|im_start|>assistant\n")
    # a truncated response never produced the end-of-turn token: it is not trained on
    cut = tokenize_conversation(tokenizer, _conv(context, "The capital", truncated=True))
    assert _masked_text(tokenizer, cut) == "The capital"


def test_template_that_is_not_a_prefix_is_dropped(tokenizer):
    odd = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    odd.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] + "
                         "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
                         "{{ '<|im_start|>assistant\n' }}{% endif %}")
    samples, stats = build_samples(odd, [_conv([{"role": "user", "content": "hi"}], "yo")], 64)
    assert samples == [] and stats["dropped_template"] == 1


def test_truncate_vs_drop(tokenizer):
    user = [{"role": "user", "content": "Write a short poem about the sea."}]
    convs = [_conv(user, "The sea."), _conv(user, "The sea is wide and blue and deep. " * 4)]
    short_len = len(tokenize_conversation(tokenizer, convs[0])["input_ids"])
    samples, stats = build_samples(tokenizer, convs, short_len, "truncate")
    assert stats["kept"] == 2 and stats["truncated"] == 1 and stats["dropped_overlong"] == 0
    assert all(len(s["input_ids"]) <= short_len for s in samples)
    assert stats["tokens"] == 2 * short_len
    assert stats["assistant_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    samples, stats = build_samples(tokenizer, convs, short_len, "drop")
    assert stats["kept"] == 1 and stats["dropped_overlong"] == 1
    # truncated inside the prompt: no assistant token left, so dropped
    prompt_len = short_len - sum(tokenize_conversation(tokenizer, convs[0])["loss_mask"]) - 1
    samples, stats = build_samples(tokenizer, convs, prompt_len, "truncate")
    assert samples == [] and stats["dropped_no_assistant"] == 2
    with pytest.raises(ValueError):
        build_samples(tokenizer, convs, 10, "wrap")


# ----------------------------------------------------------------------------- prepare_samples

def test_prepare_samples_is_sized_to_the_run(model, tokenizer, tmp_path, generated_rows):
    sources = [PromptSource(str(DATA / "openai.jsonl")), PromptSource(str(DATA / "prompt.jsonl")),
               PromptSource(str(DATA / "mtbench.jsonl"))]
    data = DataConfig(sources=sources, holdout=2, max_length=128, responses=FAST)
    samples, holdout, stats = prepare_samples(ctx(model, tokenizer, tmp_path, data=data), num_samples=3)
    assert sum(generated_rows) == 3  # only the training prompts are answered
    assert len(holdout) == 2 and stats["prompts"] == 5 and stats["holdout"] == 2
    assert len(samples) == stats["kept"] <= 3
    held = {tokenizer.apply_chat_template(p.messages, tokenize=False) for p in holdout}
    for s in samples:
        assert not any(tokenizer.decode(s["input_ids"]).startswith(h) for h in held)


def test_grounded_prompts_use_each_long_response_once_as_the_passage():
    user = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    convs = [_conv(user("What do cats eat?"), "Cats eat meat, mostly fish and mice. " * 8),
             _conv(user("Name a river."), "The Nile."),  # too short to be a passage
             _conv(user("Why is the sky blue?"), "Rayleigh scattering of sunlight. " * 8)]
    settings = GroundedSettings(fraction=0.5, tasks=["summarize", "answer"], min_chars=100)
    prompts = grounded_prompts(convs, 2, settings, seed=3)
    assert prompts == grounded_prompts(convs, 2, settings, seed=3)  # deterministic
    texts = [p.messages[0]["content"] for p in prompts]
    used = sorted(c.response.strip() for c in (convs[0], convs[2]))
    assert sorted(next(u for u in used if u in t) for t in texts) == used  # each passage once
    for p, t in zip(prompts, texts):
        task = p.category.removeprefix("grounded-")
        assert task in ("summarize", "answer") and p.id.startswith(f"grounded:{task}:")
        if task == "answer":  # the question the passage answered comes with it
            assert "What do cats eat?" in t or "Why is the sky blue?" in t
    assert len(grounded_prompts(convs, 5, settings)) == 5  # passages are reused past the first round
    with pytest.raises(ValueError, match="at least 1000 characters"):
        grounded_prompts(convs, 1, GroundedSettings(fraction=0.5, min_chars=1000))


def test_grounded_settings_name_the_field():
    with pytest.raises(ValueError, match=r"data\.grounded\.fraction"):
        GroundedSettings(fraction=1.0)
    with pytest.raises(ValueError, match=r"data\.grounded\.tasks.*'poem'"):
        GroundedSettings(tasks=["summarize", "poem"])


def test_prepare_samples_adds_grounded_tasks_over_its_own_answers(model, tokenizer, tmp_path, generated_rows):
    sources = [PromptSource(str(DATA / "openai.jsonl")), PromptSource(str(DATA / "prompt.jsonl")),
               PromptSource(str(DATA / "mtbench.jsonl"))]
    gen = GenerationSettings(max_new_tokens=24, temperature=1.0, batch_size=8)  # greedy ends at once
    grounded = GroundedSettings(fraction=0.5, tasks=["rewrite"], min_chars=1)
    data = DataConfig(sources=sources, holdout=1, max_length=256, responses=gen, grounded=grounded)
    samples, holdout, stats = prepare_samples(ctx(model, tokenizer, tmp_path, data=data), num_samples=4)
    assert stats["grounded"] == 2 and stats["prompts"] == 5 and len(samples) == stats["kept"]
    assert sum(generated_rows) == 4  # two plain prompts answered, then two tasks over those answers
    rendered = [tokenizer.decode(s["input_ids"]) for s in samples]
    tasks = [r for r in rendered if "Rewrite the following text" in r]
    assert len(tasks) == 2
    held = {tokenizer.apply_chat_template(p.messages, tokenize=False) for p in holdout}
    plain = [r for r in rendered if r not in tasks]
    assert not any(r.startswith(h) for r in rendered for h in held)
    # each task's passage is the response the target gave to one of the plain prompts
    answers = [_masked_text(tokenizer, s).removesuffix("<|im_end|>").strip() for s, r in zip(samples, rendered)
               if r in plain]
    assert all(any(a in t for a in answers if a) for t in tasks)


def test_prepare_samples_synthesizes_without_sources(model, tokenizer, tmp_path, generated_rows):
    synth = SynthesisSettings(batch_size=8, max_new_tokens=12, min_chars=1)
    data = DataConfig(sources=[], holdout=1, max_length=128, responses=FAST, synthesize=synth)
    samples, holdout, stats = prepare_samples(ctx(model, tokenizer, tmp_path, data=data), num_samples=2)
    assert stats["source"] == "synthesized" and len(holdout) == 1 and len(samples) == 2
    generated_rows.clear()
    again = prepare_samples(ctx(model, tokenizer, tmp_path, data=data), num_samples=2)
    assert generated_rows == [] and again[0] == samples  # prompts and responses both cached
    assert math.isfinite(stats["response_tokens"])


def test_interrupted_synthesis_continues_from_finished_batches(model, tokenizer, tmp_path, generated_rows):
    settings = SynthesisSettings(batch_size=4, max_new_tokens=12)
    run = ctx(model, tokenizer, tmp_path, "t", seed=1)
    first = synthesize_cached(run, 3, settings)
    calls = len(generated_rows)
    assert calls > 0
    # A larger n (as after a kill, or a bigger run) reuses every sampled batch and only samples more.
    more = synthesize_cached(run, 6, settings)
    assert more[:len(first)] == first and len(more) > len(first)
    assert len(generated_rows) > calls
    done = len(generated_rows)
    for p in tmp_path.glob("prompts-*.jsonl"):  # the finished lists are gone, the batches are not
        p.unlink()
    assert synthesize_cached(run, 6, settings) == more
    assert len(generated_rows) == done


# ----------------------------------------------------------------------------- data.loss_on

def _marked(tokenizer, sample) -> list[str]:
    """The supervised spans of a sample, each decoded (contiguous runs of loss_mask == 1)."""
    runs, cur = [], []
    for t, m in zip(sample["input_ids"], sample["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs + ([tokenizer.decode(cur)] if cur else [])


def test_loss_on_marks_exactly_response_target_text_or_all(tokenizer):
    passage = "Cats eat meat, mostly fish and mice."
    task = f"Summarize the following text in two or three sentences.\n\n{passage}"
    prompt = Prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": task}],
                    "grounded-summarize", "g", target_text=(passage,))
    conv = Conversation(prompt, "Cats are carnivores.", False, 0)
    resp = tokenize_conversation(tokenizer, conv, "response")
    own = tokenize_conversation(tokenizer, conv, "target_text")
    every = tokenize_conversation(tokenizer, conv, "all")
    assert resp["input_ids"] == own["input_ids"] == every["input_ids"]
    assert _marked(tokenizer, resp) == ["Cats are carnivores.<|im_end|>"]
    assert _marked(tokenizer, own) == [passage, "Cats are carnivores.<|im_end|>"]
    tail = every["input_ids"].index(tokenizer.eos_token_id, len(every["input_ids"]) - 3)  # the response's eot
    assert every["loss_mask"] == [1] * (tail + 1) + [0] * (len(every["input_ids"]) - tail - 1)
    assert tokenizer.decode(every["input_ids"][tail + 1:]) == "\n"  # the template tail: never in the loss
    # a prompt without target text: target_text is response only; earlier dataset replies are not target text
    context = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "A dataset reply."},
               {"role": "user", "content": "And now?"}]
    plain = Conversation(Prompt(context, None, "p"), "Now this.", False, 0)
    assert _marked(tokenizer, tokenize_conversation(tokenizer, plain, "target_text")) == ["Now this.<|im_end|>"]
    assert "A dataset reply." in _marked(tokenizer, tokenize_conversation(tokenizer, plain, "all"))[0]
    # a truncated response: its artificial end-of-turn token stays out under every choice
    cut = Conversation(prompt, "Cats are", True, 0)
    for loss_on in ("response", "target_text", "all"):
        assert _marked(tokenizer, tokenize_conversation(tokenizer, cut, loss_on))[-1].endswith("Cats are")


def test_build_samples_counts_loss_tokens_and_rejects_unknown_loss_on(tokenizer):
    passage = "The river floods every spring and the farmers plant after it."
    prompt = Prompt([{"role": "user", "content": f"Rewrite this.\n\n{passage}"}], None, "g", target_text=(passage,))
    conv = Conversation(prompt, "The river floods yearly.", False, 0)
    n_passage = len(tokenizer(passage, add_special_tokens=False)["input_ids"])
    by = {lo: build_samples(tokenizer, [conv], 256, loss_on=lo)[1] for lo in ("response", "target_text", "all")}
    assert by["response"]["loss_tokens"] == by["response"]["assistant_tokens"] == by["all"]["assistant_tokens"]
    assert by["target_text"]["loss_tokens"] == by["response"]["loss_tokens"] + n_passage
    assert by["all"]["loss_tokens"] == by["all"]["tokens"] - 1  # all but the template's trailing newline
    # cut inside the prompt: no response token left, dropped whatever loss_on says
    samples, stats = build_samples(tokenizer, [conv], 8, loss_on="all")
    assert samples == [] and stats["dropped_no_assistant"] == 1
    with pytest.raises(ValueError, match=r"data.loss_on: 'prompt' is not one of"):
        build_samples(tokenizer, [conv], 64, loss_on="prompt")


def test_grounded_prompts_name_their_passage_as_target_text():
    convs = [_conv([{"role": "user", "content": "What do cats eat?"}], "  Cats eat meat, mostly fish. " * 8)]
    (p,) = grounded_prompts(convs, 1, GroundedSettings(fraction=0.5, min_chars=10), seed=0)
    assert p.target_text == (convs[0].response.strip(),) and p.target_text[0] in p.messages[0]["content"]


# ----------------------------------------------------------------------------- data.responses.mode: keep

def test_keep_trains_on_the_sources_own_replies_without_generating(model, tokenizer, tmp_path, generated_rows):
    sharegpt = tmp_path / "chat.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Name a red fruit."},
                                      {"from": "gpt", "value": "A strawberry."}]},
        {"id": "b", "conversations": [{"from": "system", "value": "Be terse."},
                                      {"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."},
                                      {"from": "human", "value": "Sky colour?"}, {"from": "gpt", "value": "Blue."}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Unanswered question?"}]}]))
    openai = _write_jsonl(tmp_path / "msgs.jsonl", [
        {"id": "d", "messages": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]},
        {"id": "e", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": ""}]}])
    sources = [PromptSource(str(sharegpt)), PromptSource(str(openai))]
    keep = GenerationSettings(max_new_tokens=8, batch_size=4, mode="keep")
    data = DataConfig(sources=sources, holdout=0, max_length=256, responses=keep)
    samples, holdout, stats = prepare_samples(ctx(model, tokenizer, tmp_path / "cache", data=data), num_samples=5)
    assert generated_rows == [] and not (tmp_path / "cache").exists()  # no generation, nothing cached
    got = sorted(_masked_text(tokenizer, s) for s in samples)
    assert got == ["A strawberry.<|im_end|>", "Blue.<|im_end|>", "Four.<|im_end|>"]  # c, e: no reply, skipped
    multi = next(s for s in samples if "Blue." in _masked_text(tokenizer, s))
    assert "Hello." in tokenizer.decode(multi["input_ids"])  # the earlier reply stays as context, unmasked
    assert stats["response_tokens"] == sum(sum(s["loss_mask"]) for s in samples)


def test_keep_refuses_sources_without_replies_synthesis_and_grounded(model, tokenizer, tmp_path):
    def keep(**data):
        run = ctx(model, tokenizer, tmp_path, data=DataConfig(holdout=0, max_length=64,
                                                              responses=GenerationSettings(mode="keep"), **data))
        return prepare_samples(run, num_samples=2)

    with pytest.raises(ValueError, match=r"keep needs sources whose records carry a reply.*prompt:"):
        keep(sources=[PromptSource(str(DATA / "prompt.jsonl"))])
    with pytest.raises(ValueError, match=r"data.sources is empty"):
        keep(sources=[])
    with pytest.raises(ValueError, match=r"data.grounded.fraction"):
        keep(sources=[PromptSource(str(DATA / "sharegpt.json"))], grounded=GroundedSettings(fraction=0.5))
    # the mode never changes the regeneration cache key: regenerated responses are shared
    assert GenerationSettings(mode="keep").fingerprint("t") == GenerationSettings().fingerprint("t")


def test_grounded_tasks_join_several_passages_and_mark_each_as_target_text(tokenizer):
    answers = [f"Answer {i}: the {w} is in the {v}." for i, (w, v) in
               enumerate([("cat", "garden"), ("key", "drawer"), ("car", "street"), ("book", "shelf")])]
    convs = [_conv([{"role": "user", "content": f"Where is it {i}?"}], a) for i, a in enumerate(answers)]
    settings = GroundedSettings(fraction=0.5, tasks=["answer"], min_chars=10, passages=3)
    prompts = grounded_prompts(convs, 2, settings, seed=1)
    for p in prompts:
        assert len(p.target_text) == 3 and len(set(p.target_text)) == 3
        assert "\n\n".join(p.target_text) in p.messages[0]["content"]
        assert any(f"Where is it {answers.index(t)}?" in p.messages[0]["content"] for t in p.target_text)
    assert {t for p in prompts for t in p.target_text} == set(answers)  # 6 picks: every answer before a repeat
    sample = tokenize_conversation(tokenizer, Conversation(prompts[0], "In the garden.", False, 0), "target_text")
    assert _marked(tokenizer, sample) == [*prompts[0].target_text, "In the garden.<|im_end|>"]
    with pytest.raises(ValueError, match=r"data\.grounded\.passages"):
        GroundedSettings(passages=0)


# ----------------------------------------------------------------------------- data.responses.scheduler: refill

@pytest.fixture(scope="module")
def varied_model(tokenizer):
    """A tiny random Llama whose greedy responses end after 2..10 tokens depending on the prompt
    (larger init than `model`, whose greedy rows all end alike, and a +2 end-of-turn bias)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.3, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    m = LlamaForCausalLM(cfg)
    head = torch.nn.Linear(32, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 2.0
        for special in ("<|im_start|>", "<|endoftext|>"):
            head.bias[tokenizer.convert_tokens_to_ids(special)] = -30.0
    m.lm_head = head
    return m.eval().requires_grad_(False)


def _chat(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"question {'x' * i} number {i}?"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


@pytest.mark.parametrize("attention", ["sdpa", "gqa"])
def test_refill_gives_every_prompt_its_own_greedy_tokens_with_fewer_row_steps(varied_model, tokenizer, attention):
    from draftkit.attention import register
    from draftkit.distill.refill import generate_refill
    from draftkit.distill.regenerate import generate_batch

    varied_model.set_attn_implementation(register() if attention == "gqa" else "sdpa")  # gqa: what targets load

    prompts = _chat(tokenizer, 9)
    settings = GenerationSettings(max_new_tokens=10, batch_size=3, scheduler="refill")
    alone = [generate_batch(varied_model, tokenizer, [p], settings)[0] for p in prompts]
    assert len({a["num_tokens"] for a in alone}) >= 4 and any(a["truncated"] for a in alone)  # varied
    rows = []
    hook = varied_model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: rows.append(out.shape[:2]))
    try:
        got = list(generate_refill(varied_model, tokenizer, prompts, settings))
        refill_rows = sum(b for b, t in rows if t == 1)  # decode steps x rows
        rows.clear()
        for i in range(0, 9, 3):
            generate_batch(varied_model, tokenizer, prompts[i: i + 3], settings)
        static_rows = sum(b for b, t in rows if t == 1)
    finally:
        hook.remove()
    assert sorted(i for i, _ in got) == list(range(9))
    assert {i: r for i, r in got} == dict(enumerate(alone))  # exact tokens, truncation flags, lengths
    assert refill_rows == sum(a["num_tokens"] - 1 for a in alone)  # no step spent on a finished row
    assert refill_rows < static_rows
    # nucleus sampling with a vanishing top_p keeps only the argmax: the sampling path gives greedy's tokens
    nucleus = GenerationSettings(max_new_tokens=10, batch_size=4, temperature=1.0, top_p=1e-9, scheduler="refill")
    assert dict(generate_refill(varied_model, tokenizer, prompts, nucleus)) == dict(enumerate(alone))
    hot = GenerationSettings(max_new_tokens=6, batch_size=4, temperature=1.5, seed=3, scheduler="refill")
    first = dict(generate_refill(varied_model, tokenizer, prompts, hot))
    assert first == dict(generate_refill(varied_model, tokenizer, prompts, hot))  # seeded
    assert first != dict(enumerate(alone))


def test_regenerate_with_refill_caches_the_same_greedy_responses(varied_model, tokenizer, tmp_path):
    prompts = _user_prompts(7)
    batch = GenerationSettings(max_new_tokens=10, batch_size=3)
    refill = GenerationSettings(max_new_tokens=10, batch_size=3, scheduler="refill")
    a = regenerate(ctx(varied_model, tokenizer, tmp_path / "a", "t"), prompts, batch)
    b = regenerate(ctx(varied_model, tokenizer, tmp_path / "b", "t"), prompts, refill)
    assert a == b and len({c.num_tokens for c in a}) > 1
    assert refill.fingerprint("t") == batch.fingerprint("t")  # one cache for both schedulers


def test_repeated_prompts_are_answered_and_trained_once(model, tokenizer, tmp_path, generated_rows):
    from draftkit.distill.samples import prepare_conversations

    src = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Tell me a story."}, {"prompt": "Tell me a story."},
                                              {"prompt": "Held aside?"}])
    gen = GenerationSettings(max_new_tokens=12, temperature=1.0, batch_size=8)
    # one passage and one task: the three grounded tasks asked for are the same prompt
    grounded = GroundedSettings(fraction=0.75, tasks=["summarize"], min_chars=1)
    data = DataConfig(sources=[PromptSource(str(src))], holdout=1, responses=gen, grounded=grounded)
    convs, holdout, stats = prepare_conversations(ctx(model, tokenizer, tmp_path / "c", data=data, seed=0), 4)
    keys = [c.prompt.key() for c in convs]
    assert len(keys) == len(set(keys)) == 2 and sum(generated_rows) == 2  # the story and one summary
    assert holdout[0].key() not in keys and stats["grounded"] == 3
