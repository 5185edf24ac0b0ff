"""What `kvblend bench serve` sends and measures: one request (`BenchRequest`) and one measured
answer (`Sample`), whichever server answered it (kvblend's chat endpoint or a peer's
/v1/completions, eval.bench.peer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchRequest:
    question: str
    documents: tuple[dict[str, str], ...]


@dataclass
class Sample:
    """One measured request."""

    ok: bool
    ttft_s: float = 0.0  # client: send -> first content
    e2e_s: float = 0.0
    tokens: int = 0
    server_ttft_s: float = 0.0
    queue_s: float = 0.0
    hits: int = 0
    misses: int = 0
    error: str = ""
    gaps_s: list[float] = field(default_factory=list)  # between the stream's consecutive content chunks
    index: int = -1  # which request of the level's list it answered
    text: str = ""  # the answer: the stream's content concatenated
    prompt_tokens: int | None = None  # the prompt's tokens as the server counted them (its usage), if it said


def same_answer(a: str, b: str) -> bool:
    """Two answers are the same text once leading and trailing whitespace is set aside (kvblend
    strips its text; a peer may keep the space its first token carries)."""
    return a.strip() == b.strip()


def answers_equal(samples: Sequence[Sample], reference: Mapping[int, str] | None) -> int | None:
    """How many answered samples give the same answer as `reference[index]` (None without one)."""
    if reference is None:
        return None
    return sum(1 for s in samples if s.ok and s.index in reference and same_answer(s.text, reference[s.index]))
