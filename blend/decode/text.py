"""Incremental detokenization of one generation with stop strings.

A delta is only emitted once it is final: a tail that may still become a stop string,
trailing whitespace and an incomplete UTF-8 character are held back, so the deltas always
concatenate to the whole text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from blend.prompt.conversation import TOKENIZER_LOCK

log = logging.getLogger(__name__)


class TextAssembler:
    """Incremental detokenization of one generation with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer, self.eos_ids, self.stop = tokenizer, set(eos_ids), tuple(stop)
        self.ids: list[int] = []
        self.out = ""  # text emitted so far
        self.stopped = False  # a stop string was completed
        self._raw = ""  # decoded text so far (incremental), before stripping
        self._window = (0, 0)  # token offsets: context tokens start, read position

    def push(self, token: int) -> str:
        """Add a generated token; returns the newly final text ("" if none).

        Decodes only a short window (the previous piece as context), so a long
        generation costs linear time, not quadratic.
        """
        if token in self.eos_ids:
            return ""
        self.ids.append(token)
        start, read = self._window
        with TOKENIZER_LOCK:  # the Rust tokenizer is shared with threads that encode prompts
            before = self.tokenizer.decode(self.ids[start:read], skip_special_tokens=True)
            after = self.tokenizer.decode(self.ids[start:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # else: an incomplete character
            self._raw += after[len(before):]
            self._window = (read, len(self.ids))
        text = self._raw.lstrip()
        hit = self._find_stop(text)
        if hit is not None:
            self.stopped = True
            return self._emit(text[:hit].rstrip())
        return self._emit(text[: self._stable_end(text)])

    def finish(self) -> str:
        """The remaining text once generation has ended (the whole decoding, stripped)."""
        if self.stopped:
            return ""
        with TOKENIZER_LOCK:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._emit(text.strip())

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.out):
            return ""
        if not upto.startswith(self.out):  # a tokenizer whose decoding of a prefix is not a prefix of the whole
            log.debug("detokenization revised emitted text %r -> %r; emitted text is kept", self.out, upto)
        new = upto[len(self.out):]
        self.out += new
        return new

    def _find_stop(self, text: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, len(self.out) - max(len(s) for s in self.stop) + 1)
        found = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _stable_end(self, text: str) -> int:
        """End of the text that can neither change nor turn into a stop string."""
        end = len(text.rstrip())
        hold = 0
        for s in self.stop:  # a tail that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, end), hold, -1):
                if text[end - k:end] == s[:k]:
                    hold = k
                    break
        return end - hold

