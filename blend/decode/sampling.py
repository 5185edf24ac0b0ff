"""Sampling parameters and picking the next token from a step's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0; otherwise temperature + nucleus (top-p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")



def sample(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick the next token from logits (vocab,): argmax, or temperature + top-p."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double().cpu()
    # shifted so the largest is 0 before scaling: a tiny temperature gives -inf, never inf - inf
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p
        keep[0] = True  # the top token always stays (a top_p that underflows keeps it alone)
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))

