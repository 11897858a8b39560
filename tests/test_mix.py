"""Data mixtures (data.sources + data.synthesize.fraction + data.grounded.fraction) and the draft
vocabulary's coverage (heads/vocab.coverage, the trainer's figure).

In-process on test_distill's tiny Llama (it ends its turns, so Magpie synthesis keeps prompts) and the
fixture ChatML tokenizer; nothing here reads ../shared or a real target.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from draftkit.config import DataConfig, GenerationSettings, GroundedSettings, PromptSource, SynthesisSettings
from draftkit.config import load_recipe
from draftkit.distill import load_prompts, synthesize_cached
from draftkit.distill.samples import holdout_split, mixture_counts, plain_prompts, prepare_conversations
from draftkit.schema import ConfigError
from tests.test_distill import ctx, generated_rows, model, tokenizer  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
SYNTH = SynthesisSettings(batch_size=8, max_new_tokens=12, min_chars=1)
SAMPLED = GenerationSettings(max_new_tokens=24, temperature=1.0, batch_size=8)  # greedy ends at once here


def share_file(tmp_path: Path, n: int = 30) -> Path:
    path = tmp_path / "share.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"share question number {i}?"}) + "\n" for i in range(n)))
    return path


def part(prompt) -> str:
    """Which part of the mixture a prompt came from, by its id (<source stem>: / magpie: / grounded:)."""
    return prompt.id.split(":")[0]


def test_mixture_holds_the_stated_shares_of_sources_synthesized_and_grounded(model, tokenizer, tmp_path,
                                                                             generated_rows):
    """12 training prompts at synthesize 0.25 / grounded 0.25: 6 from the file, 3 the target wrote, 3
    tasks over the target's answers to those 9; the 4 held aside split as the 9 are (3 + 1), never
    trained on; the synthesized ones are the target's own (the Magpie cache), the passages its answers."""
    synth = dataclasses.replace(SYNTH, fraction=0.25)
    data = DataConfig(sources=[PromptSource(str(share_file(tmp_path)))], synthesize=synth, responses=SAMPLED,
                      grounded=GroundedSettings(fraction=0.25, min_chars=1), holdout=4)
    run = ctx(model, tokenizer, tmp_path / "cache", data=data, seed=0)
    convs, holdout, stats = prepare_conversations(run, 12)
    assert stats["mixture"] == {"sources": 6, "synthesized": 3, "grounded": 3} and stats["prompts"] == 16
    assert sorted(part(c.prompt) for c in convs) == ["grounded"] * 3 + ["magpie"] * 3 + ["share"] * 6
    assert sorted(part(p) for p in holdout) == ["magpie"] + ["share"] * 3
    assert not {p.key() for p in holdout} & {c.prompt.key() for c in convs}
    generated_rows.clear()
    magpie = synthesize_cached(run, 4, synth)  # the run's own synthesized prompts: read back, not sampled again
    assert generated_rows == [] and {p.id for p in magpie} == {
        c.prompt.id for c in convs if part(c.prompt) == "magpie"} | {p.id for p in holdout if part(p) == "magpie"}
    answers = {c.response.strip() for c in convs if part(c.prompt) != "grounded"}
    assert all(set(c.prompt.target_text) <= answers for c in convs if part(c.prompt) == "grounded")


