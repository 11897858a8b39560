"""The back_translate grounded task (issue 20): Spec-Bench's translation prompts are German -> English,
so the target's own German translation of one of its answers becomes the passage of a
"Translate German to English: ..." prompt, which the target answers like every other task.

A fake target (a function of the prompt) where the generation does not matter; test_distill's tiny
random Llama for the run through prepare_conversations; nothing here reads ../shared or a real target.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter

import pytest
import torch

from draftkit.config import DEFAULT_GROUNDED_TASKS, GROUNDED_TASKS, DataConfig, GenerationSettings, GroundedSettings
from draftkit.config import PromptSource
from draftkit.config import load_recipe
from draftkit.distill import Conversation, Prompt, grounded_prompts, regenerate
from draftkit.distill.grounded import REDRAW_ROUNDS
from draftkit.distill.regenerate import prompt_ids, read_cached
from draftkit.distill.samples import prepare_conversations
from draftkit.schema import ConfigError
from tests.test_distill import ctx, generated_rows, model, tokenizer  # noqa: F401  (fixtures)
from tests.test_mix import ROOT, SAMPLED, share_file

pytestmark = pytest.mark.usefixtures("one_thread")


def answers(n: int) -> list[Conversation]:
    """n plain conversations whose English answers are long enough to be passages."""
    return [Conversation(Prompt([{"role": "user", "content": f"Question {i}?"}], None, f"q:{i}"),
                         f"Answer number {i} says something long enough. " * 6, False, 5) for i in range(n)]


class FakeTarget:
    """Answers each prompt with a text made from it (padded with spaces, which the passage drops);
    records every call's prompts. `cut(text)`: whether that answer hit max_new_tokens (truncated)."""

    def __init__(self, reply=lambda text: f"Deutsch: {text[::-1]}", cut=lambda text: False):
        self.calls, self.reply, self.cut = [], reply, cut

    def __call__(self, prompts: list[Prompt]) -> list[Conversation]:
        self.calls.append(prompts)
        return [Conversation(p, f"  {self.reply(p.messages[0]['content'])} \n", self.cut(p.messages[0]["content"]), 7)
                for p in prompts]


def german_of(target: FakeTarget, first: Prompt) -> str:
    return target.reply(first.messages[0]["content"])


def test_the_second_pass_asks_for_english_from_exactly_the_first_pass_german():
    """Each back_translate prompt is Spec-Bench's wording around the target's German for that task,
    stripped, and names it as target text; the first pass (one call) is the translate task into German
    over one of the target's answers; the English answer is nowhere in the prompt trained on."""
    convs, target = answers(6), FakeTarget()
    settings = GroundedSettings(fraction=0.5, tasks=["back_translate"], min_chars=10)
    out = grounded_prompts(convs, 4, settings, seed=1, answer=target)
    (firsts,) = target.calls
    english = {c.response.strip() for c in convs}
    assert len(firsts) == len(out) == 4
    for first, task in zip(firsts, out):
        (source,) = first.target_text
        assert source in english
        assert first.messages == [{"role": "user", "content": f"Translate the following text into German.\n\n{source}"}]
        german = target.reply(first.messages[0]["content"])
        assert task.messages == [{"role": "user", "content": f"Translate German to English: {german}"}]
        assert task.target_text == (german,) and task.category == "grounded-back_translate"
        assert task.id.startswith("grounded:back_translate:") and source not in task.messages[0]["content"]
    assert out == grounded_prompts(convs, 4, settings, seed=1, answer=FakeTarget())  # deterministic


def test_back_translate_translates_opening_sentences_as_spec_bench_asks_one():
    """Spec-Bench's translation prompts are one German sentence (30-400 characters): the first pass
    translates the opening sentences of a long answer that fit in BACK_CHARS (a prefix ending at a
    sentence end), not the whole answer, whose German ran past max_new_tokens in 5 of 5 first passes."""
    from draftkit.distill.grounded import BACK_CHARS, excerpt

    long = [Conversation(Prompt([{"role": "user", "content": f"Question {i}?"}], None, f"q:{i}"),
                         f"Sentence one of answer {i} is here. " + "Then it goes on at length, clause after clause. " * 20,
                         False, 5) for i in range(4)]
    target = FakeTarget(reply=lambda text: text.split("\n\n", 1)[1][::-1])  # German as long as its English
    out = grounded_prompts(long, 3, GroundedSettings(fraction=0.5, tasks=["back_translate"]), seed=0, answer=target)
    (firsts,) = target.calls
    assert len(out) == len(firsts) == 3
    for first in firsts:
        (source,) = first.target_text
        whole = next(c.response.strip() for c in long if c.response.strip().startswith(source))
        assert len(whole) > BACK_CHARS >= len(source) > BACK_CHARS - 60 and source.endswith(".")
        assert first.messages[0]["content"].endswith(f"German.\n\n{source}")
        assert source == excerpt(whole)
    assert excerpt("One. Two three.") == "One. Two three."  # short: whole
    assert excerpt("word " * 100, 50) == ("word " * 10).strip()  # one long sentence: whole words up to the limit


