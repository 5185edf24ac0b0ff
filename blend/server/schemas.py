"""Request bodies (pydantic) and response bodies (OpenAI's shapes) of the HTTP server.

Requests follow OpenAI's chat completions and completions APIs; unknown top-level
fields are ignored (as OpenAI-compatible servers do), kvblend's own fields are strict.
RAG extensions: `documents` (placed before the conversation, or before the question
for /v1/completions) and `kvblend` (mode, recompute ratio, selection). Numbers are
strict: `true` is not 1, 2.9 is not a token count. Values are checked once more by the
engine (blend.request), so the Python API and the server accept the same requests.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from blend.decode.result import GenerationResult
from blend.prompt.conversation import Message
from blend.prompt.document import Document

Number = StrictFloat | StrictInt
Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None


class DocumentIn(BaseModel):
    """A document of a request: `text`, and optionally a stable `id` and a `title`."""

    model_config = ConfigDict(extra="forbid")
    text: StrictStr
    id: StrictStr | None = Field(None, min_length=1)
    title: StrictStr | None = None

    def to_document(self) -> Document:
        return Document(self.text, id=self.id, title=self.title)


class KVBlendOptions(BaseModel):
    """How the engine treats the documents: mode, recompute ratio, token selection."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["full", "reuse", "prefix", "blend"] = "blend"
    recompute_ratio: Number | None = None
    selection: StrictStr | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ... are ignored
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    def to_message(self) -> Message:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return Message(self.role, content or "")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


# OpenAI request fields this server does not implement: accepted only at their neutral
# value (clients send them by default); anything else is refused rather than silently ignored
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}


class _Generation(BaseModel):
    """Fields shared by both generation endpoints. Other OpenAI fields are ignored (user,
    metadata, ...), except those of UNSUPPORTED set to something other than their neutral value."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    stop: Stop = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    documents: list[DocumentIn] = Field(default_factory=list, max_length=1024)
    kvblend: KVBlendOptions = Field(default_factory=KVBlendOptions)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Generation:
        for name, value in (self.model_extra or {}).items():
            neutral = UNSUPPORTED.get(name)
            if neutral is not None and value not in neutral:
                raise ValueError(f"{name}={value!r} is not supported by this server; leave it out")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `BlendEngine.generate_stream` (None: the config's default)."""
        return {"mode": self.kvblend.mode, "recompute_ratio": self.kvblend.recompute_ratio,
                "selection": self.kvblend.selection, "max_new_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "stop": self.stop}


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs = super().engine_kwargs()
        if kwargs["max_new_tokens"] is None:
            kwargs["max_new_tokens"] = self.max_completion_tokens
        return kwargs


class CompletionRequest(_Generation):
    # a text, a list of one text, or token ids (these only under `--completions-prompt raw`)
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | Annotated[
        list[StrictInt], Field(min_length=1)]

    def question(self) -> str | list[int]:
        """The text (or the token ids) the prompt holds."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else self.prompt


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: list[DocumentIn] = Field(min_length=1, max_length=1024)


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(result: GenerationResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


def kvblend_stats(result: GenerationResult, queued_s: float) -> dict[str, Any]:
    """The per-response `kvblend` object: the request's statistics (RequestStats.to_dict),
    the time it waited for the engine, and any warnings (e.g. a changed document)."""
    return {**result.stats.to_dict(), "queue_s": queued_s, "finish_reason": result.finish_reason,
            "warnings": list(result.warnings)}


def chat_completion(rid: str, model: str, result: GenerationResult, queued_s: float) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result), "kvblend": kvblend_stats(result, queued_s)}


def completion(rid: str, model: str, result: GenerationResult, queued_s: float) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result), "kvblend": kvblend_stats(result, queued_s)}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish_reason: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], **extra}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None = None,
                     **extra: Any) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}], **extra}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
