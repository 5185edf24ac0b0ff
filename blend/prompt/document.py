"""Documents: the passages a RAG request is answered over, and the one function that
turns a document into prompt text.

A document is a plain `str` or a `Document(text, id=..., title=...)`. Whatever the
entry point (the Python API, `kvblend ask --doc`, `kvblend ingest`, eval, the HTTP
server), `render_document` is the only place a document becomes text, so the same
passage always gives the same tokens and hits the same cache entries:

    render_document("  Some text.  ")                         == "Some text."
    render_document(Document("Some text.", title="A  title")) == "A title\\nSome text."
    render_document(Document("Some text.", id="doc-7"))       == "Some text."

- `text` is stripped; `title`, if any, has its whitespace collapsed to single spaces and
  becomes the first line. A titled document therefore renders exactly like the plain
  string "title\\ntext" (and differently from its untitled text: pass the title with
  every request that should reuse a titled ingest).
- `id` is a handle (for `delete_document`, for the server's DELETE and to warn when a
  request's version of a document differs from the ingested one); it is never rendered.
  It must round-trip through a URL path (`ID_RULE`: 1 to 256 characters, not all whitespace, no '/',
  no control characters, not '.' or '..'); `Document` refuses any other with ValueError.
  Without one the id is the content digest of the rendered text (`document_id`).
- Text is data, never structure: a lone surrogate becomes U+FFFD (the only change made
  to any character sequence), so every `str` can be tokenized.

The prompt layout (blend.prompt) follows each rendered document with a blank line.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Mapping, Set
from dataclasses import KW_ONLY, dataclass

_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Document:
    """A passage with an optional stable id and title (see the module docstring)."""

    text: str
    _: KW_ONLY
    id: str | None = None
    title: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Document.text must be a str, got {type(self.text).__name__}")
        for name in ("id", "title"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Document.{name} must be a str or None, got {type(value).__name__}")
        if self.id is not None:
            check_document_id(self.id, "Document.id")


MAX_ID_CHARS = 256
ID_RULE = (f"a document id is 1 to {MAX_ID_CHARS} characters, not all whitespace, without '/', control characters "
           "or unpaired surrogates, and is not '.' or '..' (it must round-trip through a URL path: "
           "DELETE /v1/documents/{id})")


def check_document_id(value: str, what: str = "document id") -> str:
    """`value` when it is a valid document id (`ID_RULE`); ValueError naming the rule otherwise."""
    if not value:
        raise ValueError(f"{what} is empty; leave it out (None) to use the content digest; {ID_RULE}")
    problem = None
    if not value.strip():
        problem = "is all whitespace"
    elif len(value) > MAX_ID_CHARS:
        problem = f"is {len(value)} characters long"
    elif "/" in value:
        problem = "holds a '/'"
    elif value in (".", ".."):
        problem = "is a path's dot segment"
    elif any(unicodedata.category(c) in ("Cc", "Cs") for c in value):
        problem = "holds a control character or an unpaired surrogate"
    if problem is not None:
        shown = repr(value[:40] + ("..." if len(value) > 40 else "")).encode("ascii", "backslashreplace").decode()
        raise ValueError(f"{what} {shown} {problem}: {ID_RULE}")
    return value


@dataclass(frozen=True)
class IngestedDocument:
    """What `BlendEngine.ingest` did with one document."""

    id: str  # the document's id, or its content digest (`document_id`)
    keys: tuple[str, ...]  # the store keys of its KV blocks, in order (none: an empty document, skipped)
    cached: bool  # it has blocks and every one already had a valid entry in some tier before the ingest
    # every block is held by some tier after the ingest (None: not checked, `sync=False`);
    # False for an empty document and when no tier accepted the writes (see the tiers' warnings)
    stored: bool | None = None

    def to_dict(self) -> dict[str, object]:
        return {"id": self.id, "keys": list(self.keys), "cached": self.cached, "stored": self.stored}


def clean_text(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD (valid text comes back unchanged).

    A Python str may hold code points that UTF-8 cannot encode (e.g. from
    `surrogateescape`); tokenizers reject them, so they become the replacement character.
    Surrogate pairs written as two code points are joined into the character they encode.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def render_document(document: Document | str) -> str:
    """The text a document contributes to a prompt: "title\\ntext" or "text" (stripped).

    Raises TypeError for anything but a str or a Document. May return "" (an empty
    document, which prompts skip with a warning).
    """
    if isinstance(document, str):
        return clean_text(document).strip()
    if not isinstance(document, Document):
        raise TypeError(f"a document must be a str or a blend.Document, got {type(document).__name__}")
    text = clean_text(document.text).strip()
    title = _SPACES.sub(" ", clean_text(document.title or "")).strip()
    return f"{title}\n{text}" if title else text


def document_id(document: Document | str) -> str:
    """The document's own id, else "sha256:" + the first 16 bytes (hex) of its rendered text's SHA-256."""
    if isinstance(document, Document) and document.id is not None:
        return document.id
    digest = hashlib.sha256(render_document(document).encode("utf-8")).hexdigest()
    return f"sha256:{digest[:32]}"


def check_documents(documents: object, what: str = "documents") -> tuple[Document | str, ...]:
    """Validate a sequence of documents (str, Document, or a mapping with "text" and
    optional "id"/"title", which becomes a Document).

    Raises TypeError for a str, bytes or mapping passed where the list is expected, for
    a non-iterable, and for any element of another type (naming its index).
    """
    if isinstance(documents, str | bytes | bytearray):
        raise TypeError(f"{what} must be a list of documents, got a single {type(documents).__name__}; "
                        f"wrap it in a list: [text]")
    if isinstance(documents, Mapping | Set) or not isinstance(documents, Iterable):
        order = " (a set has no order, and the order of documents is part of the prompt)" if isinstance(
            documents, Set) else ""
        raise TypeError(f"{what} must be a list of str or Document, got {type(documents).__name__}{order}")
    out: list[Document | str] = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str | Document):
            out.append(doc)
        elif isinstance(doc, Mapping):
            unknown = sorted(set(doc) - {"text", "id", "title"})
            if unknown or "text" not in doc:
                raise TypeError(f"{what}[{i}]: a document mapping needs 'text' and may have 'id' and 'title'"
                                + (f"; unknown keys: {', '.join(map(str, unknown))}" if unknown else ""))
            out.append(Document(doc["text"], id=doc.get("id"), title=doc.get("title")))
        else:
            raise TypeError(f"{what}[{i}] must be a str or a blend.Document, got {type(doc).__name__}")
    return tuple(out)