def reply_file(tmp_path: Path, n: int = 12) -> Path:
    """ShareGPT-shaped records whose replies are long, several sentences, and written by no model here."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"Tell me about harbour {i}."},
        {"from": "gpt", "value": " ".join(f"Harbour {i} sentence {j} mentions Oslo and 19{i:02d}." for j in range(12))}]})
        + "\n" for i in range(n)))
    return path


def test_grounded_passages_from_the_sources_are_their_replies_to_training_prompts(model, tokenizer, tmp_path,
                                                                                  generated_rows):
    """passages_from: sources: each task's passage is the reply a training record carries, cut to whole
    sentences within max_chars; never a held-aside record's, never what the target said; not target_text.
    The plain prompts and the held-aside split are those of passages_from: target."""
    grounded = GroundedSettings(fraction=0.25, tasks=["summarize", "answer"], min_chars=20, max_chars=120,
                                passages_from="sources")
    data = DataConfig(sources=[PromptSource(str(reply_file(tmp_path)))], responses=SAMPLED, grounded=grounded,
                      holdout=2)
    convs, holdout, stats = prepare_conversations(ctx(model, tokenizer, tmp_path / "a", data=data, seed=0), 8)
    assert stats["mixture"] == {"sources": 6, "synthesized": 0, "grounded": 2}
    tasks = [c.prompt for c in convs if part(c.prompt) == "grounded"]
    plain = [c for c in convs if part(c.prompt) != "grounded"]
    replies = {c.prompt.reply: c.prompt for c in plain}
    assert len(tasks) == 2 and all(t.target_text == () for t in tasks)
    for t in tasks:
        text = t.messages[0]["content"]
        (reply,) = [r for r in replies if r[:40] in text]  # the passage opens one training record's reply
        passage = next(excerpt for n in range(len(reply), 0, -1) if (excerpt := reply[:n]) in text)
        assert passage.endswith(".") and len(passage) <= 120 and reply.startswith(passage)
        assert not any(c.response.strip()[:30] in text for c in plain if c.response.strip())
    assert not any(p.reply[:40] in t.messages[0]["content"] for p in holdout for t in tasks)
    target = dataclasses.replace(data, grounded=dataclasses.replace(grounded, passages_from="target"))
    convs_t, holdout_t, _ = prepare_conversations(ctx(model, tokenizer, tmp_path / "b", data=target, seed=0), 8)
    assert [p.id for p in holdout_t] == [p.id for p in holdout]
    assert [c.prompt.id for c in convs_t if part(c.prompt) != "grounded"] == [c.prompt.id for c in plain]


def test_grounded_passages_from_sources_refuse_sources_without_replies(model, tokenizer, tmp_path):
    grounded = GroundedSettings(fraction=0.25, min_chars=1, passages_from="sources")
    no_replies = DataConfig(sources=[PromptSource(str(share_file(tmp_path)))], responses=SAMPLED,
                            grounded=grounded, holdout=2)
    with pytest.raises(ValueError, match=r"passages_from: sources .*none of the 6 training prompts has one"):
        prepare_conversations(ctx(model, tokenizer, tmp_path / "a", data=no_replies), 8)
    with pytest.raises(ValueError, match=r"passages_from: sources .*data.sources, which is empty"):
        prepare_conversations(ctx(model, tokenizer, tmp_path / "b", data=DataConfig(
            responses=SAMPLED, grounded=grounded, holdout=2)), 8)
    with pytest.raises(ConfigError, match=r"data\.grounded\.passages_from"):
        load_recipe(ROOT / "recipes" / "eagle-mix.yaml", ["data.grounded.passages_from=mine"])
    with pytest.raises(ConfigError, match=r"data\.grounded\.max_chars"):
        GroundedSettings(min_chars=200, max_chars=100)


def test_one_part_alone_gives_the_prompts_it_gave_before(model, tokenizer, tmp_path):
    """No synthesize.fraction: the sources' own order, held-aside ones first (the data of earlier runs);
    no sources: the Magpie cache's order."""
    src = [PromptSource(str(share_file(tmp_path)))]
    run = ctx(model, tokenizer, tmp_path / "cache", data=DataConfig(sources=src, holdout=2))
    train, held, synthesized = plain_prompts(run, 5, 0)
    want = load_prompts(src, limit=7, seed=0)
    assert held == want[:2] and train == want[2:] and synthesized == set()
    magpie = ctx(model, tokenizer, tmp_path / "cache", data=DataConfig(holdout=2, synthesize=SYNTH))
    train, held, synthesized = plain_prompts(magpie, 3, 3)
    want = synthesize_cached(magpie, 5, SYNTH)
    assert held == want[:2] and train == want[2:] and synthesized == {p.key() for p in want}


