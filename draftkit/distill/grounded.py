"""Prompts grounded in a passage, built from the target's own answers.

Much of what a served model is asked works over text in the prompt: summarize this, answer from
these documents, translate, rewrite, list the key points. Its answers then reuse that text, and a
draft head only learns to predict the reuse if it trains on such prompts. Chat prompts alone
(Magpie's, or most chat sets) are short questions with nothing to draw on. So a share of the
training prompts (`data.grounded.fraction`) is built here from the responses the target already
gave to the plain prompts: each such response becomes the passage of a task, and the target then
answers the task like any other prompt (its answer is what the head learns).
"""
from __future__ import annotations

import hashlib
import random

from draftkit.config import GROUNDED_TASKS, GroundedSettings

from .regenerate import Conversation
from .sources import Prompt

LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")


def grounded_prompts(convs: list[Conversation], n: int, settings: GroundedSettings,
                     seed: int = 0) -> list[Prompt]:
    """n prompts, each a task over settings.passages responses of `convs` joined (each response
    used at most once while there are unused ones), deterministic in (convs, n, settings, seed).
    Each prompt names its passages as `target_text` (they are the target's own answers)."""
    passages = [c for c in convs if len(c.response.strip()) >= settings.min_chars]
    if n <= 0:
        return []
    if not passages:
        raise ValueError(f"data.grounded: no response of the {len(convs)} regenerated is at least "
                         f"{settings.min_chars} characters long to serve as a passage")
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
        text = GROUNDED_TASKS[task].format(passage="\n\n".join(texts), question=question.strip(),
                                  language=LANGUAGES[rng.randrange(len(LANGUAGES))])
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        out.append(Prompt([{"role": "user", "content": text}], f"grounded-{task}",
                          f"grounded:{task}:{digest}", target_text=texts))
    return out
