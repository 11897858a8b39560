"""Token samples with a loss mask; `prepare_conversations`: prompts sized to the run -> responses.

The trainer's data stage (distill/prepare.py) calls both and writes the result as shards;
`prepare_samples` is the same in memory. Both take the run's DataContext (distill/context.py).

A sample is the whole conversation rendered by the tokenizer's chat template. Its `loss_mask` marks
the tokens the head learns to predict, chosen by `loss_on` (the recipe's data.loss_on):

- "response": exactly the tokens the target generated: the assistant response plus the
  end-of-turn token that closes it, never the template's role header, the prompt or earlier
  (dataset) replies.
- "target_text": the response plus the prompt's passages that are the target's own text
  (`Prompt.target_text`: a grounded task's passage is the target's answer to another prompt).
- "all": every token up to the end of the response (the template, the prompt, earlier replies):
  teacher forcing on text the target did not write, the target's own distribution as the label.

Whatever the template adds after the closing end-of-turn token is never in the loss.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict
from functools import partial

from .context import DataContext
from .grounded import grounded_prompts, source_passages
from .regenerate import Conversation, chat_ids, end_of_turn_ids, regenerate, responses
from .sources import Prompt, load_prompts
from .synthesize import synthesize_cached
from .text import completion_ids

log = logging.getLogger(__name__)

# What each token of a sample is (token_kinds), and which kinds each data.loss_on trains on.
PROMPT, RESPONSE, TARGET_TEXT, AFTER = 0, 1, 2, 3
LOSS_ON = {"response": (RESPONSE,), "target_text": (RESPONSE, TARGET_TEXT),
           "all": (PROMPT, RESPONSE, TARGET_TEXT)}


def build_samples(
    tokenizer, conversations: list[Conversation], max_length: int, overlong: str = "truncate",
    loss_on: str = "response",
    fmt: str = "chat",
) -> tuple[list[dict], dict]:
    """Tokenize conversations into {input_ids, loss_mask}; `overlong` is "truncate" or "drop";
    fmt "text": raw-text prompt + continuation (distill/text.py), else the chat template.

    Truncation cuts from the right. A sample left without any response token is dropped.
    Returns (samples, stats) with stats: kept, truncated, dropped_overlong, dropped_no_assistant,
    dropped_template, tokens, assistant_tokens (response tokens), loss_tokens (per loss_on).
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    if loss_on not in LOSS_ON:
        raise ValueError(f"data.loss_on: {loss_on!r} is not one of {sorted(LOSS_ON)}")
    stats = dict(kept=0, truncated=0, dropped_overlong=0, dropped_no_assistant=0,
                 dropped_template=0, tokens=0, assistant_tokens=0, loss_tokens=0)
    samples = []
    for conv in conversations:
        kinds = completion_kinds(tokenizer, conv) if fmt == "text" else token_kinds(tokenizer, conv)
        if kinds is None:
            stats["dropped_template"] += 1
            continue
        ids, kinds = kinds
        if len(ids) > max_length:
            if overlong == "drop":
                stats["dropped_overlong"] += 1
                continue
            ids, kinds = ids[:max_length], kinds[:max_length]
            stats["truncated"] += 1
        if RESPONSE not in kinds:
            stats["dropped_no_assistant"] += 1
            continue
        sample = {"input_ids": ids, "loss_mask": [int(k in LOSS_ON[loss_on]) for k in kinds]}
        samples.append(sample)
        stats["kept"] += 1
        stats["tokens"] += len(ids)
        stats["assistant_tokens"] += kinds.count(RESPONSE)
        stats["loss_tokens"] += sum(sample["loss_mask"])
    return samples, stats


def completion_kinds(tokenizer, conv: Conversation) -> tuple[list[int], list[int]] | None:
    """token_kinds for completion mode (raw-text prompt + continuation, distill/text.py)."""
    sample = tokenize_completion(tokenizer, conv)
    if sample is None:
        return None
    return sample["input_ids"], [RESPONSE if m else PROMPT for m in sample["loss_mask"]]