def test_the_shipped_mixture_states_its_proportions():
    """recipes/eagle-mix.yaml: 2500 = 1000 ShareGPT + 500 Magpie + 1000 grounded, 16 held aside as 11 + 5."""
    d = load_recipe(ROOT / "recipes" / "eagle-mix.yaml").data
    grounded = round(d.num_prompts * d.grounded.fraction)
    assert mixture_counts(d, d.num_prompts - grounded, grounded) == (1000, 500, 1000)
    assert holdout_split(d.holdout, 1500, 500) == (11, 5)
    assert d.responses.mode == "regenerate" and d.responses.temperature == 0.0 and d.sources


@pytest.mark.parametrize("overrides, match", [
    (["data.synthesize.fraction=1.5"], r"data\.synthesize\.fraction: expected 0 <= fraction < 1, got 1\.5"),
    (["data.synthesize.fraction=-0.1"], r"data\.synthesize\.fraction: expected 0 <= fraction < 1"),
    (["data.sources=[]"], r"data\.synthesize\.fraction: 0\.2 mixes synthesized prompts into data\.sources, which is "
                          r"empty"),
    (["data.grounded.fraction=0.8"], r"data\.synthesize\.fraction: 0\.2 \+ data\.grounded\.fraction 0\.8 leave no "
                                     r"share for data\.sources"),
    (["data.responses.mode=keep", "data.grounded.fraction=0"], r"data\.synthesize\.fraction: 0\.2 synthesized prompts "
                                                               r"have no reply to keep"),
])
def test_a_bad_mixture_names_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(ROOT / "recipes" / "eagle-mix.yaml", overrides)


def test_completion_mode_refuses_a_synthesized_share(model, tokenizer, tmp_path):
    data = DataConfig(sources=[PromptSource(str(share_file(tmp_path)))],
                      synthesize=SynthesisSettings(fraction=0.3))
    with pytest.raises(ValueError, match=r"data\.synthesize\.fraction: 0\.3 asks for Magpie-style prompts.*"
                                         r"completion mode"):
        prepare_conversations(ctx(model, tokenizer, tmp_path, data=data, fmt="text"), 4)


def test_the_share_is_in_the_data_key_and_out_of_the_prompt_cache_key(model, tokenizer, tmp_path):
    """At 0 data.synthesize.fraction is left out of the prepared data's key and the recipe hash (the
    keys of earlier runs, as they were); set, it is in both; never in the Magpie cache's key (how many
    prompts, not which)."""
    from draftkit.distill.prepare import _fingerprint_payload

    class Shell:  # what the payload reads of a target
        name, fingerprint, dtype, config = "tiny", "f", torch.float32, None
        tokenizer = None

    quick = load_recipe(ROOT / "recipes" / "quick.yaml", ["data.responses.engine=hf"])
    assert "fraction" not in _fingerprint_payload(quick, Shell, 10)["data"]["synthesize"]
    # The default recipe's hash before data.synthesize.fraction existed (main at 1570ccd): a checkpoint
    # written then still resumes. A setting added later at its default belongs in config.LATER_DEFAULTS.
    assert load_recipe(None).fingerprint() == "7c50e648d1413c64"
    mix = load_recipe(ROOT / "recipes" / "eagle-mix.yaml", ["data.responses.engine=hf"])
    other = load_recipe(ROOT / "recipes" / "eagle-mix.yaml", ["data.responses.engine=hf",
                                                              "data.synthesize.fraction=0.1"])
    assert _fingerprint_payload(mix, Shell, 10)["data"]["synthesize"]["fraction"] == 0.2
    assert mix.fingerprint() != other.fingerprint()
    assert "passages_from" not in _fingerprint_payload(mix, Shell, 10)["data"]["grounded"]  # later, at its default
    sourced = load_recipe(ROOT / "recipes" / "eagle-mix.yaml", ["data.responses.engine=hf",
                                                                "data.grounded.passages_from=sources"])
    assert _fingerprint_payload(sourced, Shell, 10)["data"]["grounded"]["passages_from"] == "sources"
    assert sourced.fingerprint() != mix.fingerprint()
    a = synthesize_cached(ctx(model, tokenizer, tmp_path, data=DataConfig()), 2, SYNTH)
    files = sorted(tmp_path.glob("prompts-*.jsonl"))
    b = synthesize_cached(ctx(model, tokenizer, tmp_path, data=DataConfig()), 2,
                          dataclasses.replace(SYNTH, fraction=0.5))
    assert a == b and sorted(tmp_path.glob("prompts-*.jsonl")) == files


