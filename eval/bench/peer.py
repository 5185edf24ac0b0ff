"""The peer of `kvblend bench serve --peer URL`: any OpenAI-compatible server (llama.cpp's
llama-server, vLLM, SGLang, another `kvblend serve --completions-prompt raw`) given the same
requests as kvblend.

A peer does not know kvblend's documents API, so each request reaches it as one prompt text
built exactly as kvblend builds it (`prompt_texts`: the configured system part and chat
template, the documents in the request's order, the question; kvblend's own prompt ids
decoded, special tokens as their strings) and goes to its `/v1/completions` (the rendered
prompt: no second chat template), streamed, greedy (`temperature: 0`), with the same
`max_tokens`. The peer tokenizes the text itself: where that gives other ids than kvblend's
(a document boundary can split differently, blend.prompt.builder.prompt_text) its usage says
so, and a level's row counts the prompts it tokenized to kvblend's length
(`prompt_tokens_equal`). With `prompt="ids"` the peer gets kvblend's own token ids instead (an
OpenAI /v1/completions takes a list of token ids; the same model's vocabulary is assumed), so
its answers differ from kvblend's only by its numerics.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from eval.bench.sample import BenchRequest, Sample

# what a llama-server's /props says about its own settings, kept in the peer's rows
PROPS_KEYS = ("total_slots", "model_path", "build_info", "n_ctx")
PEER_PROMPTS = ("text", "ids")  # how a peer gets each prompt


@dataclass(frozen=True)
class Peer:
    """A running OpenAI-compatible server: where, its name in the rows, and its own settings
    (what whoever started it says, plus what its /props tells when it has one)."""

    url: str
    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    prompt: str = "text"  # one of PEER_PROMPTS

    def __post_init__(self) -> None:
        if self.prompt not in PEER_PROMPTS:
            raise ValueError(f"a peer's prompt is one of {', '.join(PEER_PROMPTS)}, got {self.prompt!r}")


@dataclass(frozen=True)
class PromptTexts:
    """The requests' prompts as text, and kvblend's own ids of each."""

    texts: list[str]
    ids: list[list[int]]

    @property
    def tokens(self) -> list[int]:
        return [len(ids) for ids in self.ids]


def prompt_texts(config: str | None, requests: list[BenchRequest]) -> PromptTexts:
    """Each request's prompt as `kvblend serve` (same config) builds it for the chat request the
    bench sends (one user message, the documents), as text. Loads the model's tokenizer only."""
    from blend.config import load_config
    from blend.model.loading import load_tokenizer, model_positions
    from blend.prompt.builder import PromptBuilder, prompt_text
    from blend.prompt.conversation import check_messages
    from blend.prompt.document import Document

    cfg = load_config(config)
    tokenizer = load_tokenizer(cfg.model)
    builder = PromptBuilder(tokenizer, cfg.engine.prompt.system_prompt, cfg.engine.prompt.query_template,
                            cfg.engine.blend.max_document_tokens, model_positions(cfg.model))
    texts, ids = [], []
    for req in requests:
        docs = [Document(d["text"], id=d.get("id"), title=d.get("title")) for d in req.documents]
        prompt = builder.build(check_messages([{"role": "user", "content": req.question}]), docs)
        texts.append(prompt_text(tokenizer, prompt))
        ids.append(list(prompt.token_ids))
    return PromptTexts(texts, ids)


def peer_model(http: httpx.Client, base: str) -> str | None:
    """The first model id the peer lists at /v1/models (None when it lists none); ValueError
    naming the fix when nothing answers there."""
    try:
        response = http.get(base + "/v1/models", timeout=30)
    except httpx.HTTPError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"no server answers at --peer {base} ({type(err).__name__}: {reason}); start it or fix "
                         "--peer") from None
    try:
        data = response.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def peer_props(http: httpx.Client, base: str) -> dict[str, Any]:
    """What the peer's /props (llama-server's) says of `PROPS_KEYS`, or {} without one."""
    try:
        props = http.get(base + "/props", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}
    if not isinstance(props, dict):
        return {}
    found = {k: props[k] for k in PROPS_KEYS if k in props}
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    if "n_ctx" not in found and n_ctx is not None:
        found["n_ctx"] = n_ctx
    return found


def send_completion(http: httpx.Client, base: str, index: int, prompt: str | list[int], max_tokens: int,
                    model: str | None) -> Sample:
    """One streamed, greedy /v1/completions of `prompt` (text or token ids); the client's timings, the answer, the
    tokens (the usage's, else one per content chunk) and the prompt's tokens (its usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    # a connection per request: llama-server (cpp-httplib) drops a kept-alive connection after a response
    # slower than its keep-alive timeout (5 s), and the next request on it would fail unsent
    headers = {"Connection": "close"}
    t0 = time.perf_counter()
    ttft = None
    arrivals: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] = {}
    finished = False
    try:
        with http.stream("POST", base + "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                return Sample(False, error=f"HTTP {response.status_code}", index=index)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    return Sample(False, error=error.get("type", "error") if isinstance(error, dict) else "error",
                                  index=index)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = choice.get("text") or ""
                if text:
                    arrivals.append(time.perf_counter())
                    parts.append(text)
                if ttft is None and (text or choice.get("finish_reason")):
                    ttft = time.perf_counter() - t0
                finished = finished or bool(choice.get("finish_reason"))
    except httpx.HTTPError as err:
        return Sample(False, error=type(err).__name__, index=index)
    e2e = time.perf_counter() - t0
    if not finished:
        return Sample(False, error="no final chunk", index=index)
    tokens = int(usage["completion_tokens"]) if "completion_tokens" in usage else len(arrivals)
    prompt_tokens = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None
    return Sample(True, ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e, tokens=tokens,
                  gaps_s=[b - a for a, b in zip(arrivals, arrivals[1:], strict=False)], index=index,
                  text="".join(parts), prompt_tokens=prompt_tokens)
