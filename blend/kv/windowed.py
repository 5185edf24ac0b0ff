"""A hybrid model's conversation KV in the tier stack: what a sliding-window layer needs to go
on is only the last `window` tokens, so a chat session stores and resumes two kinds of entry.

- Global blocks: the prefix-block chain of `PrefixCache` (block b keyed by every token up
  to its end, a turn's partial tail block too), each entry holding the full-attention
  layers only (fingerprint `<model>.full`).
- A window entry at the end of each turn, and one at the end of its prompt: the sliding
  layers' K/V of the last min(n, window) tokens before position n (fingerprint
  `<model>.window`, keyed by every token up to n and its start n - w), with a partial
  global block ending there too. It may start in the middle of a global block: the two
  kinds do not share boundaries. The prompt's end is where the next turn's tokens surely
  agree with this turn's (its reply, re-rendered through the chat template, may
  tokenize otherwise).

A resume at position p needs the global chain up to p and the window entry ending at p:
it moves (full layers x p + sliding layers x min(p, window)) tokens' K/V, against every
layer x p for the uniform chain (Gemma 3 270M at 4,096 tokens: 27%). Resuming elsewhere
than at a stored window (a chain that stops short) falls back to the longest chain end
that has one; nothing at all: the conversation is computed.

Only chat sessions use this layout; blend's documents and `prefix` mode keep every layer
of every token (a prompt's recompute reads any row's window).
"""

from __future__ import annotations

from collections.abc import Sequence

from blend.kv.loader import Placement
from blend.kv.prefix import PrefixCache
from blend.model.cache import KVCache
from blend.stats import LoadReport
from storage.entry import Expected, KVEntry
from storage.keys import prefix_block_key
from storage.stack import LookupBudget

FULL_SUFFIX, WINDOW_SUFFIX = ".full", ".window"


