"""Document chunks in the tier stack: their keys, lookup, compute on a miss, ingest.

A chunk's KV is computed standalone (positions 0..n-1), or after the fixed system part
with `chunk_context: system`, and keyed by its own tokens only (`storage.keys.chunk_key`),
so it hits in every prompt that contains it; the loader re-rotates its keys to the
chunk's position in the prompt. The system part itself is cached the same way (it is
exact at position 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from blend.pipeline import Placement
from blend.prefix import EntryMaker
from blend.prompt import Prompt, Segment
from blend.stats import LookupTally
from storage.keys import chunk_key, tokens_digest
from storage.stack import TieredStore


class ChunkCache:
    """Chunk entries of one model and one chunk layout over a tier stack."""

    def __init__(self, store: TieredStore, maker: EntryMaker, *, namespace: str, chunk_context: str):
        self.store, self.maker = store, maker
        self.namespace, self.chunk_context = namespace, chunk_context

    def key(self, seg: Segment, prompt: Prompt) -> tuple[str, int, list[int]]:
        """(store key, position its keys are rotated at, context ids it is computed after)."""
        fingerprint, kv_dtype = self.maker.fingerprint, self.maker.kv_dtype
        if seg.kind == "chunk" and self.chunk_context == "system":
            context = list(prompt.prefix.token_ids)
            key = chunk_key(fingerprint, seg.token_ids, kv_dtype, self.namespace, tokens_digest(context))
            return key, len(context), context
        return chunk_key(fingerprint, seg.token_ids, kv_dtype, self.namespace), 0, []

    def resolve(self, prompt: Prompt, segments: Sequence[Segment], tally: LookupTally) -> list[Placement]:
        """Look up every segment; compute the misses now (and queue their writes)."""
        placements = []
        for seg in segments:
            key, pos_start, context = self.key(seg, prompt)
            kind = "system" if seg.kind == "prefix" else "documents"
            located = self.store.lookup(key, self.maker.expected(seg.token_ids, pos_start))

            def recompute(seg: Segment = seg, context: list[int] = context):
                return self.maker.compute(seg.token_ids, context)

            entry = None
            if located is None:
                entry = recompute()
                self.store.put(key, entry)
                tally.miss(kind)
            else:
                tally.hit(kind, located.tier_index)
            placements.append(Placement(seg.start, len(seg.token_ids), pos_start, located, entry, recompute))
        return placements

    def ingest(self, prompt: Prompt) -> list[str]:
        """Compute and store every cacheable segment of `prompt` that is not stored yet;
        returns the chunk keys (documents only, in order)."""
        keys = []
        for seg in prompt.segments:
            if seg.kind == "query":
                continue
            key, pos_start, context = self.key(seg, prompt)
            if seg.kind == "chunk":
                keys.append(key)
            found = self.store.lookup(key, self.maker.expected(seg.token_ids, pos_start))
            if found is None:
                self.store.put(key, self.maker.compute(seg.token_ids, context))
        return keys
