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

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from blend.document import clean_text

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


def split_conversation(tokenizer, messages: Sequence[Message], default_system: str | None) -> tuple[str, str]:
    """The conversation's prompt text before and after the documents' place.

    `default_system` is used when the conversation has no system message (None: none,
    the chat template's own default applies). Without a chat template the messages are
    written as "Role: content" lines ending with "Assistant:".
    """
    dicts = [m.as_template_dict() for m in messages]
    if default_system is not None and not any(d["role"] == "system" for d in dicts):
        dicts.insert(0, {"role": "system", "content": clean_text(default_system)})
    marker = unique_marker([d["content"] for d in dicts])
    first_user = next(i for i, d in enumerate(dicts) if d["role"] == "user")
    dicts[first_user] = {"role": "user", "content": marker + dicts[first_user]["content"]}
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(f"{d['role'].capitalize()}: {d['content']}" for d in dicts) + "\n\nAssistant:"
    head, sep, tail = text.partition(marker)
    if not sep or marker in tail:
        raise ValueError("the chat template does not render the first user message verbatim; "
                         "documents cannot be placed in this conversation")
    return head, tail