def tokenize_completion(tokenizer, conv: Conversation) -> dict:
    """{input_ids, loss_mask}: prompt ids, then the continuation's ids (+ EOS when it ended), the
    mask 1 exactly on the continuation (and its EOS)."""
    prompt = completion_ids(tokenizer, conv.prompt.messages)
    response = list(tokenizer(conv.response, add_special_tokens=False)["input_ids"])
    if not conv.truncated and tokenizer.eos_token_id is not None:
        response.append(tokenizer.eos_token_id)
    return {"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)}


def tokenize_conversation(tokenizer, conv: Conversation, loss_on: str = "response") -> dict | None:
    """{input_ids, loss_mask} of one conversation (module docstring: loss_on), or None when the
    template defeats the mask."""
    kinds = token_kinds(tokenizer, conv)
    if kinds is None:
        return None
    return {"input_ids": kinds[0], "loss_mask": [int(k in LOSS_ON[loss_on]) for k in kinds[1]]}


def token_kinds(tokenizer, conv: Conversation) -> tuple[list[int], list[int]] | None:
    """(input_ids, kind of each token: PROMPT / RESPONSE / TARGET_TEXT / AFTER), or None when the
    template defeats the mask.

    The prompt rendered with add_generation_prompt=True must be a token prefix of the full
    conversation; the response then runs from there to the first end-of-turn token (included).
    Whatever the template adds after that token (a newline, say) is AFTER. A truncated response
    never produced an end-of-turn token, so its closing token is AFTER too.
    """
    prompt = chat_ids(tokenizer, conv.prompt.messages, add_generation_prompt=True)
    full = chat_ids(tokenizer, conv.messages, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        log.warning("prompt %s: chat template prompt is not a token prefix of the conversation",
                    conv.prompt.id)
        return None
    eot = end_of_turn_ids(tokenizer)
    end = next((j for j in range(len(prompt), len(full)) if full[j] in eot), None)
    if end is None:  # a template that closes the turn with no special token: mask to the end
        end = len(full) - 1
    stop = end if conv.truncated else end + 1
    kinds = [PROMPT] * len(prompt) + [RESPONSE] * (stop - len(prompt)) + [AFTER] * (len(full) - stop)
    for i in _target_text_tokens(tokenizer, conv, full, len(prompt)):
        kinds[i] = TARGET_TEXT
    return full, kinds


def _target_text_tokens(tokenizer, conv: Conversation, full: list[int], prompt_len: int) -> list[int]:
    """Indices of the prompt tokens that lie inside one of conv.prompt.target_text's passages.

    Found through the tokenizer's character offsets in the rendered conversation; a token that
    straddles a passage's edge counts when what lies outside the passage is whitespace (" Cats").
    """
    passages = [t for t in conv.prompt.target_text if t]
    if not passages:
        return []
    text = tokenizer.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=False)
    prompt_text = tokenizer.apply_chat_template(conv.prompt.messages, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != full or not text.startswith(prompt_text):
        log.warning("prompt %s: cannot locate its target text in the tokens; only the response is marked",
                    conv.prompt.id)
        return []
    spans = [(s, s + len(p)) for p in passages if (s := prompt_text.find(p)) >= 0]
    out = []
    for i, (a, b) in enumerate(enc["offset_mapping"][:prompt_len]):
        if b > a and any((a >= s or not text[a:s].strip()) and (b <= e or not text[e:b].strip())
                         and a < e and b > s for s, e in spans):
            out.append(i)
    return out


def prepare_samples(ctx: DataContext, num_samples: int) -> tuple[list[dict], list[Prompt], dict]:
    """Prompts -> target responses -> token samples, sized to the run: `prepare_conversations`,
    then `build_samples` with ctx.data's max_length, overlong and loss_on.

    Returns (train_samples, holdout_prompts, stats).
    """
    d = ctx.data
    convs, holdout, conv_stats = prepare_conversations(ctx, num_samples)
    samples, stats = build_samples(ctx.tokenizer, convs, d.max_length, d.overlong, d.loss_on, ctx.fmt)
    stats.update(conv_stats)
    if stats["kept"] < num_samples:
        log.warning("prepared %d training samples of the %d asked for", stats["kept"], num_samples)
    return samples, holdout, stats


def prepare_conversations(ctx: DataContext, num_samples: int) -> tuple[list[Conversation], list[Prompt], dict]:
    """Prompts -> the responses to train on, sized to the run.

    The num_samples training prompts are a mixture (mixture_counts): data.grounded.fraction of them
    grounded tasks, data.synthesize.fraction written by the target (Magpie-style), the rest from
    data.sources (all of them synthesized when it is empty). The plain (not grounded) prompts and
    data.holdout more are loaded or synthesized (plain_prompts); the held-aside ones are evaluated,
    never trained on; the target answers the others, and then the grounded prompts built from those
    answers (distill/grounded.py; back_translate's first pass into German is answered on the way, not
    trained on). A prompt is trained on once: repeats (of a held-aside one too) are
    dropped. stats["mixture"] counts the training prompts of each part.
    ctx.fmt "text" (completion mode, distill/text.py) needs sources: Magpie synthesis needs a chat template.
    Returns (train_conversations, holdout_prompts, stats).
    """
    d = ctx.data
    num_grounded = _grounded_count(ctx, num_samples)
    _, num_synth, _ = mixture_counts(d, num_samples - num_grounded, num_grounded)
    plain, holdout, synthesized = plain_prompts(ctx, num_samples - num_grounded, num_synth)
    seen = {p.key() for p in holdout}
    train = _first_of_each(plain, seen)
    convs = responses(ctx, train, d.responses)
    tasks = []
    if num_grounded:
        first_pass = partial(regenerate, ctx, settings=d.responses)  # back_translate's German, as the target says it
        passages = convs if d.grounded.passages_from == "target" else source_passages(train, d.grounded)
        tasks = _first_of_each(grounded_prompts(passages, num_grounded, d.grounded, ctx.seed, first_pass), seen)
        convs = convs + regenerate(ctx, tasks, d.responses)
    from_synth = sum(p.key() in synthesized for p in train)
    stats = dict(prompts=len(plain) + len(holdout) + num_grounded, holdout=len(holdout), grounded=num_grounded,
                 responses_truncated=sum(c.truncated for c in convs),
                 response_tokens=sum(c.num_tokens for c in convs),
                 source="synthesized" if not d.sources else [asdict(s) for s in d.sources],
                 mixture={"sources": len(train) - from_synth, "synthesized": from_synth, "grounded": len(tasks)})
    return convs, holdout, stats


def mixture_counts(d, num_plain: int, num_grounded: int) -> tuple[int, int, int]:
    """(from data.sources, synthesized, grounded) training prompts for num_plain + num_grounded:
    data.synthesize.fraction of the whole synthesized (rounded), the plain rest from the sources;
    everything plain is synthesized when data.sources is empty."""
    if not d.sources:
        return 0, num_plain, num_grounded
    num_synth = min(num_plain, round((num_plain + num_grounded) * d.synthesize.fraction))
    return num_plain - num_synth, num_synth, num_grounded


def holdout_split(holdout: int, num_plain: int, num_synth: int) -> tuple[int, int]:
    """(from data.sources, synthesized) of the held-aside prompts: the plain prompts' proportion, rounded."""
    held_synth = round(holdout * num_synth / num_plain) if num_plain else 0
    return holdout - held_synth, held_synth


def plain_prompts(ctx: DataContext, num_plain: int, num_synth: int) -> tuple[list[Prompt], list[Prompt], set[str]]:
    """(num_plain training prompts, data.holdout held-aside ones, the keys of the synthesized ones).

    num_synth of the training prompts (all of them without data.sources) are synthesized, the others
    loaded from data.sources; the held-aside ones are split in the same proportion (rounded), each
    part's first. A mixture is shuffled with the run's seed, so that shards and grounded passages
    draw on both parts; one part alone keeps its own order (the prompts of earlier runs, as they were).
    """
    d = ctx.data
    if not d.sources:
        prompts = synthesize_cached(ctx, num_plain + d.holdout, d.synthesize)
        return prompts[d.holdout:], prompts[:d.holdout], {p.key() for p in prompts}
    held_src, held_synth = holdout_split(d.holdout, num_plain, num_synth)
    src = load_prompts(d.sources, limit=num_plain - num_synth + held_src, seed=ctx.seed)
    if not num_synth:
        return src[held_src:], src[:held_src], set()
    syn = synthesize_cached(ctx, num_synth + held_synth, d.synthesize)
    train = src[held_src:] + syn[held_synth:]
    random.Random(ctx.seed).shuffle(train)
    return train, src[:held_src] + syn[:held_synth], {p.key() for p in syn}


def _grounded_count(ctx: DataContext, num_samples: int) -> int:
    """How many of num_samples are grounded tasks; ValueError for settings that cannot be prepared
    (Magpie synthesis in completion mode, alone or mixed; kept replies without sources, or with grounded tasks)."""
    d = ctx.data
    if ctx.fmt == "text" and not d.sources:
        raise ValueError(
            "data.sources is empty, so prompts would be synthesized Magpie-style, which needs a chat template, "
            "and this run is in completion mode (data.format: text: a base model, or a target without a chat "
            "template). Give raw-text prompts: data.sources: [{path: corpus.txt}] (.txt/.md paragraphs, code "
            "files or a directory of them, JSONL records with a `text` field, a dataset with a `text` column)")
    if ctx.fmt == "text" and d.synthesize.fraction:
        raise ValueError(f"data.synthesize.fraction: {d.synthesize.fraction} asks for Magpie-style prompts, which "
                         "need a chat template, and this run is in completion mode (data.format: text); set it to 0")
    if d.responses.mode == "keep" and not d.sources:
        raise ValueError("data.responses.mode: keep trains on the sources' own replies; data.sources is empty "
                         "(synthesized prompts have none): add sources or use mode: regenerate")
    if d.responses.mode == "keep" and d.grounded.fraction:
        raise ValueError("data.grounded.fraction: grounded tasks are answered by the target (and their passages "
                         "are its answers unless passages_from: sources), which data.responses.mode: keep does "
                         "not do; set it to 0 or use mode: regenerate")
    if d.grounded.fraction and d.grounded.passages_from == "sources" and not d.sources:
        raise ValueError("data.grounded.passages_from: sources takes its passages from the replies in "
                         "data.sources, which is empty (synthesized prompts have none): add sources with "
                         "replies or use passages_from: target")
    num_grounded = round(num_samples * d.grounded.fraction)
    if ctx.fmt == "text" and num_grounded:  # its tasks are chat instructions ("Summarize ..."): no use to a base model
        log.warning("data.grounded.fraction %s ignored in completion mode (data.format: text)", d.grounded.fraction)
        num_grounded = 0
    return num_grounded


def _first_of_each(prompts: list[Prompt], seen: set[str]) -> list[Prompt]:
    """prompts without those whose messages are in `seen` or repeat an earlier one (adds to seen)."""
    out = []
    for p in prompts:
        if p.key() not in seen:
            seen.add(p.key())
            out.append(p)
    if len(out) < len(prompts):
        log.info("dropped %d repeated prompts", len(prompts) - len(out))
    return out