# ----------------------------------------------------------------------------- coverage

def test_coverage_is_exact_on_a_hand_made_case():
    """Vocabulary {1, 2, 5} of 10 ids; the loss tokens 2 3 5 5 | 7 1: 4 of 6 inside."""
    from draftkit.heads.vocab import coverage, sample_counts

    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 5]] = True
    samples = [{"input_ids": [1, 2, 3, 5, 5], "loss_mask": [0, 1, 1, 1, 1]},
               {"input_ids": [7, 1], "loss_mask": [1, 1]}]
    assert coverage(t2d, sample_counts(samples, 10)) == {"tokens": 6, "inside": 4, "inside_fraction": 4 / 6}
    assert coverage(t2d, sample_counts([], 10)) == {"tokens": 0, "inside": 0, "inside_fraction": None}


def test_the_trainers_figures_are_the_chosen_vocabularys_coverage(tiny_target):
    """An EAGLE head drafting over 3 ids chooses them from the training loss tokens (6 x4, 7 x3, 8 x2 win
    over 9 x1 and the masked 5s); of the held-aside responses' 5 tokens 6 6 8 | 9 5 it holds 3."""
    from draftkit.distill.prepare import Prepared
    from draftkit.heads import build_head
    from draftkit.heads.vocab import sample_counts
    from draftkit.train.loop import draft_vocab_coverage

    train = [{"input_ids": [5, 5, 5, 6, 6, 7, 9], "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
             {"input_ids": [6, 6, 7, 7, 8, 8], "loss_mask": [1, 1, 1, 1, 1, 1]}]
    held = [{"input_ids": [5, 6, 6, 8], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [9, 5], "loss_mask": [1, 1]}]
    head = build_head({"type": "eagle", "draft_vocab_size": 3}, tiny_target)
    head.set_draft_vocab(counts=sample_counts(train, tiny_target.vocab_size))
    assert head.draft_ids.tolist() == [6, 7, 8]
    got = draft_vocab_coverage(head, Prepared(train, held, [], {}), tiny_target.vocab_size)
    assert got == {"size": 3, "train_inside": 9 / 10, "heldout_inside": 3 / 5, "heldout_tokens": 5}
    plain = build_head({"type": "eagle"}, tiny_target)  # no draft vocabulary: nothing to report
    assert draft_vocab_coverage(plain, Prepared(train, held, [], {}), tiny_target.vocab_size) == {}


def test_vocab_coverage_compares_data_sets_at_equal_size_by_evenly_spaced_samples():
    """benchmarks/vocab_coverage.py --samples: a data set of two parts (6 + 4) gives 5 in the same shares."""
    from benchmarks.vocab_coverage import spread

    parts = ["plain"] * 6 + ["grounded"] * 4
    assert spread(parts, 5) == ["plain"] * 3 + ["grounded"] * 2
    assert spread(list(range(10)), 4) == [0, 2, 5, 7] and spread(parts, None) is parts and spread(parts, 99) is parts
