"""Prompts grounded in a passage, built from the target's own answers (or the sources' replies).

Much of what a served model is asked works over text in the prompt: summarize this, answer from
these documents, translate, rewrite, list the key points. Its answers then reuse that text, and a
draft head only learns to predict the reuse if it trains on such prompts. Chat prompts alone
(Magpie's, or most chat sets) are short questions with nothing to draw on. So a share of the
training prompts (`data.grounded.fraction`) is built here from the responses the target already
gave to the plain prompts: each such response becomes the passage of a task, and the target then
answers the task like any other prompt (its answer is what the head learns). With
`data.grounded.passages_from: sources` the passages are instead the sources' own replies to the
training prompts (`source_passages`: ShareGPT's assistant turns, cut to whole sentences within
`max_chars`): text the target did not write, as the documents a served model is handed are not its
own, so the head learns how the target reuses someone else's words, names and numbers.

One kind takes two passes: `back_translate` (Spec-Bench's translation prompts are German -> English,
while `translate` asks the target to write the other language). Its first pass asks the target to
translate the opening sentences of a response (`excerpt`: up to BACK_CHARS characters) into German (the
`translate` task's wording); the target's German, exactly as it answered, becomes the passage of a
"Translate German to English: ..." prompt, which the target then answers like every other task. The
first pass is not trained on: it only makes the passage. Sentences, not whole answers: Spec-Bench's
translation prompts are one German sentence each (30-400 characters, median ~130), and a whole answer's
German ran past max_new_tokens (192) in 5 of 5 first passes of a recipes/eagle-mix.yaml smoke run (60
prompts): 3 of its 5 tasks found no spare and were dropped.
A passage must be German the target finished: a first pass cut at max_new_tokens (no stop token; the
response cache's `truncated`, which both engines record from the tokens) would make the task translate
text that stops mid-sentence, and so would an excerpt that runs into where its source answer was cut
(excerpt_cut; a cut answer's opening sentences are whole text). Such a task keeps its
place and takes the German of the next spare answer (complete, in the draws' order, not a source of
another back_translate) that finished, so recipes keep their task counts and shares, and every task
whose pass finished keeps the prompt (and cache key) it had.
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
import re
from collections.abc import Callable

from draftkit.config import GROUNDED_TASKS, GroundedSettings

from .regenerate import Conversation
from .sources import Prompt

log = logging.getLogger(__name__)
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")
BACK_FROM = "German"  # the language back_translate's first pass writes (Spec-Bench: WMT German -> English)
REDRAW_ROUNDS = 4  # at most this many more first-pass calls for back_translate tasks whose German was cut
BACK_CHARS = 300  # back_translate translates an answer's opening sentences within this many characters
SENTENCE_END = re.compile(r"(?<=[.!?])\s")

Answer = Callable[[list[Prompt]], list[Conversation]]  # the target answering prompts, in order


def grounded_prompts(convs: list[Conversation], n: int, settings: GroundedSettings,
                     seed: int = 0, answer: Answer | None = None) -> list[Prompt]:
    """n prompts, each a task over settings.passages responses of `convs` joined (each response
    used at most once while there are unused ones), deterministic in (convs, n, settings, seed) and,
    for back_translate, in what `answer` says to the first passes (one call, more for cut ones; back_translate
    needs it). Each prompt names its passages as `target_text` when they are the target's own text
    (settings.passages_from "target"; with "sources" only back_translate's German is).
    A back_translate whose German is under half as long as its English (german_chars) is dropped (logged); one whose
    first pass or source answer was cut at max_new_tokens takes a spare answer's German instead
    (module docstring; dropped, logged, only when no spare finishes within REDRAW_ROUNDS more calls)."""
    passages = [c for c in convs if len(c.response.strip()) >= settings.min_chars]
    if n <= 0:
        return []
    if not passages:
        raise ValueError(f"data.grounded: no response of the {len(convs)} regenerated is at least "
                         f"{settings.min_chars} characters long to serve as a passage")
    drawn, order = _draw(passages, n, settings, seed)
    if any(task == "back_translate" for task, _, _ in drawn):
        drawn = _back_translated(drawn, passages, order, settings, answer)
    own = settings.passages_from == "target"
    return [_task_prompt(task, texts if own or task == "back_translate" else (), text)
            for task, (texts, text), _ in drawn]


def source_passages(prompts: list[Prompt], settings: GroundedSettings) -> list[Conversation]:
    """The passages of data.grounded.passages_from: sources, shaped as grounded_prompts takes them: each
    prompt's own reply (Prompt.reply) cut to whole sentences within settings.max_chars (`excerpt`), as
    the response of a Conversation that was not cut (truncated False, num_tokens 0: nothing was
    generated). Prompts without a reply (synthesized ones, prompt-only records) give none; ValueError
    when none of `prompts` has one."""
    out = [Conversation(p, excerpt(p.reply, settings.max_chars), False, 0) for p in prompts if p.reply
           and p.reply.strip()]
    if not out:
        raise ValueError(f"data.grounded.passages_from: sources takes its passages from the replies the "
                         f"records of data.sources carry (ShareGPT / OpenAI assistant turns), and none of the "
                         f"{len(prompts)} training prompts has one: use sources with replies, or passages_from: "
                         f"target")
    return out


def _draw(passages: list[Conversation], n: int, settings: GroundedSettings, seed: int) -> tuple[list[tuple], list[int]]:
    """(n (task, (passage texts, task text), indices of its passages) drawn with random.Random(seed),
    the shuffled passage order they were drawn in): the draws of every kind but back_translate as they
    always were; back_translate's text is its first pass (into German)."""
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    out = []
    k = settings.passages
    for j in range(n):
        at = [order[(j * k + t) % len(order)] for t in range(k)]
        picks = [passages[i] for i in at]
        task = settings.tasks[rng.randrange(len(settings.tasks))]
        asked = picks[rng.randrange(k)] if k > 1 else picks[0]  # the question one passage answered
        question = asked.prompt.messages[-1]["content"]  # a Prompt ends with the user turn it asks
        texts = tuple(c.response.strip() for c in picks)
        language = LANGUAGES[rng.randrange(len(LANGUAGES))]  # drawn for every kind: the draws as they were
        template = task
        if task == "back_translate":  # its first pass: the translate task of opening sentences, into German
            template, language, texts = "translate", BACK_FROM, tuple(excerpt(t) for t in texts)
        text = GROUNDED_TASKS[template].format(passage="\n\n".join(texts), question=question.strip(),
                                               language=language)
        out.append((task, (texts, text), tuple(at)))
    return out, order


def _back_translated(drawn: list[tuple], passages: list[Conversation], order: list[int],
                     settings: GroundedSettings, answer: Answer | None) -> list[tuple]:
    """drawn with each back_translate's first pass answered by the target and replaced by its second
    pass: the German response, stripped, as the passage of GROUNDED_TASKS' back_translate prompt.

    One with German under half as long as its English (german_chars) is dropped. One whose German was cut at
    max_new_tokens, or whose source answer was, takes (in task order) the German of the next spare
    group of answers in `order` (after the n draws, cycling once; complete answers, none a source of a
    drawn back_translate) whose first pass finished with at least german_chars. The first call asks the
    drawn first passes (those over complete answers) and one spare per task drawn over a cut answer;
    each further call (at most REDRAW_ROUNDS) asks enough spares for the tasks still waiting at the
    failure rate seen so far. Tasks still waiting after that, or when the spares run out, are dropped.
    """
    if answer is None:
        raise ValueError("data.grounded.tasks: back_translate needs the target to answer its first pass "
                         "(grounded_prompts(..., answer=...))")
    k = settings.passages
    firsts = [i for i, (task, _, _) in enumerate(drawn) if task == "back_translate"]
    sources = {p for i in firsts for p in drawn[i][2]}
    complete = [p for s in range(len(order)) if (p := order[(len(drawn) * k + s) % len(order)]) not in sources
                and not excerpt_cut(passages[p])]
    spares = [tuple(complete[j: j + k]) for j in range(0, len(complete) - k + 1, k)]
    waiting = [i for i in firsts if any(excerpt_cut(passages[p]) for p in drawn[i][2])]  # cut sources: never asked
    direct = [i for i in firsts if i not in waiting]
    out, short, cut, asked, failed, used = list(drawn), set(), len(waiting), 0, 0, 0
    for _ in range(1 + REDRAW_ROUNDS):
        rate = min(failed / asked, 0.9) if asked else 0.0
        take = spares[used: used + math.ceil(len(waiting) / (1 - rate))] if waiting else []
        used += len(take)
        if not direct and not take:
            break
        asks = [_task_prompt("back_translate-first", *drawn[i][1]) for i in direct] + [
            _first_pass(passages, group) for group in take]
        german = answer(asks)
        if len(german) != len(asks):
            raise RuntimeError(f"back_translate: {len(asks)} first passes asked, {len(german)} answered")
        usable = [not c.truncated and len(c.response.strip()) >= german_chars(a) for a, c in zip(asks, german)]
        for i, conv, ok in zip(direct, german, usable):
            if conv.truncated:
                waiting.append(i)
                cut += 1
            elif not ok:
                short.add(i)
            else:
                out[i] = _second_pass(drawn[i][2], conv)
        waiting.sort()
        for group, conv, ok in zip(take, german[len(direct):], usable[len(direct):]):
            if ok and waiting:
                out[waiting.pop(0)] = _second_pass(group, conv)
        asked, failed = asked + len(usable), failed + usable.count(False)
        direct = []
        if not waiting:
            break
    if short:
        log.warning("data.grounded: %d of %d back_translate first passes gave %s under half as long as the text "
                    "they translate; those tasks are dropped", len(short), len(firsts), BACK_FROM)
    if cut:
        log.info("data.grounded: %d of %d back_translate tasks had their %s or their source answer cut at "
                 "max_new_tokens; %d took a spare answer's %s (%d spares asked)", cut, len(firsts), BACK_FROM,
                 cut - len(waiting), BACK_FROM, used)
    if waiting:
        log.warning("data.grounded: %d back_translate tasks found no spare answer whose %s finished within "
                    "max_new_tokens (%d spares asked, %d more rounds); those tasks are dropped",
                    len(waiting), BACK_FROM, used, REDRAW_ROUNDS)
    gone = short | set(waiting)
    return [d for i, d in enumerate(out) if i not in gone]


def excerpt(text: str, limit: int = BACK_CHARS) -> str:
    """back_translate's source text: the opening sentences of `text` that fit in `limit` characters (a
    prefix of it, up to a sentence end: . ! or ? before white space), or, when the first sentence alone is
    longer, its words up to the limit."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[:limit + 1]  # a sentence end at `limit` is the white space right after it
    ends = [m.start() for m in SENTENCE_END.finditer(head)]
    if ends:
        return text[:ends[-1]]
    words = head.rsplit(None, 1)
    return (words[0] if len(words) > 1 else text[:limit]).rstrip()


def excerpt_cut(answer: Conversation) -> bool:
    """Whether back_translate's excerpt of `answer` runs into where it was cut at max_new_tokens: a cut
    answer's opening sentences are whole text when the excerpt ends before the answer does (in the
    eagle-mix smoke run 36 of 76 answers were cut at 192 tokens, most of them long past 300 characters)."""
    return answer.truncated and len(excerpt(answer.response)) == len(answer.response.strip())


def german_chars(first: Prompt) -> int:
    """The least German a first pass must give to be a passage: half the characters of what it
    translates (its target_text); less is an empty or broken translation."""
    return max(1, len("\n\n".join(first.target_text)) // 2)


def _first_pass(passages: list[Conversation], group: tuple[int, ...]) -> Prompt:
    """back_translate's first pass over passages[group]: the translate task into German, as _draw writes it."""
    texts = tuple(excerpt(passages[p].response) for p in group)  # excerpt strips
    return _task_prompt("back_translate-first", texts,
                        GROUNDED_TASKS["translate"].format(passage="\n\n".join(texts), language=BACK_FROM))


def _second_pass(group: tuple[int, ...], conv: Conversation) -> tuple:
    """The back_translate draw over the first pass `conv` (German of passages[group])."""
    text = conv.response.strip()
    return ("back_translate", ((text,), GROUNDED_TASKS["back_translate"].format(passage=text)), group)


def _task_prompt(task: str, texts: tuple[str, ...], text: str) -> Prompt:
    """The user turn `text`, category grounded-<task>, id grounded:<task>:<digest of text>."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return Prompt([{"role": "user", "content": text}], f"grounded-{task}", f"grounded:{task}:{digest}",
                  target_text=texts)