def test_back_translate_takes_its_share_of_the_grounded_tasks():
    """Drawn uniformly like every kind: eagle-mix's six kinds at ~1/6 each (within 4 sigma of the
    binomial), back_translate's first passes asked in one call, one per task."""
    tasks = load_recipe(ROOT / "recipes" / "eagle-mix.yaml").data.grounded.tasks
    assert sorted(tasks) == sorted(GROUNDED_TASKS) and "back_translate" in tasks
    target, n = FakeTarget(), 600
    out = grounded_prompts(answers(40), n, GroundedSettings(fraction=0.4, tasks=tasks), seed=0, answer=target)
    counts = Counter(p.category.removeprefix("grounded-") for p in out)
    sigma = (n * (1 / 6) * (5 / 6)) ** 0.5
    assert len(out) == n and set(counts) == set(tasks)
    assert all(abs(c - n / 6) <= 4 * sigma for c in counts.values()), counts
    assert [len(c) for c in target.calls] == [counts["back_translate"]]


def test_prepare_trains_on_the_second_pass_over_the_targets_own_first_pass(model, tokenizer, tmp_path,
                                                                            generated_rows):
    """Through prepare_conversations on the tiny Llama: 4 plain prompts answered, 2 first passes into
    German (not trained on), 2 back_translate tasks over those German answers as the response cache
    holds them (not over the English answers), answered in turn."""
    data = DataConfig(sources=[PromptSource(str(share_file(tmp_path)))], responses=SAMPLED, holdout=1,
                      grounded=GroundedSettings(fraction=1 / 3, tasks=["back_translate"], min_chars=1))
    run = ctx(model, tokenizer, tmp_path / "cache", data=data, seed=0)
    convs, _, stats = prepare_conversations(run, 6)
    assert stats["mixture"] == {"sources": 4, "synthesized": 0, "grounded": 2} and generated_rows == [4, 2, 2]
    english = [c.response.strip() for c in convs if not c.prompt.id.startswith("grounded:")]
    firsts = [Prompt([{"role": "user", "content": GROUNDED_TASKS["translate"].format(passage=e, language="German")}],
                     None, "first") for e in english]
    generated_rows.clear()
    german = {c.response.strip() for c in regenerate(run, firsts, SAMPLED)}  # the 2 asked, read back from the cache
    assert generated_rows == [2]  # the other 2 sources were not asked for a first pass
    tasks = [c for c in convs if c.prompt.id.startswith("grounded:")]
    assert len(tasks) == 2 and not any("into German" in c.prompt.messages[0]["content"] for c in convs)
    for c in tasks:
        (passage,) = c.prompt.target_text
        assert passage in german and passage not in english
        assert c.prompt.messages[0]["content"] == f"Translate German to English: {passage}"


class Shell:  # what the prepared data's key reads of a target
    name, fingerprint, dtype, config = "tiny", "f", torch.float32, None
    tokenizer = None