class WindowedChain:
    """Session prefix chains of a model with sliding-window layers over a `PrefixCache`'s store."""

    def __init__(self, prefix: PrefixCache):
        runner = prefix.runner
        self.prefix, self.runner, self.store = prefix, runner, prefix.store
        self.full_layers = tuple(i for i, w in enumerate(runner.windows) if w is None)
        self.sliding_layers = tuple(i for i, w in enumerate(runner.windows) if w is not None)
        if not self.sliding_layers:
            raise ValueError("WindowedChain is for models with sliding-window layers; use PrefixCache")
        self.window = max(w for w in runner.windows if w is not None)
        maker = prefix.maker
        self.fingerprints = {"full": maker.fingerprint + FULL_SUFFIX, "window": maker.fingerprint + WINDOW_SUFFIX}

    # ------------------------------------------------------------------- keys
    def _key(self, kind: str, ids: Sequence[int], start: int, end: int) -> str:
        return prefix_block_key(self.fingerprints[kind], list(ids[:end]), self.prefix.maker.kv_dtype,
                                self.prefix.namespace, start=start)

    def _expected(self, kind: str, ids: Sequence[int], start: int, end: int) -> Expected:
        layers = self.full_layers if kind == "full" else self.sliding_layers
        r = self.runner
        return Expected.of(list(ids[start:end]), fingerprint=self.fingerprints[kind], num_layers=len(layers),
                           kv_heads=r.kv_heads, head_dim=r.head_dim, kv_dtype=self.prefix.maker.kv_dtype,
                           pos_start=start)

    def window_start(self, end: int) -> int:
        """First position of the window entry that ends at `end`."""
        return max(0, end - self.window)

    # ----------------------------------------------------------------- store
    def _entry(self, kind: str, cache: KVCache, ids: Sequence[int], start: int, end: int) -> KVEntry:
        layers = self.full_layers if kind == "full" else self.sliding_layers
        kv = [cache.window(i, start, end) for i in layers]  # (Hkv, end - start, D) each, position order
        return KVEntry.from_tensors(kv, fingerprint=self.fingerprints[kind], token_ids=list(ids[start:end]),
                                    pos_start=start, kv_dtype=self.prefix.maker.kv_dtype,
                                    rope=self.prefix.maker.rope(layers))

    def window_entry(self, token_ids: Sequence[int], cache: KVCache, end: int) -> tuple[str, KVEntry]:
        """The key and entry (copied, storage dtype) of the window ending at `end`, taken now:
        a turn takes its prompt's before decoding moves the rings on."""
        ids = list(token_ids)
        start = self.window_start(end)
        return self._key("window", ids, start, end), self._entry("window", cache, ids, start, end)

    def store_blocks(self, token_ids: Sequence[int], cache: KVCache, *, skip_below: int = 0,
                     also: Sequence[tuple[int, tuple[str, KVEntry]]] = ()) -> int:
        """Queue the global blocks of `token_ids` (whose KV is in `cache`: full blocks and the
        partial tail, those ending above `skip_below`) and the window entry ending at the last
        position. `also`: (end, window_entry(..., end)) of earlier resume points (a turn's
        prompt end), whose partial global block is queued with them. Returns the number of
        entries queued."""
        ids = list(token_ids)[: cache.length]
        n = len(ids)
        b = self.prefix.block_tokens
        blocks = self.prefix.blocks(n)
        full_end = blocks[-1][1] if blocks else 0
        ends = sorted({n, *(end for end, _ in also if 0 < end <= n)})
        for end in ends:  # partial blocks ending at each resume point
            start = end - end % b if end > full_end or end % b else None
            start = full_end if end > full_end else start
            if start is not None and start < end:
                blocks.append((start, end))
        queued = 0
        for start, end in dict.fromkeys(blocks):
            if end <= skip_below:
                continue
            self.store.put(self._key("full", ids, start, end), self._entry("full", cache, ids, start, end))
            queued += 1
        for end, (key, entry) in also:
            if 0 < end <= n:
                self.store.put(key, entry)
                queued += 1
        if n:
            start = self.window_start(n)
            self.store.put(self._key("window", ids, start, n), self._entry("window", cache, ids, start, n))
            queued += 1
        return queued

    # ---------------------------------------------------------------- lookup
    def lookup(self, token_ids: Sequence[int], limit: int, tail_ends: Sequence[int] = ()) -> list[Placement]:
        """Placements that resume `token_ids` at the longest p <= limit where the global chain
        reaches p (full blocks, then a partial block ending at p: a block end or one of
        `tail_ends`, which may lie inside a stored full block) and a window entry ends at p:
        the chain's blocks (full layers) and the window (sliding layers). [] when there is
        no such p."""
        ids = list(token_ids)
        b = self.prefix.block_tokens
        budget = LookupBudget(self.prefix.stall_s)
        chain: list[Placement] = []
        for start, end in self.prefix.blocks(len(ids)):
            if end > limit:
                break
            found = self._find("full", ids, start, end, budget)
            if found is None:
                break
            chain.append(found)
        reached = len(chain) * b
        candidates = [(pl.start + pl.length, chain[: i + 1]) for i, pl in enumerate(chain)]
        for end in sorted(set(tail_ends), reverse=True):
            start = end - end % b
            if 0 < end <= limit and end % b and start <= reached:  # a partial block after the chain's full ones
                tail = self._find("full", ids, start, end, budget)
                if tail is not None:
                    candidates.append((end, [*chain[: start // b], tail]))
        for end, blocks in sorted(candidates, key=lambda c: -c[0]):  # the longest resume point with a window
            window = self._find("window", ids, self.window_start(end), end, budget)
            if window is not None:
                return [*blocks, window]
        return []

    def _find(self, kind: str, ids: list[int], start: int, end: int, budget: LookupBudget) -> Placement | None:
        located = self.store.lookup(self._key(kind, ids, start, end), self._expected(kind, ids, start, end), budget)
        if located is None:
            return None
        layers = self.full_layers if kind == "full" else self.sliding_layers
        return Placement(start, end - start, start, located, None, layers=layers)

    def intact_end(self, chain: Sequence[Placement], load: LoadReport) -> int:
        """End of the leading global blocks loaded from the store (the window entry is not a block
        of the chain; an unreadable block fails the load instead)."""
        end = 0
        for pl in chain:
            if pl.layers != self.full_layers or pl.start != end or pl.entry is not None:
                break
            end = pl.start + pl.length
        return end
