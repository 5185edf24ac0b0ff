"""After the prefill: time to first token, first-token log-probs, decoding (streamed
text deltas, stop strings), the result.

Every request path (the engine's four modes, a chat turn) prefills a `KVCache` in its
own way and then ends here: `Decoder.timed` measures the prefill up to the first
token's logits (synchronising CUDA, whose kernels are asynchronous), `Decoder.stream`
decodes from the same cache token by token, yielding `TextDelta`s and finally the
`GenerationResult`; `Decoder.finish` is the same stream consumed at once, so a
streamed and a non-streamed request give the same tokens and the same text.

Text: the decoded tokens (end-of-sequence ids and special tokens left out) with
leading and trailing whitespace removed. A delta is only emitted once it is final: a
tail that may still become a stop string, trailing whitespace and an incomplete UTF-8
character are held back, so the deltas always concatenate to `GenerationResult.text`.
With stop strings, generation ends at the first token that completes one and the text
ends before it (finish_reason "stop", as at an end-of-sequence token; "length" when
`max_new_tokens` ran out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from blend.decode.sampling import SamplingParams, sample
from blend.decode.text import TextAssembler
from blend.model.cache import KVCache
from blend.model.loading import LoadedModel
from blend.model.runner import Runner
from blend.stats import RequestStats

log = logging.getLogger(__name__)



@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, including a final end-of-sequence id
    ttft_s: float
    first_token_logprobs: torch.Tensor  # (vocab,) float32 log-probabilities of the first generated token
    stats: RequestStats
    finish_reason: str = "length"  # stop (end-of-sequence or a stop string) | length (max_new_tokens)
    prompt_tokens: int = 0  # tokens of the prompt (context + query)
    warnings: tuple[str, ...] = field(default_factory=tuple)  # e.g. a document differing from its ingest
    # asked for with `logprobs=True`: (T, vocab) float32 log-probs each generated token was drawn from
    token_logprobs: torch.Tensor | None = None
    # asked for with `follow=ids`: (len(ids), vocab) float32 log-probs before each of those ids,
    # teacher-forced after the prompt (e.g. another mode's answer, for a per-token comparison)
    follow_logprobs: torch.Tensor | None = None



@dataclass(frozen=True)
class TextDelta:
    """New text of a streamed generation (final: never revised by a later delta; may be
    "" while text is held back)."""

    text: str
    tokens: int  # tokens generated so far



@dataclass
class Prefilled:
    """A filled cache, the last position's logits (vocab,) and the prefill's statistics."""

    logits: torch.Tensor
    cache: KVCache
    stats: RequestStats



class Decoder:
    """Decoding for one model: its runner, tokenizer and end-of-sequence ids."""

    def __init__(self, lm: LoadedModel, runner: Runner):
        self.runner, self.tokenizer = runner, lm.tokenizer
        self.eos_ids = eos_ids(lm)

    def timed(self, prefill: Callable[[], Prefilled]) -> tuple[Prefilled, float, float]:
        """Run `prefill`; returns it, its TTFT (seconds, until the logits exist) and its start time."""
        t0 = time.perf_counter()
        pre = prefill()
        if pre.logits.device.type == "cuda":
            torch.cuda.synchronize(pre.logits.device)
        return pre, time.perf_counter() - t0, t0

    def stream(self, pre: Prefilled, ttft: float, t0: float, max_new_tokens: int, sampling: SamplingParams,
               stop: Sequence[str] = (), answer: str | None = None, *, logprobs: bool = False,
               follow: Sequence[int] | None = None) -> Iterator[TextDelta | GenerationResult]:
        """Decode up to `max_new_tokens` from `pre`: yields one TextDelta per generated
        token but an end-of-sequence one (its text may be "": held back), one more for the
        held-back rest at the end if any, then the GenerationResult (the last item).

        Appends to `pre.cache`, whose sliding-window layers become rings first (`KVCache.compact_`).
        Closing the iterator early stops decoding (no result).
        With `answer`, stats.answer_nll is that text's mean NLL teacher-forced after the
        prompt; with `follow`, result.follow_logprobs are the log-probs along those ids
        teacher-forced after the prompt (either way the cache is restored before decoding).
        With `logprobs`, result.token_logprobs holds each step's log-probs.
        """
        first = torch.log_softmax(pre.logits.float(), dim=-1).cpu()
        nll = self.answer_nll(pre.cache, pre.logits, answer) if answer is not None else None
        followed = self.forced_logprobs(pre.cache, pre.logits, follow).cpu() if follow else None
        steps: list[torch.Tensor] = []
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        text = TextAssembler(self.tokenizer, self.eos_ids, stop)
        pre.cache.compact_()  # sliding layers: rings of their window from here on (memory bounded)
        pre.cache.ensure_capacity(pre.cache.length + max_new_tokens)
        tokens: list[int] = []
        logits = pre.logits
        finish_reason = "length"
        for i in range(max_new_tokens):
            token = sample(logits, sampling, gen)
            tokens.append(token)
            if logprobs:
                steps.append(torch.log_softmax(logits.float(), dim=-1).cpu())
            if token in self.eos_ids:
                finish_reason = "stop"
                break
            yield TextDelta(text.push(token), len(tokens))
            if text.stopped:
                finish_reason = "stop"
                break
            if i < max_new_tokens - 1:
                logits = self.runner.step(token, pre.cache)
        rest = text.finish()
        if rest:
            yield TextDelta(rest, len(tokens))
        stats = pre.stats.replace(ttft_s=ttft, total_s=time.perf_counter() - t0, new_tokens=len(tokens),
                                  answer_nll=nll)
        yield GenerationResult(text.out, tokens, ttft, first, stats, finish_reason,
                               prompt_tokens=stats.context_tokens + stats.query_tokens,
                               token_logprobs=torch.stack(steps) if logprobs else None, follow_logprobs=followed)

    def finish(self, pre: Prefilled, ttft: float, t0: float, max_new_tokens: int, sampling: SamplingParams,
               answer: str | None = None, stop: Sequence[str] = ()) -> GenerationResult:
        """`stream` consumed at once: the GenerationResult."""
        *_, result = self.stream(pre, ttft, t0, max_new_tokens, sampling, stop, answer)
        return result  # type: ignore[return-value]  # the stream's last item

    def answer_nll(self, cache: KVCache, first_logits: torch.Tensor, answer: str) -> float:
        """Mean NLL per token of `answer` teacher-forced after the prompt in `cache`.

        The cache length is restored afterwards (decoding overwrites those slots).
        """
        ids = list(self.tokenizer(answer.strip(), add_special_tokens=False).input_ids)
        if not ids:
            return float("nan")
        logp = self.forced_logprobs(cache, first_logits, ids)
        return float(-logp[torch.arange(len(ids)), torch.tensor(ids)].mean())

    def forced_logprobs(self, cache: KVCache, first_logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """(len(ids), vocab) float32 log-probs before each of `ids`, teacher-forced after the
        prompt in `cache` (first_logits: the prompt's last logits). The cache length is
        restored afterwards (decoding overwrites those slots)."""
        ids = [int(t) for t in ids]
        length = cache.length
        cache.ensure_capacity(length + len(ids))
        logits = [first_logits[None]]
        if len(ids) > 1:
            logits.append(self.runner.prefill(torch.tensor(ids[:-1]), cache, start=length,
                                              logit_rows=range(len(ids) - 1)))
        cache.length = length
        return torch.log_softmax(torch.cat(logits).float(), dim=-1)



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