def test_recipes_that_do_not_ask_for_it_keep_their_keys_and_prompts():
    """The default kinds are the five there were; recipe hashes, prepared-data keys and grounded
    prompt ids as main had them at d5e1861 (before back_translate); eagle-mix, which asks for it,
    differs from its old hash by that one field."""
    from draftkit.distill.prepare import _fingerprint_payload, _hash

    assert GroundedSettings().tasks == list(DEFAULT_GROUNDED_TASKS) and "back_translate" not in DEFAULT_GROUNDED_TASKS
    old = {"eagle": ("f78a2fc847ab2f46", "172980419dd030ef59c4e511"),
           "eagle3": ("6e62933c982c8b1a", "972fcf0be1a8f55c8e4a2ad5")}
    for name, (recipe_hash, data_key) in old.items():
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", ["data.responses.engine=hf"])
        assert (recipe.fingerprint(), _hash(_fingerprint_payload(recipe, Shell, 10))) == (recipe_hash, data_key)
    for passages, ids in ((1, "86fa5b8eff5ac1fc"), (3, "be5a74b6509e06db")):  # ids hash each prompt's text
        prompts = grounded_prompts(answers(12), 30, GroundedSettings(fraction=0.5, passages=passages), seed=7)
        assert hashlib.sha256("".join(p.id for p in prompts).encode()).hexdigest()[:16] == ids
    mix = load_recipe(ROOT / "recipes" / "eagle-mix.yaml", ["data.responses.engine=hf"])
    five = load_recipe(ROOT / "recipes" / "eagle-mix.yaml", ["data.responses.engine=hf",
                                                             f"data.grounded.tasks={list(DEFAULT_GROUNDED_TASKS)}"])
    assert five.fingerprint() == "fd8e71b870a40714" != mix.fingerprint()


def test_bad_back_translate_settings_name_the_field(caplog):
    """A misspelt kind names data.grounded.tasks and the kinds there are; a caller that cannot answer
    the first pass is refused naming the task; a first pass with no German drops its task, logged."""
    with pytest.raises(ConfigError, match=r"data\.grounded\.tasks: unknown \['back_translation'\]; expected names "
                                          r"from .*'back_translate'"):
        GroundedSettings(tasks=["summarize", "back_translation"])
    settings = GroundedSettings(fraction=0.5, tasks=["back_translate"], min_chars=10)
    with pytest.raises(ValueError, match=r"data\.grounded\.tasks: back_translate needs the target to answer"):
        grounded_prompts(answers(3), 2, settings)
    # German under half as long as the English it translates is no translation (none; a stub longer than min_chars)
    silent = FakeTarget(reply=lambda text: "" if "number 0 " in text else "Kurz, aber nicht leer." if "number 1 " in text else text)
    with caplog.at_level(logging.WARNING, logger="draftkit.distill.grounded"):
        out = grounded_prompts(answers(3), 3, settings, seed=0, answer=silent)
    assert len(out) == 1 and "2 of 3 back_translate first passes gave German under half as long" in caplog.text


def test_a_first_pass_cut_at_max_new_tokens_is_no_passage_and_its_task_takes_a_spare_answer(caplog):
    """Two of six first passes hit max_new_tokens: their German is in no prompt; those two tasks keep
    their places with the German of the first two spare answers (not drawn, complete, asked in one
    more call: 3 of them, for 2 tasks at the failure rate 2/6 seen), and the four whose first pass
    finished are exactly the prompts (ids: cache keys) they were."""
    convs, settings = answers(12), GroundedSettings(fraction=0.5, tasks=["back_translate"], min_chars=10)
    plain = FakeTarget()
    whole = grounded_prompts(convs, 6, settings, seed=1, answer=plain)
    (firsts,) = plain.calls
    cut = {firsts[1].messages[0]["content"], firsts[4].messages[0]["content"]}
    target = FakeTarget(cut=lambda text: text in cut)
    with caplog.at_level(logging.INFO, logger="draftkit.distill.grounded"):
        out = grounded_prompts(convs, 6, settings, seed=1, answer=target)
    assert len(out) == 6 and len({p.id for p in out}) == 6
    assert [p for j, p in enumerate(out) if j not in (1, 4)] == [p for j, p in enumerate(whole) if j not in (1, 4)]
    assert [len(c) for c in target.calls] == [6, 3] and target.calls[0] == firsts
    passages = {p.target_text[0] for p in out}
    assert not passages & {german_of(target, firsts[j]) for j in (1, 4)}
    drawn = {f.target_text for f in firsts}
    for j, spare in zip((1, 4), target.calls[1]):
        assert spare.target_text not in drawn and spare.messages[0]["content"] not in cut
        german = german_of(target, spare)
        assert out[j].messages == [{"role": "user", "content": f"Translate German to English: {german}"}]
    assert "2 of 6 back_translate tasks had their German or their source answer cut" in caplog.text


