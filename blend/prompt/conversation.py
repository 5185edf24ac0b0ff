"""Conversations as prompts: chat messages rendered through the model's chat template
with the documents' place marked, split into the text before and after the documents.

Documents go before the conversation: at the start of the first user message, after
the system message (and anything else that precedes the first user message). A
single-turn conversation [system S, user Q] with documents therefore lays out exactly
like `generate(Q, documents)` with system prompt S and the query template "{question}".

The place of the documents is found with a marker that occurs in none of the texts
rendered around it, so no character sequence in a message can act as structure.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from blend.prompt.document import clean_text

ROLES = ("system", "developer", "user", "assistant")
_BASE_MARKER = "\x00KVBLEND-DOCUMENTS\x00"


@dataclass(frozen=True)
class Message:
    """One chat message; `developer` is accepted as OpenAI's name for a system message."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not supported; use one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise TypeError(f"message content must be a str, got {type(self.content).__name__}")

    def as_template_dict(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": clean_text(self.content)}


def check_messages(messages: object) -> tuple[Message, ...]:
    """Validate a conversation: a non-empty list of Message or {"role", "content"} mappings
    with at least one user message. TypeError/ValueError naming the message at fault."""
    if isinstance(messages, str | bytes) or isinstance(messages, Mapping) or not isinstance(messages, Iterable):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} mappings or Message, "
                        f"got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Message):
            out.append(m)
        elif isinstance(m, Mapping):
            if "role" not in m or "content" not in m:
                raise TypeError(f"messages[{i}] needs 'role' and 'content'")
            try:
                out.append(Message(m["role"], m["content"]))
            except (TypeError, ValueError) as err:
                raise type(err)(f"messages[{i}]: {err}") from None
        else:
            raise TypeError(f"messages[{i}] must be a mapping with 'role' and 'content' or a Message, "
                            f"got {type(m).__name__}")
    if not any(m.role == "user" for m in out):
        raise ValueError("messages need at least one user message")
    if not out[-1].content.strip() and out[-1].role == "user":
        raise ValueError("the last user message is empty; pass some text")
    return tuple(out)


def unique_marker(texts: Iterable[str]) -> str:
    """A marker string that occurs in none of `texts` (the fixed one when it is free)."""
    texts = list(texts)
    marker = _BASE_MARKER
    while any(marker in t for t in texts):
        marker = f"\x00KVBLEND-DOCUMENTS-{secrets.token_hex(8)}\x00"
    return marker


def special_strings(tokenizer) -> tuple[str, ...]:
    """The strings of the tokenizer's special (control) tokens, e.g. "<|im_start|>"."""
    return tuple(t for t in getattr(tokenizer, "all_special_tokens", ()) if t)


def hole_literals(tokenizer, dicts: Sequence[Mapping[str, str]]) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The messages with each content that holds a special token's string swapped for a
    unique hole, and {hole: content}: rendered through the template as a hole, the content
    is then encoded as data (`encode_with_holes`), never as control tokens."""
    specials = special_strings(tokenizer)
    texts = [d["content"] for d in dicts]
    holes: dict[str, str] = {}
    out = []
    for d in dicts:
        if any(s in d["content"] for s in specials):
            hole = unique_marker([*texts, *holes])
            holes[hole] = d["content"]
            out.append({**d, "content": hole})
        else:
            out.append(dict(d))
    return out, holes


# A fast tokenizer's `split_special_tokens` is a switch on the one Rust tokenizer that every
# thread shares (transformers flips it for the call and back): two threads encoding at once,
# one as data and one as template, would each see the other's setting (a template's
# <|im_start|> split into text), and a decode beside the switch fails to borrow it. Every encode
# and decode goes through this lock.
TOKENIZER_LOCK = threading.Lock()


def encode(tokenizer, text: str, *, data: bool = False) -> list[int]:
    """Token ids of `text` (no BOS/EOS). `data`: user text, whose special-token strings
    (e.g. "<|im_start|>") stay text instead of becoming control tokens. Thread-safe."""
    if not text:
        return []
    with TOKENIZER_LOCK:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=data).input_ids)


def encode_with_holes(tokenizer, text: str, holes: Mapping[str, str]) -> list[int]:
    """Token ids of template `text` whose holes stand for user contents: the template parts
    as usual (their special tokens are structure), each content with split_special_tokens
    (its special-token strings stay text). The cut before a content moves the spaces that
    lead it into the content: the pre-tokenizer splits there anyway."""
    if not holes:
        return encode(tokenizer, text)
    ids: list[int] = []
    pos = 0
    for match in re.finditer("|".join(map(re.escape, holes)), text):
        piece = text[pos : match.start()]
        template = piece.rstrip(" ")
        ids += encode(tokenizer, template) + encode(tokenizer, piece[len(template) :] + holes[match.group()], data=True)
        pos = match.end()
    return ids + encode(tokenizer, text[pos:])


def start_ids(tokenizer) -> list[int]:
    """The ids a prompt starts with where no chat template renders them: the BOS of a
    tokenizer that puts one before its texts (a base model such as Gemma 3), else none."""
    if getattr(tokenizer, "chat_template", None):
        return []
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = list(tokenizer("", add_special_tokens=True).input_ids)
    return ids if bos is not None and ids == [bos] else []


def plain_chat(dicts: Sequence[Mapping[str, str]]) -> str:
    """A conversation as text for a model without a chat template: "Role: content" blocks
    ending with "Assistant:"."""
    return "\n\n".join(f"{d['role'].capitalize()}: {d['content']}" for d in dicts) + "\n\nAssistant:"


def chat_ids(tokenizer, dicts: Sequence[Mapping[str, str]]) -> list[int]:
    """The chat template's prompt ids for `dicts` (with the generation prompt); contents
    holding special-token strings are encoded as data. Without a chat template: the
    tokenizer's BOS (`start_ids`) and `plain_chat`."""
    dicts, holes = hole_literals(tokenizer, dicts)
    if not getattr(tokenizer, "chat_template", None):
        return start_ids(tokenizer) + encode_with_holes(tokenizer, plain_chat(dicts), holes)
    if not holes:
        with TOKENIZER_LOCK:
            return list(tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
    text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True)
    return encode_with_holes(tokenizer, text, holes)


def split_conversation(tokenizer, messages: Sequence[Message], default_system: str | None
                       ) -> tuple[str, str, dict[str, str]]:
    """The conversation's prompt text before and after the documents' place, and the holes
    standing for contents that hold special-token strings (`hole_literals`; encode both
    texts with `encode_with_holes`).

    `default_system` is used when the conversation has no system message (None: none,
    the chat template's own default applies). Without a chat template the messages are
    written as "Role: content" lines ending with "Assistant:".
    """
    dicts = [m.as_template_dict() for m in messages]
    if default_system is not None and not any(d["role"] == "system" for d in dicts):
        dicts.insert(0, {"role": "system", "content": clean_text(default_system)})
    dicts, holes = hole_literals(tokenizer, dicts)
    marker = unique_marker([d["content"] for d in dicts])
    first_user = next(i for i, d in enumerate(dicts) if d["role"] == "user")
    dicts[first_user] = {"role": "user", "content": marker + dicts[first_user]["content"]}
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True)
    else:
        text = plain_chat(dicts)
    head, sep, tail = text.partition(marker)
    if not sep or marker in tail:
        raise ValueError("the chat template does not render the first user message verbatim; "
                         "documents cannot be placed in this conversation")
    return head, tail, holes
