"""Prompt assembly: a fixed instruction part, the documents, then the query, laid out as
token ids through the model's chat template; and the prompt templates per task (the one
source used by the engine, the CLI and eval).

Each document is tokenized on its own and the ids are concatenated, so a document's
tokens are identical standalone and inside any prompt (no boundary re-tokenization).
Each document is one `document` segment: its KV is computed as one sequence (later
tokens see earlier ones) and stored block by block (blend.documents). A document longer
than `max_document_tokens` - capped to what fits the model's positions after the fixed
system part - is split on token boundaries into consecutive documents of that many
tokens (the last one shorter); each part is computed on its own. `max_document_tokens` is
capped to the model's positions, and a document that cannot fit them with the fixed parts
(`check_documents_fit`) is refused at ingest: no request could use it.
"""

from __future__ import annotations

import functools
import logging
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from blend.prompt.conversation import (
    TOKENIZER_LOCK,
    Message,
    encode,
    encode_with_holes,
    special_strings,
    split_conversation,
    start_ids,
    unique_marker,
)
from blend.prompt.document import Document, clean_text, render_document

log = logging.getLogger(__name__)

PLACEHOLDERS = frozenset({"question"})
# check_text_fits samples this many characters per position of a long text (English runs ~4-5
# characters per token, so a window of 8 that still fits the positions is rare text)
_SAMPLE_CHARS_PER_POSITION = 8
_SAMPLE_MARGIN_TOKENS = 8  # how many more tokens a text's first word may take alone than after a template

SegmentKind = Literal["prefix", "document", "query"]


@dataclass(frozen=True)
class PromptTemplate:
    """One task's prompt: `system` precedes the passages, `query` follows them."""

    system: str
    query: str

    def __post_init__(self) -> None:
        for name in ("system", "query"):
            text = getattr(self, name)
            try:
                used = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
            except ValueError as exc:
                raise ValueError(f"prompt {name}: {exc}; write a literal brace as {{{{ or }}}}") from None
            allowed = PLACEHOLDERS if name == "query" else frozenset()
            unknown = sorted(used - allowed)
            if unknown:
                valid = ", ".join("{" + p + "}" for p in sorted(allowed)) or "none"
                raise ValueError(
                    f"prompt {name}: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; "
                    f"valid placeholders: {valid} (write a literal brace as {{{{ or }}}})"
                )

    def render_query(self, question: str = "") -> str:
        """The query with {question} filled in."""
        return self.query.format(question=question)

    def render_system(self) -> str:
        """The system instruction with doubled braces unescaped."""
        return self.system.format()


QA = PromptTemplate(
    system=(
        "You are given several passages and then a question about them. Answer using only the passages. "
        "Reply with the answer alone, in at most five words, and do not repeat the question."
    ),
    query="Question: {question}\nShort answer (five words at most):",
)
SUMMARIZATION = PromptTemplate(
    system=(
        "You are given one or more documents. Write a short, faithful summary of them in a few sentences, "
        "without adding facts that the documents do not state."
    ),
    query="Summary of the documents above:",
)