def test_an_answer_cut_at_max_new_tokens_is_never_translated_for_back_translate():
    """Source answers that hit max_new_tokens are not sent to the first pass: a task drawn over one
    takes a spare complete answer in the same (first) call; the others are as with no answer cut."""
    settings = GroundedSettings(fraction=0.5, tasks=["back_translate"], min_chars=10)
    plain = FakeTarget()
    whole = grounded_prompts(answers(12), 6, settings, seed=1, answer=plain)
    cut_text = {plain.calls[0][1].target_text[0], plain.calls[0][4].target_text[0]}  # the sources of tasks 1, 4
    convs = answers(12)
    for c in convs:
        c.truncated = c.response.strip() in cut_text
    target = FakeTarget()
    out = grounded_prompts(convs, 6, settings, seed=1, answer=target)
    (firsts,) = target.calls
    assert len(firsts) == len(out) == 6 and not any(f.target_text[0] in cut_text for f in firsts)
    assert [j for j, p in enumerate(out) if p != whole[j]] == [1, 4] and len({p.id for p in out}) == 6


def test_a_long_cut_answers_opening_sentences_are_translated_as_they_are_whole():
    """An answer cut at max_new_tokens far past BACK_CHARS still opens with whole sentences: its excerpt is
    translated in the first call (no spare asked); a cut answer the excerpt runs to the end of is not."""
    from draftkit.distill.grounded import excerpt, excerpt_cut

    settings = GroundedSettings(fraction=0.5, tasks=["back_translate"], min_chars=10)
    convs = [Conversation(Prompt([{"role": "user", "content": f"Question {i}?"}], None, f"q:{i}"),
                          f"Answer {i} opens here. " + "It goes on and on, clause after clause, " * 30, True, 192)
             for i in range(6)]  # every answer cut mid-sentence, ~1200 characters
    assert not any(excerpt_cut(c) for c in convs)
    target = FakeTarget()
    out = grounded_prompts(convs, 3, settings, seed=0, answer=target)
    assert len(target.calls) == 1 and len(out) == 3
    assert {f.target_text for f in target.calls[0]} <= {(excerpt(c.response),) for c in convs}
    short = Conversation(convs[0].prompt, "A short answer that was cut", True, 6)
    assert excerpt_cut(short) and not excerpt_cut(Conversation(convs[0].prompt, short.response, False, 6))


def test_cut_first_passes_keep_every_kinds_share():
    """eagle-mix's six kinds, a target that cuts every third first pass: each kind has exactly the
    count it has when nothing is cut, the grounded total is n, and no cut German is a passage."""
    tasks = load_recipe(ROOT / "recipes" / "eagle-mix.yaml").data.grounded.tasks
    settings, n = GroundedSettings(fraction=0.4, tasks=tasks), 300
    whole = grounded_prompts(answers(400), n, settings, seed=0, answer=FakeTarget())
    cut = lambda text: int(hashlib.sha256(text.encode()).hexdigest(), 16) % 3 == 0  # noqa: E731
    target = FakeTarget(cut=cut)
    out = grounded_prompts(answers(400), n, settings, seed=0, answer=target)
    kinds = lambda prompts: Counter(p.category for p in prompts)  # noqa: E731
    assert len(out) == n and kinds(out) == kinds(whole) and len({p.id for p in out}) == n
    cut_german = {german_of(target, f) for call in target.calls for f in call if cut(f.messages[0]["content"])}
    assert cut_german and not cut_german & {p.target_text[0] for p in out if p.category == "grounded-back_translate"}
    assert 2 <= len(target.calls) <= 1 + REDRAW_ROUNDS


def test_a_task_with_no_spare_left_is_dropped_and_said(caplog):
    """Every answer is a back_translate source already: the task whose first pass was cut is dropped
    (the others kept), and the log says why."""
    settings = GroundedSettings(fraction=0.5, tasks=["back_translate"], min_chars=10)
    target = FakeTarget(cut=lambda text: "number 1 " in text)
    with caplog.at_level(logging.WARNING, logger="draftkit.distill.grounded"):
        out = grounded_prompts(answers(3), 3, settings, seed=0, answer=target)
    assert len(out) == 2 and len(target.calls) == 1 and not any("number 1 " in p.target_text[0][::-1] for p in out)
    assert "1 back_translate tasks found no spare answer whose German finished" in caplog.text


