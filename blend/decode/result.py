"""What a generation gives back: text deltas while it streams, then one `GenerationResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blend.stats import RequestStats


@dataclass(frozen=True)
class TextDelta:
    """New text of a streamed generation (final: never revised by a later delta; may be
    "" while text is held back)."""

    text: str
    tokens: int  # tokens generated so far


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
