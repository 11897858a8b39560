"""Prompts grounded in a passage, built from the target's own answers.

Much of what a served model is asked works over text in the prompt: summarize this, answer from
these documents, translate, rewrite, list the key points. Its answers then reuse that text, and a
draft head only learns to predict the reuse if it trains on such prompts. Chat prompts alone
(Magpie's, or most chat sets) are short questions with nothing to draw on. So a share of the
training prompts (`data.grounded.fraction`) is built here from the responses the target already
gave to the plain prompts: each such response becomes the passage of a task, and the target then
answers the task like any other prompt (its answer is what the head learns).

One kind takes two passes: `back_translate` (Spec-Bench's translation prompts are German -> English,
while `translate` asks the target to write the other language). Its first pass asks the target to
translate a response into German (the `translate` task's wording); the target's German, exactly as it
answered, becomes the passage of a "Translate German to English: ..." prompt, which the target then
answers like every other task. The first pass is not trained on: it only makes the passage.
"""
from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable

from draftkit.config import GROUNDED_TASKS, GroundedSettings

from .regenerate import Conversation
from .sources import Prompt

log = logging.getLogger(__name__)
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")
BACK_FROM = "German"  # the language back_translate's first pass writes (Spec-Bench: WMT German -> English)

Answer = Callable[[list[Prompt]], list[Conversation]]  # the target answering prompts, in order


def grounded_prompts(convs: list[Conversation], n: int, settings: GroundedSettings,
                     seed: int = 0, answer: Answer | None = None) -> list[Prompt]:
    """n prompts, each a task over settings.passages responses of `convs` joined (each response
    used at most once while there are unused ones), deterministic in (convs, n, settings, seed) and,
    for back_translate, in what `answer` says to the first passes (all in one call; back_translate
    needs it). Each prompt names its passages as `target_text` (they are the target's own text).
    A back_translate whose German is shorter than settings.min_chars is dropped (logged)."""
    passages = [c for c in convs if len(c.response.strip()) >= settings.min_chars]
    if n <= 0:
        return []
    if not passages:
        raise ValueError(f"data.grounded: no response of the {len(convs)} regenerated is at least "
                         f"{settings.min_chars} characters long to serve as a passage")
    drawn = _draw(passages, n, settings, seed)
    if any(task == "back_translate" for task, _ in drawn):
        drawn = _back_translated(drawn, settings, answer)
    return [_task_prompt(task, texts, text) for task, (texts, text) in drawn]


def _draw(passages: list[Conversation], n: int, settings: GroundedSettings, seed: int) -> list[tuple]:
    """n (task, (passage texts, task text)) drawn with random.Random(seed): the draws of every kind
    but back_translate as they always were; back_translate's text is its first pass (into German)."""
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    out = []
    k = settings.passages
    for j in range(n):
        picks = [passages[order[(j * k + t) % len(order)]] for t in range(k)]
        task = settings.tasks[rng.randrange(len(settings.tasks))]
        asked = picks[rng.randrange(k)] if k > 1 else picks[0]  # the question one passage answered
        question = asked.prompt.messages[-1]["content"]  # a Prompt ends with the user turn it asks
        texts = tuple(c.response.strip() for c in picks)
        language = LANGUAGES[rng.randrange(len(LANGUAGES))]  # drawn for every kind: the draws as they were
        template = task
        if task == "back_translate":  # its first pass: the translate task, into German
            template, language = "translate", BACK_FROM
        text = GROUNDED_TASKS[template].format(passage="\n\n".join(texts), question=question.strip(),
                                               language=language)
        out.append((task, (texts, text)))
    return out


def _back_translated(drawn: list[tuple], settings: GroundedSettings, answer: Answer | None) -> list[tuple]:
    """drawn with each back_translate's first pass answered by the target (one `answer` call) and
    replaced by its second pass: the German response, stripped, as the passage of GROUNDED_TASKS'
    back_translate prompt; one with less than settings.min_chars of German is dropped."""
    if answer is None:
        raise ValueError("data.grounded.tasks: back_translate needs the target to answer its first pass "
                         "(grounded_prompts(..., answer=...))")
    firsts = [i for i, (task, _) in enumerate(drawn) if task == "back_translate"]
    german = answer([_task_prompt("back_translate-first", *drawn[i][1]) for i in firsts])
    if len(german) != len(firsts):
        raise RuntimeError(f"back_translate: {len(firsts)} first passes asked, {len(german)} answered")
    out, short = list(drawn), set()
    for i, conv in zip(firsts, german):
        text = conv.response.strip()
        if len(text) < settings.min_chars:
            short.add(i)
        out[i] = ("back_translate", ((text,), GROUNDED_TASKS["back_translate"].format(passage=text)))
    if short:
        log.warning("data.grounded: %d of %d back_translate first passes gave under %d characters of %s; "
                    "those tasks are dropped", len(short), len(firsts), settings.min_chars, BACK_FROM)
    return [d for i, d in enumerate(out) if i not in short]


def _task_prompt(task: str, texts: tuple[str, ...], text: str) -> Prompt:
    """The user turn `text`, category grounded-<task>, id grounded:<task>:<digest of text>."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return Prompt([{"role": "user", "content": text}], f"grounded-{task}", f"grounded:{task}:{digest}",
                  target_text=texts)
