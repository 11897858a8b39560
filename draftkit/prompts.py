"""Prompt records -> chat messages: the record shapes every prompt file or dataset may take.

Dependency-free on purpose: the trainer's loader (distill/sources.py, through `datasets`) and
`draftkit eval`'s file reader (inference/evaluate.py, core dependencies only) both use it.

| shape      | keys                                      | what becomes the prompt                       |
| ---------- | ----------------------------------------- | --------------------------------------------- |
| ShareGPT   | `conversations[{from, value}]`            | turns up to the last user turn (see below)    |
| OpenAI     | `messages[{role, content}]`               | turns up to the last user turn (see below)    |
| MT-bench   | `turns[str]` (+ `category`)               | the first turn only                           |
| plain      | `prompt`                                  | the prompt                                    |
| Alpaca     | `instruction` (+ `input`, or `instances`) | instruction, a blank line, then the input     |
| text       | `text`                                    | the text (a user turn, or raw completion text) |

Raw text (base models, completion mode: `data.format: text`) also comes from plain files, read by
`read_text_prompts`: `.txt` / `.md` files give one prompt per paragraph (blank-line separated), any
other text file (code) one prompt per file, a directory every such file under it. In completion
mode a prompt's text is fed as is (`completion_text`), with no chat template.

Multi-turn conversations keep their earlier turns, the dataset's own assistant replies included, as
context: only the reply to the last user turn is answered by the target (the earlier replies are
masked out of the training loss in distill/samples.py). MT-bench style `turns` hold user turns
only, with no replies to put between them, so only the first is used. The reply to the last user
turn, when a ShareGPT / OpenAI record has one (`to_reply`), is what data.responses.mode: keep trains on.
"""
from __future__ import annotations

from collections.abc import Collection

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "model": "assistant", "bing": "assistant",
    "system": "system",
}
# Keys a record's own id may sit under, first found wins (else the record's index is used).
ID_KEYS = ("id", "question_id", "conversation_id", "prompt_id")
# The key that marks each shape, in the order they are tried.
SHAPES = ("conversations", "messages", "turns", "prompt", "instruction", "text")
_SHAPE_NAMES = "conversations (ShareGPT), messages (OpenAI), turns (MT-bench), prompt, instruction (Alpaca), text"


def detect_shape(keys: Collection[str], path: str) -> str:
    """The shape of records with these keys (a dataset's columns); ValueError naming path and keys."""
    shape = find_shape(keys)
    if shape is None:
        raise ValueError(no_prompts_message(path, keys))
    return shape


def find_shape(keys: Collection[str]) -> str | None:
    """The first of SHAPES among `keys` (a record's keys or a dataset's columns), or None."""
    return next((s for s in SHAPES if s in keys), None)


def no_prompts_message(path, keys: Collection[str]) -> str:
    return f"{path}: no usable prompts; keys found: {sorted(keys)}; expected one of {_SHAPE_NAMES}"


def record_messages(r: dict) -> list[dict] | None:
    """One record of any shape -> `to_messages`, or None when no shape's key is present."""
    shape = find_shape(r)
    return None if shape is None else to_messages(shape, r)


def to_messages(shape: str, r: dict) -> list[dict] | None:
    """One record -> chat messages ending with a non-empty user turn, or None to drop it."""
    if shape == "conversations":
        msgs = [{"role": ROLES.get(str(t.get("from")).lower()), "content": t.get("value")}
                for t in r["conversations"] or []]
    elif shape == "messages":
        msgs = [{"role": ROLES.get(str(t.get("role")).lower()), "content": t.get("content")}
                for t in r["messages"] or []]
    elif shape == "turns":
        msgs = [{"role": "user", "content": (r["turns"] or [None])[0]}]
    elif shape in ("prompt", "text"):
        msgs = [{"role": "user", "content": r[shape]}]
    else:
        msgs = [{"role": "user", "content": _alpaca_text(r)}]
    if any(m["role"] is None or not isinstance(m["content"], str) for m in msgs):
        return None
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None or not msgs[last_user]["content"].strip():
        return None
    return msgs[: last_user + 1]


