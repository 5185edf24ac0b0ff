"""One sequence's decoding, step by step: sampling from each step's logits, stop strings,
text deltas, and the result.

Every request path (the engine's four modes, a chat turn) prefills a `KVCache` in its own
way and hands over a `Prefilled`; from then on its `Generation` is fed the logits of each
step (the prefill's last row, then one batched decode step after another: the scheduler
runs the model, a `Generation` never does) and says which token to feed next, so that a
request's output does not depend on what else is decoded beside it.

Text: the decoded tokens (end-of-sequence ids and special tokens left out) with leading and
trailing whitespace removed, emitted as final deltas only (blend.decode.text). With stop
strings, generation ends at the first token that completes one and the text ends before it
(finish_reason "stop", as at an end-of-sequence token; "length" when `max_new_tokens` ran
out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend.decode.result import GenerationResult, TextDelta
from blend.decode.sampling import SamplingParams, sample
from blend.decode.text import TextAssembler
from blend.model.cache import KVCache
from blend.model.loading import LoadedModel
from blend.stats import RequestStats
from storage.entry import KVEntry


@dataclass(frozen=True)
class ExactKV:
    """What a chat turn's exact prefill found of its KV (blend.session.manager.TurnPrefill), for its
    session to store when the turn ends: `stored_end` (the end of the prefix whose blocks are intact
    in the store: not written again), `exact` (its KV is a full prefill's: its blocks may be stored),
    `prompt_window` (a hybrid model's window at the prompt's end: its key and entry)."""

    stored_end: int = 0
    exact: bool = True
    prompt_window: tuple[str, KVEntry] | None = None


@dataclass
class Prefilled:
    """A filled cache, the last position's logits (vocab,) and the prefill's statistics."""

    logits: torch.Tensor
    cache: KVCache
    stats: RequestStats
    token_ids: tuple[int, ...] = ()  # the prompt's ids (what the cache's positions hold)
    follow_logprobs: torch.Tensor | None = None  # teacher forcing after the prefill (`follow`), (F, vocab)
    exact_kv: ExactKV | None = None  # a chat turn's exact prefill: what its session stores after it


class Generation:
    """The decoding state of one sequence.

    `push(logits)` samples the next token from one step's logits (vocab,) and returns the
    delta to emit (None for an end-of-sequence token); then either `done` (finish_reason
    set) or `pending` holds the token the next decode step must feed. `result` builds the
    `GenerationResult` once done (or early, for a cancelled sequence that ends here).
    """

    def __init__(self, tokenizer, eos: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 stop: Sequence[str] = (), *, logprobs: bool = False):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.eos, self.max_new_tokens, self.sampling = frozenset(eos), max_new_tokens, sampling
        self.generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        self.text = TextAssembler(tokenizer, eos, stop)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.pending: int | None = None  # the token the next step feeds
        self.first_logprobs: torch.Tensor | None = None  # (vocab,) float32 of the first step
        self._steps: list[torch.Tensor] | None = [] if logprobs else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, logits: torch.Tensor) -> TextDelta | None:
        """Sample a token from `logits` (vocab,); the delta to emit, or None (end of sequence)."""
        if self.done:
            raise RuntimeError("this generation has finished")
        if self.first_logprobs is None:
            self.first_logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        token = sample(logits, self.sampling, self.generator)
        self.tokens.append(token)
        self.pending = None
        if self._steps is not None:
            self._steps.append(torch.log_softmax(logits.float(), dim=-1).cpu())
        if token in self.eos:
            self.finish_reason = "stop"
            return None
        delta = TextDelta(self.text.push(token), len(self.tokens))
        if self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        else:
            self.pending = token
        return delta

    def rest(self) -> TextDelta | None:
        """The held-back text once generation has ended (None when there is none)."""
        rest = self.text.finish()
        return TextDelta(rest, len(self.tokens)) if rest else None

    def result(self, stats: RequestStats, ttft_s: float, *, follow_logprobs: torch.Tensor | None = None
               ) -> GenerationResult:
        """The result (stats as given: the caller fills in times and token counts)."""
        steps = self._steps
        return GenerationResult(self.text.out, list(self.tokens), ttft_s, self.first_logprobs, stats,
                                self.finish_reason or "length",
                                prompt_tokens=stats.context_tokens + stats.query_tokens,
                                token_logprobs=torch.stack(steps) if steps else None,
                                follow_logprobs=follow_logprobs)


def eos_ids(lm: LoadedModel) -> tuple[int, ...]:
    """Token ids that end generation: the tokenizer's and generation config's EOS, and <|im_end|>."""
    ids = set()
    for source in (lm.tokenizer.eos_token_id, getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(lm.tokenizer, "convert_tokens_to_ids") else None
    if isinstance(im_end, int) and im_end != getattr(lm.tokenizer, "unk_token_id", None):
        ids.add(im_end)
    return tuple(sorted(ids))
