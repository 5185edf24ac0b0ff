"""After the prefill: time to first token, first-token log-probs, decoding, the result.

Every request path (the engine's four modes, a chat turn) prefills a `KVCache` in its
own way and then ends here: `Decoder.timed` measures the prefill up to the first
token's logits (synchronising CUDA, whose kernels are asynchronous), `Decoder.finish`
decodes from the same cache and builds the `GenerationResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blend.model import LoadedModel
from blend.runner import KVCache, Runner, SamplingParams
from blend.stats import RequestStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_s: float
    first_token_logprobs: torch.Tensor  # (vocab,) float32 log-probabilities of the first generated token
    stats: RequestStats


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

    def finish(self, pre: Prefilled, ttft: float, t0: float, max_new_tokens: int, sampling: SamplingParams,
               answer: str | None = None) -> GenerationResult:
        """Decode up to `max_new_tokens` from `pre` and build the result.

        With `answer`, stats.answer_nll is that text's mean NLL teacher-forced after the
        prompt (the cache is restored before decoding).
        """
        logprobs = torch.log_softmax(pre.logits.float(), dim=-1).cpu()
        nll = self.answer_nll(pre.cache, pre.logits, answer) if answer is not None else None
        tokens = self.runner.decode(pre.logits, pre.cache, max_new_tokens, self.eos_ids, sampling)
        text = self.tokenizer.decode([t for t in tokens if t not in self.eos_ids], skip_special_tokens=True).strip()
        stats = pre.stats.replace(ttft_s=ttft, total_s=time.perf_counter() - t0, new_tokens=len(tokens),
                                  answer_nll=nll)
        return GenerationResult(text, tokens, ttft, logprobs, stats)

    def answer_nll(self, cache: KVCache, first_logits: torch.Tensor, answer: str) -> float:
        """Mean NLL per token of `answer` teacher-forced after the prompt in `cache`.

        The cache length is restored afterwards (decoding overwrites those slots).
        """
        ids = list(self.tokenizer(answer.strip(), add_special_tokens=False).input_ids)
        if not ids:
            return float("nan")
        length = cache.length
        logits = [first_logits[None]]
        if len(ids) > 1:
            logits.append(self.runner.prefill(torch.tensor(ids[:-1]), cache, start=length,
                                              logit_rows=range(len(ids) - 1)))
        cache.length = length
        logp = torch.log_softmax(torch.cat(logits).float(), dim=-1)
        return float(-logp[torch.arange(len(ids)), torch.tensor(ids)].mean())


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