def test_both_engines_record_a_response_cut_at_max_new_tokens_the_same_way(model, tokenizer, tmp_path, monkeypatch):
    """The cache's `truncated` (what back_translate reads) from the tokens each engine returns, faked
    alike: HF's `generate` (rows padded after their stop token) and vLLM's worker (token ids with the
    stop token): a row without a stop token within max_new_tokens is cut, one whose stop token is the
    last allowed token is not; text and token counts agree too."""
    from draftkit.distill.regenerate import stop_token_ids
    from draftkit.engines import vllm_data

    stop, (a, b, c, d) = stop_token_ids(model, tokenizer)[0], tokenizer(" one two three four")["input_ids"][:4]
    rows = [[a, b, stop], [a, b, c, d], [a, b, c, stop], [stop]]  # max_new_tokens 4
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], None, f"q{i}") for i in range(4)]
    run = ctx(model, tokenizer, tmp_path, model_dir="tiny-dir")
    row_of = {tuple(i): r for i, r in zip(prompt_ids(tokenizer, prompts), rows)}

    def hf_generate(input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        out = [row_of[tuple(i[m.bool()].tolist())] for i, m in zip(input_ids, attention_mask)]
        return torch.cat([input_ids, torch.tensor([r + [pad_token_id] * (max_new_tokens - len(r)) for r in out])], 1)

    def vllm_generate(model_dir, dtype, ids, seeds, sampling, chunk_size, llm_kwargs):
        assert stop in sampling.stop_token_ids and sampling.max_tokens == 4
        yield list(range(len(ids))), [row_of[tuple(i)] for i in ids]

    monkeypatch.setattr(model, "generate", hf_generate)
    monkeypatch.setattr(vllm_data, "generate_responses", vllm_generate)
    monkeypatch.setattr(vllm_data, "cpu_refusal", lambda config: None)  # the tiny Llama's head size is no matter here
    got = {engine: [(c.response, c.truncated, c.num_tokens) for c in regenerate(
        run, prompts, GenerationSettings(max_new_tokens=4, batch_size=4, engine=engine))] for engine in ("hf", "vllm")}
    assert got["hf"] == got["vllm"]
    assert [t for _, t, _ in got["hf"]] == [False, True, False, False] and [n for *_, n in got["hf"]] == [3, 4, 4, 1]


def test_prepare_never_makes_a_passage_of_german_the_tiny_llama_cut(model, tokenizer, tmp_path, caplog, monkeypatch):
    """Through prepare_conversations, the tiny Llama sampling at most 6 tokens (a quarter of its answers
    cut): every back_translate passage is a first pass the target finished, over a source answer it
    finished (as regenerate returns them from the response cache); the tasks whose German was cut took
    spares (none left waiting; the tiny Llama's empty or repeated German is dropped as before, so the
    count is not checked here)."""
    from draftkit.distill import samples

    answered = []  # (prompt, conversation) of every regenerate call

    def spy(*args, **kwargs):
        convs = regenerate(*args, **kwargs)
        answered.extend((c.prompt, c) for c in convs)
        return convs

    monkeypatch.setattr(samples, "regenerate", spy)
    data = DataConfig(sources=[PromptSource(str(share_file(tmp_path, 60)))], holdout=1,
                      responses=GenerationSettings(max_new_tokens=6, temperature=1.0, batch_size=16),
                      grounded=GroundedSettings(fraction=0.25, tasks=["back_translate"], min_chars=1))
    run = ctx(model, tokenizer, tmp_path / "cache", data=data, seed=0)
    with caplog.at_level(logging.INFO, logger="draftkit.distill.grounded"):
        convs, _, stats = prepare_conversations(run, 40)
    assert stats["mixture"]["sources"] == 30 and stats["mixture"]["grounded"] == len(convs) - 30 > 0
    english = {c.response.strip(): c.truncated for c in convs[:30]}
    firsts = [(p, c) for p, c in answered if p.category == "grounded-back_translate-first"]
    assert any(c.truncated for _, c in firsts), "no first pass was cut: the test tests nothing"
    assert any(english.values()), "no answer was cut: the test tests nothing"
    assert all(english[t] is False for p, _ in firsts for t in p.target_text)  # only finished answers translated
    german = {}
    for _, c in firsts:
        german.setdefault(c.response.strip(), []).append(c.truncated)
    for c in convs[30:]:
        (passage,) = c.prompt.target_text
        assert False in german[passage], passage  # a German the target finished
    assert "back_translate tasks had their German or their source answer cut" in caplog.text
    assert "found no spare" not in caplog.text
