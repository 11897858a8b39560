"""Completion mode, for targets without a chat template (base models, code completion).

`data.format: text`: a prompt is raw text fed to the target as is (its tokenizer's own special
tokens, e.g. BOS, and no template); the response is the target's continuation, ended by EOS or
max_new_tokens; the loss covers exactly the continuation (and the EOS that ended it). With
`data.format: auto` (the default) a target whose tokenizer has no chat template is trained this
way, and the log says so. The samples (prompt ids, then the continuation's, the loss on the
continuation) are distill/samples.py's `tokenize_completion`.
"""
from __future__ import annotations

import logging

from draftkit.prompts import completion_text

log = logging.getLogger(__name__)
FORMATS = ("auto", "chat", "text")


def resolve_format(fmt: str, tokenizer, target_name: str) -> str:
    """"chat" or "text" for `data.format` = fmt on this tokenizer; ValueError naming the field."""
    if fmt not in FORMATS:
        raise ValueError(f"data.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt == "chat" and not has_template:
        raise ValueError(f"data.format: chat, but the tokenizer of target {target_name} has no chat template "
                         "(a base model?); use data.format: text (completion: raw-text prompts, the target's "
                         "continuations) or auto")
    if fmt == "auto":
        fmt = "chat" if has_template else "text"
        if fmt == "text":
            log.warning("target %s has no chat template: training in completion mode (data.format: text): "
                        "prompts are raw text, responses the target's continuations", target_name)
    return fmt


def completion_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a raw-text prompt: the tokenizer's own encoding (its BOS, if it adds one)."""
    return list(tokenizer(completion_text(messages))["input_ids"])
