"""Teacher forcing after a prefill: the log-probs along given token ids, and an answer's mean
negative log-likelihood (eval compares modes token by token along full prefill's answer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blend.model.cache import KVCache
from blend.model.runner import Runner
from blend.prompt.conversation import encode


def forced_logprobs(runner: Runner, cache: KVCache, first_logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 log-probs before each of `ids`, teacher-forced after the
    prompt in `cache` (first_logits: the prompt's last logits). The cache length is restored
    afterwards (decoding overwrites those slots)."""
    ids = [int(t) for t in ids]
    length = cache.length
    cache.ensure_capacity(length + len(ids))
    logits = [first_logits[None]]
    if len(ids) > 1:
        logits.append(runner.prefill(torch.tensor(ids[:-1]), cache, start=length, logit_rows=range(len(ids) - 1)))
    cache.length = length
    return torch.log_softmax(torch.cat(logits).float(), dim=-1)


def answer_nll(runner: Runner, tokenizer, cache: KVCache, first_logits: torch.Tensor, answer: str) -> float:
    """Mean NLL per token of `answer` teacher-forced after the prompt in `cache` (its length
    is restored afterwards); nan for an answer of no tokens."""
    ids = encode(tokenizer, answer.strip())
    if not ids:
        return float("nan")
    logp = forced_logprobs(runner, cache, first_logits, ids)
    return float(-logp[torch.arange(len(ids)), torch.tensor(ids)].mean())