# ---- raw text (completion mode) ------------------------------------------------------------------
# Files read as paragraphs; any other text file (code, ...) is one prompt as a whole.
PARAGRAPH_SUFFIXES = (".txt", ".md", ".text")
# Longest raw-text prompt in characters: a longer paragraph or file is cut at the last line break
# before it (a completion prompt is the start of a document; the target writes the continuation).
TEXT_PROMPT_CHARS = 2000


def read_text_prompts(path, max_chars: int = TEXT_PROMPT_CHARS) -> list[tuple[str, str]]:
    """(id, text) raw-text prompts of a file or a directory of files (see the module docstring).

    ValueError naming the path when it holds no text; files that are not UTF-8 text inside a
    directory are skipped, a single such file is an error."""
    from pathlib import Path

    root = Path(path)
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.is_file() and not any(
            part.startswith(".") for part in f.relative_to(root).parts))
    elif root.is_file():
        files = [root]
    else:
        raise FileNotFoundError(f"raw-text prompts: no such file or directory: {root}")
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            if f == root:
                raise ValueError(f"{f}: not a UTF-8 text file") from None
            continue
        label = f.relative_to(root).as_posix() if f != root else f.stem
        if f.suffix in PARAGRAPH_SUFFIXES:
            pieces = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
        else:
            pieces = [text.rstrip()]
        out += [(f"{label}:{i}", cut_text(p, max_chars)) for i, p in enumerate(pieces) if p.strip()]
    if not out:
        raise ValueError(f"{root}: no raw-text prompts (empty files, or no UTF-8 text files)")
    return out


def cut_text(text: str, max_chars: int) -> str:
    """`text` up to max_chars, cut at the last line break before the limit when there is one."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    return head[: head.rindex("\n")] if "\n" in head else head


def completion_text(messages: list[dict]) -> str:
    """The raw text a completion-mode prompt feeds the target: the turns' contents, blank-line joined
    (one turn for every raw-text source; `draftkit eval`'s encode joins them the same way)."""
    return "\n\n".join(m["content"] for m in messages)


def to_reply(shape: str, r: dict) -> str | None:
    """The record's own reply to its last user turn (the assistant turn right after it), or None.

    Only ShareGPT and OpenAI-messages records carry replies; the other shapes give None.
    """
    if shape not in ("conversations", "messages"):
        return None
    turns = r[shape] or []
    role_key, text_key = ("from", "value") if shape == "conversations" else ("role", "content")
    roles = [ROLES.get(str(t.get(role_key)).lower()) for t in turns]
    last_user = max((i for i, role in enumerate(roles) if role == "user"), default=None)
    if last_user is None or last_user + 1 >= len(turns) or roles[last_user + 1] != "assistant":
        return None
    text = turns[last_user + 1].get(text_key)
    return text if isinstance(text, str) and text.strip() else None


def record_id(r: dict, index: int):
    """The record's own id (first of ID_KEYS present), else its index."""
    return next((r[k] for k in ID_KEYS if r.get(k) is not None), index)


def _alpaca_text(r: dict) -> str | None:
    instruction = r.get("instruction")
    extra = r.get("input")
    if extra is None and r.get("instances"):  # stanford_alpaca seed_tasks: instances[0].input
        extra = r["instances"][0].get("input")
    if not instruction:
        return None
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


# Special tokens that close a chat turn in common templates (ChatML, Llama 3, Gemma, Phi).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def end_of_turn_ids(tokenizer) -> set[int]:
    """Token ids that close a chat turn: EOS plus the usual end-of-turn specials in the vocab."""
    ids = {tokenizer.eos_token_id}
    for tok in END_OF_TURN_TOKENS:
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    ids.discard(None)
    return ids


def stop_token_ids(model, tokenizer) -> list[int]:
    """Token ids that end a response: end-of-turn ids plus the EOS of the config and generation config."""
    ids = end_of_turn_ids(tokenizer) if tokenizer is not None else set()
    for src in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        e = getattr(src, "eos_token_id", None)
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    ids.discard(None)
    return sorted(ids)
