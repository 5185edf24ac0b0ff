"""Request layout: a checked request turned into what the scheduler runs, in the caller's thread.

    caller arguments -> `GenerationRequest` (blend.engine.request: checked, defaults filled in)
        -> `check_fits`: text that cannot fit the model's positions refused before it is tokenized
        -> `PromptBuilder.build` with the request's template (or the configured one): the prompt
        -> the positions checked on tokens -> `DocumentCache.segment_blocks` (block keys hashed once)
        -> the documents noted (`Ingestor.note`: ids with their keys; warnings)
        -> `LaidOut`: the prefill's `PromptWork`, the `Generation`, the KV bytes it holds

A chat turn's prompt is laid out by its session (blend.session.manager); `turn` lays out its
documents' blocks and its generation. Nothing here runs the model or queues anything.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blend.config import BlendConfig
from blend.decode.generation import Generation
from blend.decode.sampling import SamplingParams
from blend.engine.prefill import PromptWork
from blend.engine.request import GenerationRequest, RequestOptions
from blend.engine.scheduler import DECODE_RESERVE
from blend.kv.documents import DocumentCache
from blend.kv.ingest import Ingestor
from blend.model.runner import Runner
from blend.prompt.builder import Prompt, PromptBuilder, PromptTemplate, Segment
from blend.prompt.conversation import Message, check_messages, encode
from blend.prompt.document import Document, check_documents, render_document
from blend.session.manager import Turn

MAX_TEMPLATES = 16  # prompt builders kept for requests' own templates (the oldest dropped first)
# generate_many's request mappings: the keys of GenerationRequest.create and of teacher forcing
REQUEST_KEYS = RequestOptions.__optional_keys__
FORCING_KEYS = frozenset({"answer", "logprobs", "follow"})


@dataclass(frozen=True)
class Forcing:
    """What to teacher-force after a request's prefill (eval): `answer` (its mean NLL in the
    stats), `logprobs` (every decoding step's log-probs), `follow` (token ids: the log-probs
    before each, forced after the prompt)."""

    answer: str | None = None
    logprobs: bool = False
    follow: tuple[int, ...] | None = None


NO_FORCING = Forcing()


@dataclass(frozen=True)
class LaidOut:
    """A request laid out: its prefill's work (None: a chat turn on its session's exact KV),
    its decoding state, the KV bytes it holds on the device, warnings for its result."""

    work: PromptWork | None
    generation: Generation
    kv_bytes: int
    warnings: tuple[str, ...] = ()


class RequestLayout:
    """Lays requests out for one engine: its prompt builder (and one per template a request
    brings), runner (positions, vocabulary), document cache (block keys), ingestor (ids) and
    the tokenizer and end-of-sequence ids its generations decode with."""

    def __init__(self, config: BlendConfig, prompts: PromptBuilder, runner: Runner, documents: DocumentCache,
                 ingestor: Ingestor, tokenizer: Any, eos: Sequence[int], kv_bytes_per_token: int):
        self.config, self.prompts, self.runner, self.tokenizer = config, prompts, runner, tokenizer
        self.documents, self.ingestor, self.eos = documents, ingestor, tuple(eos)
        self.kv_bytes_per_token = kv_bytes_per_token
        self._builders: dict[PromptTemplate, PromptBuilder] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------- requests
    def request(self, query: object, documents: object = (), **kwargs: Any) -> GenerationRequest:
        """`generate`'s arguments checked into a GenerationRequest (the config's defaults filled in)."""
        return GenerationRequest.create(self.config, query, documents, **kwargs)

    def chat_request(self, message: object, documents: object = (), system: object = None, *, mode: object = None,
                     recompute_ratio: object = None, max_new_tokens: object = None, temperature: object = None,
                     top_p: object = None, seed: object = None, stop: object = None) -> GenerationRequest:
        """A chat turn's arguments checked (mode None: blend) into a GenerationRequest."""
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, got {type(message).__name__}")
        if not message.strip():
            raise ValueError("empty message: pass some text")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {type(system).__name__}")
        return self.request(message, documents, mode="blend" if mode is None else mode, recompute_ratio=recompute_ratio,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop)

    def forcing(self, answer: object = None, logprobs: object = False, follow: object = None) -> Forcing:
        """Teacher-forcing arguments checked (TypeError naming the argument)."""
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"answer must be a str or None, got {type(answer).__name__}")
        if not isinstance(logprobs, bool):
            raise TypeError(f"logprobs must be a bool, got {type(logprobs).__name__}")
        vocab = self.runner.lm_head.weight.shape[0]
        if follow is not None and (not isinstance(follow, Sequence) or isinstance(follow, str | bytes) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in follow)):
            raise TypeError(f"follow must be a sequence of token ids in [0, {vocab}) or None")
        return Forcing(answer, logprobs, tuple(follow) if follow is not None else None)

    def parse(self, spec: Mapping[str, Any] | GenerationRequest) -> tuple[GenerationRequest, Forcing]:
        """One of `generate_many`'s requests: a GenerationRequest, or a mapping of `generate`'s
        keyword arguments (unknown keys refused, naming the valid ones)."""
        if isinstance(spec, GenerationRequest):
            return spec, NO_FORCING
        if not isinstance(spec, Mapping):
            raise TypeError(f"a request must be a mapping of generate's arguments, got {type(spec).__name__}")
        args = dict(spec)
        if "query" not in args:
            raise ValueError("a request needs its `query`")
        extra = {k: args.pop(k) for k in list(args) if k in FORCING_KEYS}
        query, documents = args.pop("query"), args.pop("documents", ())
        unknown = sorted(set(args) - REQUEST_KEYS)
        if unknown:
            raise ValueError(f"unknown request key(s) {', '.join(unknown)}; valid keys are: "
                             f"{', '.join(sorted(REQUEST_KEYS | FORCING_KEYS | {'query', 'documents'}))}")
        return self.request(query, documents, **args), self.forcing(**extra)

    def lay_out_many(self, requests: object) -> list[tuple[GenerationRequest, LaidOut]]:
        """`generate_many`'s requests (mappings of `generate`'s keyword arguments, or
        GenerationRequests) checked and laid out, each error naming its request's index."""
        if isinstance(requests, Mapping | str | bytes) or not isinstance(requests, Sequence):
            raise TypeError("requests must be a list of request mappings (generate's keyword arguments) "
                            "or GenerationRequest objects")
        laid = []
        for i, spec in enumerate(requests):
            try:
                req, forcing = self.parse(spec)
                laid.append((req, self.lay_out(req, forcing)))
            except (TypeError, ValueError) as err:
                raise type(err)(f"requests[{i}]: {err}") from None
        return laid

    # --------------------------------------------------------------- prompts
    def builder(self, template: PromptTemplate | None = None) -> PromptBuilder:
        """The prompt builder of a request's template (None, or the configured template: the
        engine's own builder); one per template is kept (at most MAX_TEMPLATES)."""
        if template is None:
            return self.prompts
        if not isinstance(template, PromptTemplate):
            raise TypeError(f"template must be a blend.prompt.builder.PromptTemplate or None, "
                            f"got {type(template).__name__}")
        system, base = template.render_system(), self.prompts
        if base.system_prompt == system and base.query_template == template.query:
            return base
        with self._lock:
            built = self._builders.get(template)
            if built is None:
                if len(self._builders) >= MAX_TEMPLATES:
                    self._builders.pop(next(iter(self._builders)))
                built = self._builders[template] = PromptBuilder(base.tokenizer, system, template.query,
                                                                 self.config.blend.max_document_tokens, base.max_positions)
        return built

    def build_prompt(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str],
                     template: PromptTemplate | None = None) -> Prompt:
        """The prompt of a question (str) or a conversation (messages) over `documents`."""
        question = query if isinstance(query, str) else check_messages(query)
        return self.builder(template).build(question, check_documents(documents))

    def check_fits(self, req: GenerationRequest) -> None:
        """Refuse a request whose text cannot fit the model's positions, without tokenizing it
        (the exact check, on tokens, follows when the prompt is built)."""
        if req.raw and not isinstance(req.query, str):
            return  # token ids: counted when the prompt is laid out
        self.builder(req.template).check_text_fits(req.query, req.documents, self.runner.max_positions)

    def checked_prompt(self, req: GenerationRequest, *new_tokens: int) -> Prompt:
        """The request's prompt, refused (ValueError saying what to shorten) when its text or its
        tokens plus each of `new_tokens` cannot fit the model's positions."""
        self.check_fits(req)
        if req.raw:  # the whole prompt as text or ids: one query segment of its own tokens
            ids = tuple(encode(self.tokenizer, req.query)) if isinstance(req.query, str) else req.query
            vocab = self.runner.lm_head.weight.shape[0]
            if ids and max(ids) >= vocab:
                raise ValueError(f"token id {max(ids)} is not in the model's vocabulary of {vocab}")
            prompt = Prompt(ids, (Segment("prefix", (), 0), Segment("query", ids, 0)))
        else:
            prompt = self.builder(req.template).build(req.query, req.documents)
        shorten = "shorten the prompt" if req.raw else "use fewer or shorter documents" if isinstance(req.query, str) else (
            "shorten the conversation (fewer or shorter messages)"
            + (" or use fewer or shorter documents" if req.documents else ""))
        for n in new_tokens or (0,):
            self.runner.check_length(len(prompt), n, shorten)
        return prompt

    # ---------------------------------------------------------------- layout
    def lay_out(self, req: GenerationRequest, forcing: Forcing = NO_FORCING) -> LaidOut:
        """The request's prompt built and checked against the positions (ValueError saying
        what to shorten), its block keys hashed, its documents noted."""
        prompt = self.checked_prompt(req, req.max_new_tokens, len(forcing.follow or ()))
        has_ids = any(isinstance(d, Document) and d.id is not None for d in req.documents)
        blocks = self.documents.segment_blocks(prompt) if req.mode != "full" or has_ids else None
        kept = sum(1 for d in req.documents if render_document(d))
        skipped = (f"skipped {len(req.documents) - kept} empty document(s): they add nothing to the prompt",
                   ) if kept < len(req.documents) else ()
        warnings = skipped + self.ingestor.note(prompt, req.documents, blocks)
        capacity = len(prompt) + min(req.max_new_tokens, DECODE_RESERVE)
        work = PromptWork(prompt, blocks, req.mode, req.recompute_ratio, req.selection, capacity, forcing.answer,
                          forcing.follow, req.split)
        return LaidOut(work, self._generation(req, forcing.logprobs), capacity * self.kv_bytes_per_token, warnings)

    def turn(self, req: GenerationRequest, turn: Turn) -> LaidOut:
        """A chat turn begun by its session: its documents' blocks hashed and noted, and, when
        the turn blends them in, the prefill's work (else None: the session's exact KV)."""
        work = None
        capacity = len(turn.ids) + req.max_new_tokens
        if turn.prompt is not None:
            blocks = self.documents.segment_blocks(turn.prompt)
            self.ingestor.note(turn.prompt, req.documents, blocks)
            if turn.blended:
                work = PromptWork(turn.prompt, blocks, req.mode, req.recompute_ratio, None, capacity)
        return LaidOut(work, self._generation(req), capacity * self.kv_bytes_per_token)

    def _generation(self, req: GenerationRequest, logprobs: bool = False) -> Generation:
        sampling = SamplingParams(req.temperature, req.top_p, req.seed)
        return Generation(self.tokenizer, self.eos, req.max_new_tokens, sampling, req.stop, logprobs=logprobs)