TEMPLATES: dict[str, PromptTemplate] = {"qa": QA, "summarization": SUMMARIZATION}


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens. `prefix` and `document` segments are cacheable; `query` is always computed."""

    kind: SegmentKind
    token_ids: tuple[int, ...]
    start: int  # position of the first token in the prompt
    doc_index: int = -1  # which input document a document segment comes from (several for a split one)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prefix(self) -> Segment:
        return self.segments[0]

    @property
    def documents(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind == "document")

    @property
    def query(self) -> Segment:
        return self.segments[-1]


def prompt_text(tokenizer, prompt: Prompt) -> str:
    """The prompt as text: its ids decoded, special tokens as their strings (what an OpenAI-style
    /v1/completions takes). Tokenized again as one text it may not give the same ids: kvblend
    tokenizes each document alone, so a document's closing blank line and the next word can
    split differently there (SmolLM2: "\\n\\n" + "The" becomes "\\n" + "\\n" + "The")."""
    with TOKENIZER_LOCK:
        return tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class PromptBuilder:
    """Builds prompts for one tokenizer and one instruction/query template."""

    def __init__(self, tokenizer, system_prompt: str, query_template: str, max_document_tokens: int = 4096,
                 max_positions: int | None = None):
        if max_document_tokens < 1:
            raise ValueError(f"max_document_tokens must be >= 1, got {max_document_tokens}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.query_template = query_template
        # a part longer than the model's positions could never be computed: capped to them
        self.max_document_tokens = min(max_document_tokens, max_positions or max_document_tokens)
        self.max_positions = max_positions  # the model's: a document part must fit them after the fixed part

    @functools.cached_property
    def _special_strings(self) -> tuple[str, ...]:
        return special_strings(self.tokenizer)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters (byte-level entries count bytes): no
        token covers more characters of text than this."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1)

    def check_text_fits(self, question: str | Sequence[Message], documents: Sequence[Document | str],
                        positions: int, fix: str = "use fewer or shorter documents") -> None:
        """Refuse, before tokenizing it whole, text that cannot fit `positions` tokens: more
        characters than positions x the longest token, or a text whose first
        positions x 8 characters already hold more tokens (tokenizing megabytes takes
        seconds); the error ends with `fix`. Text that passes may still be refused once
        tokenized."""
        texts = [question] if isinstance(question, str) else [m.content for m in question]
        texts += [t for d in documents for t in ((d,) if isinstance(d, str) else (d.text, d.title or ""))]
        chars = sum(len(t) for t in texts)
        if chars > positions * self.max_token_chars:
            raise ValueError(f"the prompt's text ({chars} characters) cannot fit the model's {positions} positions "
                             f"(at most {self.max_token_chars} characters per token); {fix}")
        # Under that bound a text can still be megabytes. A text longer than the window is
        # sampled: the tokens of its first `window` characters, cut at a space (every word
        # before the cut is tokenized as in the whole text), are a floor on its own tokens.
        window = positions * _SAMPLE_CHARS_PER_POSITION
        floor = 0
        for text in texts:
            if len(text) > window and (cut := text.rfind(" ", 0, window)) > 0:
                floor += max(0, len(encode(self.tokenizer, text[:cut], data=True)) - _SAMPLE_MARGIN_TOKENS)
                if floor > positions:
                    raise ValueError(f"the prompt's text ({chars} characters) cannot fit the model's {positions} "
                                     f"positions (its first {window} characters of one text alone are more tokens); "
                                     f"{fix}")

    def frame(self, question: str | Sequence[Message]) -> tuple[list[int], list[int]]:
        """Token ids before and after the documents for this question (or conversation,
        blend.conversation: the configured system prompt when it has none). Without a chat
        template the head starts with the tokenizer's BOS where it puts one (`start_ids`)."""
        if not isinstance(question, str):
            head, tail, holes = split_conversation(self.tokenizer, question, self.system_prompt)
            return (start_ids(self.tokenizer) + encode_with_holes(self.tokenizer, head, holes),
                    encode_with_holes(self.tokenizer, tail, holes))
        question = clean_text(question)
        literal = any(s in question for s in self._special_strings)
        # a question holding a special token's string is cut out and encoded as data (the
        # cut sits where the pre-tokenizer splits anyway: before the space that leads it)
        hole = unique_marker([question, self.query_template, self.system_prompt]) if literal else ""
        query = self.query_template.format(question=hole or question)
        marker = unique_marker([query, self.system_prompt, question])
        user = marker + query
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = f"{self.system_prompt}\n\n{user}\nAnswer:"
        head, tail = text.split(marker)
        return start_ids(self.tokenizer) + encode(self.tokenizer, head), encode_with_holes(self.tokenizer, tail, {hole: question} if literal else {})

    def document_ids(self, document: str) -> list[int]:
        """A document's own token ids (stripped text plus a blank line that ends it)."""
        return encode(self.tokenizer, document.strip() + "\n\n", data=True)  # text is data, not structure

    def document_limit(self, head: int) -> int:
        """The most tokens of one document part after a fixed part of `head` tokens:
        `max_document_tokens`, capped so that the part fits the model's positions after it
        (a document is computed after the system part). ValueError when no token fits."""
        if self.max_positions is None:
            return self.max_document_tokens
        room = self.max_positions - head
        if room < 1:
            raise ValueError(f"the prompt's fixed part ({head} tokens: system prompt and template) leaves none of the "
                             f"model's {self.max_positions} positions for documents; shorten the system prompt")
        return min(self.max_document_tokens, room)

    def split(self, ids: list[int], limit: int | None = None) -> list[tuple[int, ...]]:
        """A document's ids as parts of at most `limit` (default `max_document_tokens`) tokens
        (one part when it fits)."""
        n = self.max_document_tokens if limit is None else limit
        if len(ids) > n:
            log.debug("document of %d tokens split into parts of %d (max_document_tokens)", len(ids), n)
        return [tuple(ids[i : i + n]) for i in range(0, len(ids), n)]

    def check_documents_fit(self, prompt: Prompt, names: Sequence[str]) -> None:
        """Refuse a document that no request could use: its tokens with the prompt's fixed part
        (the tokens before the documents and after them) exceed the model's positions. `prompt`
        holds the documents (e.g. an ingest's); `names[i]` names its i-th non-empty document in
        the error. Nothing when the model's positions are unknown."""
        if self.max_positions is None:
            return
        fixed = len(prompt.prefix.token_ids) + len(prompt.query.token_ids)
        tokens = [0] * len(names)
        for seg in prompt.documents:
            tokens[seg.doc_index] += len(seg.token_ids)
        for name, n in zip(names, tokens, strict=True):
            if fixed + n > self.max_positions:
                raise ValueError(f"{name} is {n} tokens: with the prompt's fixed part ({fixed} tokens: system prompt "
                                 f"and template) it cannot fit the model's {self.max_positions} positions, so no "
                                 f"request could use it; split it into documents of at most "
                                 f"{max(self.max_positions - fixed, 0)} tokens")

    def clean_documents(self, documents: list[str]) -> list[str]:
        """Drop empty documents with a warning."""
        kept = [d for d in documents if isinstance(d, str) and d.strip()]
        if len(kept) < len(documents):
            log.warning("skipped %d empty document(s)", len(documents) - len(kept))
        return kept

    def build(self, question: str | Sequence[Message], documents: Sequence[Document | str]) -> Prompt:
        """Lay out [prefix][documents...][query]; positions are explicit per segment.

        `question` is a question (the QA template) or a checked conversation
        (blend.conversation); each document is rendered by blend.document.render_document.
        """
        if isinstance(question, str) and not question.strip():
            raise ValueError("empty query: pass a non-empty question")
        documents = [render_document(d) for d in documents]
        head, tail = self.frame(question)
        segments = [Segment("prefix", tuple(head), 0)]
        pos = len(head)
        limit = self.document_limit(len(head)) if documents else self.max_document_tokens
        for d, doc in enumerate(self.clean_documents(documents)):
            for piece in self.split(self.document_ids(doc), limit):
                segments.append(Segment("document", piece, pos, d))
                pos += len(piece)
        segments.append(Segment("query", tuple(tail), pos))
        ids = tuple(t for s in segments for t in s.token_ids)
        return Prompt(ids, tuple(segments))
