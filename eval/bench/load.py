"""`kvblend bench load`: KV throughput of one tier against a raw read of the same bytes.

For each tier (and codec): write N MiB of KV shaped like SmolLM2 chunks (30 layers, 3 KV
heads, head_dim 64, 512 tokens, fp16 by default; N counts the float16-equivalent bytes),
encoded in the codec, then read it back layer by layer through the tier and, interleaved
with it, read the same number of bytes raw:
  cpu            raw = a tensor copy of each layer's K and V
  disk           raw = os.preadv of layer-sized blocks from one plain file; the page cache
                 of the raw file and of the tier's files is dropped before every pass
                 (fsync, then posix_fadvise DONTNEED), so both read from the device
  redis(-cluster) raw = one GET per layer of a plain blob of the layer's size
Each round reads everything once through the tier and once raw, alternating which goes
first; a warm-up round is excluded; figures are medians over rounds, with min and max;
the load average at start and end is recorded (`contended: true` when it exceeded the
core count). Separate passes (not
entry-by-entry interleaving) because the raw file's background readahead would otherwise
compete with the tier's reads.
cpu "write" is a put by reference (no copy), so its write_gbps only measures bookkeeping.
A codec row adds the entry size (`entry_bytes`, `ratio_to_float16`), the encoding rate and the
decoding rate (one thread, into float32 as the CPU loader does), both in float16-equivalent
bytes per second, and `effective_gbps`: float16-equivalent bytes over read + decode time, the
figure to hold against a `none` row's read_gbps.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eval.bench.common import LoadWatch, drop_page_cache, one_tier, spread
from storage.codec import Codec, codec_named, decode_into
from storage.config import StoreConfig
from storage.disk import DiskTier
from storage.dtypes import dtype_bytes
from storage.entry import KVEntry, dtype_of
from storage.keys import document_block_key
from storage.stack import build_tier
from storage.tier import Tier

MiB = 1024**2


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """Shape of one benchmark chunk; defaults match SmolLM2-135M with 512-token chunks."""

    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64
    tokens: int = 512
    kv_dtype: str = "float16"


def rope_frequencies(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """The plain RoPE inverse frequencies (head_dim / 2,) float32 of a model with this head_dim."""
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def random_entry(
    shape: ChunkShape = ChunkShape(), *, seed: int = 0, fingerprint: str = "bench", pos_start: int = 0
) -> tuple[list[int], KVEntry]:
    """Token ids and a KVEntry of random K/V (deterministic for a seed), with plain RoPE
    frequencies (so a pre-RoPE codec does its whole work). Used by tests too."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 49152, (shape.tokens,), generator=g).tolist()
    dtype = dtype_of(shape.kv_dtype)
    size = (shape.kv_heads, shape.tokens, shape.head_dim)
    layers = [
        (torch.randn(size, generator=g).to(dtype), torch.randn(size, generator=g).to(dtype))  # (H, T, D) each
        for _ in range(shape.layers)
    ]
    entry = KVEntry.from_tensors(layers, fingerprint=fingerprint, token_ids=token_ids, pos_start=pos_start,
                                 kv_dtype=shape.kv_dtype, rope=rope_frequencies(shape.head_dim))
    return token_ids, entry


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Raw:
    """Raw reads of the same bytes as the tier, one layer-sized block at a time, per entry."""

    note = ""

    def start(self) -> None:
        """Begin a pass (e.g. open the file)."""

    def read_entry(self, index: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """End a pass."""

    def close(self) -> None:
        """Remove what the raw reader created."""


class _RawCopy(_Raw):
    note = "raw = tensor copy of K and V per layer"

    def __init__(self, entries: list[KVEntry]) -> None:
        self.entries = entries

    def read_entry(self, index: int) -> None:
        for k, v in self.entries[index].layers:
            k.clone(), v.clone()


class _RawFile(_Raw):
    note = "raw = os.preadv of layer-sized blocks of one plain file; page cache dropped (fsync + POSIX_FADV_DONTNEED)"

    def __init__(self, directory: Path, count: int, layers: int, block: int, tier: DiskTier) -> None:
        self.path = directory / "raw.bin"
        self.layers, self.block, self.tier = layers, block, tier
        self.fd = -1
        chunk = os.urandom(block)
        with open(self.path, "wb") as fh:
            for _ in range(count * layers):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())

    def drop(self) -> None:
        drop_page_cache([self.path, *self.tier.files()])

    def start(self) -> None:
        self.fd = os.open(self.path, os.O_RDONLY)

    def read_entry(self, index: int) -> None:
        base = index * self.layers * self.block
        for i in range(self.layers):
            buf = torch.empty(self.block, dtype=torch.uint8)
            os.preadv(self.fd, [buf.numpy()], base + i * self.block)

    def finish(self) -> None:
        os.close(self.fd)


class _RawRedis(_Raw):
    note = "raw = one GET per layer of a plain blob of the layer's size"

    def __init__(self, client: Any, prefix: str, count: int, layers: int, block: int) -> None:
        self.client, self.layers = client, layers
        self.names = [f"{prefix}raw:{i}" for i in range(count * layers)]
        blob = os.urandom(block)
        for start in range(0, len(self.names), 64):
            pipe = client.pipeline(transaction=False)
            for name in self.names[start : start + 64]:
                pipe.set(name, blob)
            pipe.execute()

    def read_entry(self, index: int) -> None:
        for name in self.names[index * self.layers : (index + 1) * self.layers]:
            self.client.get(name)

    def close(self) -> None:
        for name in self.names:
            self.client.delete(name)


def measure_tier(
    tier: Tier,
    raw: _Raw,
    keyed: list[tuple[str, KVEntry]],
    *,
    rounds: int = 5,
    before_pass: Callable[[], None] | None = None,
) -> dict:
    """Write `keyed` into `tier`, then in each of `rounds` rounds read everything once through
    the tier and once raw (alternating which goes first; `before_pass` runs before each
    read, e.g. to drop the page cache). Reports medians; one warm-up round is excluded."""
    total = sum(e.nbytes for _, e in keyed)
    t0 = time.perf_counter()
    for key, entry in keyed:
        tier.put(key, entry)
    write_s = time.perf_counter() - t0
    if tier.stats()["errors"]:
        raise RuntimeError(f"{tier.name}: writes failed during the benchmark: {tier.stats()}")

    def read_tier(key: str, per_layer: list[float]) -> None:
        header = tier.get_header(key)
        if header is None:
            raise RuntimeError(f"{tier.name}: entry {key} missing during the benchmark (budget too small?)")
        for i in range(header.num_layers):
            t = time.perf_counter()
            if tier.get_layer(key, i, header) is None:
                raise RuntimeError(f"{tier.name}: layer {i} of {key} missing during the benchmark")
            per_layer.append(time.perf_counter() - t)

    def one_round(r: int, per_layer: list[float]) -> tuple[float, float]:
        prepare = before_pass or (lambda: None)
        tier_s = raw_s = 0.0
        for which in ("raw", "tier") if r % 2 == 0 else ("tier", "raw"):
            prepare()
            t = time.perf_counter()
            if which == "raw":
                raw.start()
                try:
                    for n in range(len(keyed)):
                        raw.read_entry(n)
                finally:
                    raw.finish()
                raw_s = time.perf_counter() - t
            else:
                for key, _ in keyed:
                    read_tier(key, per_layer)
                tier_s = time.perf_counter() - t
        return tier_s, raw_s

    one_round(1, [])  # warm-up: connections, allocator
    tier_times, raw_times, layer_times = [], [], []
    for r in range(rounds):
        tier_s, raw_s = one_round(r, layer_times)
        tier_times.append(tier_s)
        raw_times.append(raw_s)
    read_gbps = total / statistics.median(tier_times) / 1e9
    raw_gbps = total / statistics.median(raw_times) / 1e9
    tier_spread, raw_spread = spread(tier_times), spread(raw_times)
    return {
        "tier": tier.name,
        "bytes": total,
        "entries": len(keyed),
        "write_gbps": round(total / write_s / 1e9, 3),
        "read_gbps": round(read_gbps, 3),
        "raw_read_gbps": round(raw_gbps, 3),
        "ratio": round(read_gbps / raw_gbps, 3),
        "read_gbps_min": round(total / tier_spread["max"] / 1e9, 3),
        "read_gbps_max": round(total / tier_spread["min"] / 1e9, 3),
        "raw_read_gbps_min": round(total / raw_spread["max"] / 1e9, 3),
        "raw_read_gbps_max": round(total / raw_spread["min"] / 1e9, 3),
        "layer_read_ms_p50": round(_percentile(layer_times, 0.50) * 1e3, 4),
        "layer_read_ms_p99": round(_percentile(layer_times, 0.99) * 1e3, 4),
        "rounds": rounds,
        "raw": raw.note,
    }


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation without swapping (Linux: MemAvailable),
    None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_memory(needed: int, what: str) -> None:
    """ValueError naming `what` when `needed` bytes exceed 80% of the available memory."""
    available = available_memory()
    if available is not None and needed > 0.8 * available:
        raise ValueError(f"{what} needs about {needed / MiB:,.0f} MiB of memory and {available / MiB:,.0f} MiB are "
                         "available; pass a smaller size")


def float16_bytes(entry: KVEntry) -> int:
    """The bytes of `entry`'s K and V in float16 (what a `none` float16 entry of it holds)."""
    h = entry.header
    return h.num_layers * 2 * h.kv_heads * h.num_tokens * h.head_dim * 2


def codec_rates(codec: Codec, entries: list[KVEntry]) -> dict[str, Any]:
    """Encode every entry in `codec`, then decode each layer into float32 (one thread, as the CPU
    loader does): the encoded entries and the rates in float16-equivalent bytes per second, from
    the median time per entry (a moment the machine was busy elsewhere does not decide them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    encoded, encode_s, decode_s = [], [], []
    try:
        for e in entries:
            t0 = time.perf_counter()
            encoded.append(e.encode(codec))
            encode_s.append(time.perf_counter() - t0)
        if not codec.raw:
            h = entries[0].header
            k, v = torch.empty(h.shape), torch.empty(h.shape)  # (H, T, D) float32
            decode_into(codec, *encoded[0].layers[0], k, v)  # warm-up
            for e in encoded:
                t0 = time.perf_counter()
                for kp, vp in e.layers:
                    decode_into(codec, kp, vp, k, v)
                decode_s.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    per_entry = float16_bytes(entries[0])
    decode = statistics.median(decode_s) if decode_s else None
    return {"encoded": encoded,
            "encode_gbps": None if codec.raw else round(per_entry / statistics.median(encode_s) / 1e9, 3),
            "decode_gbps": round(per_entry / decode / 1e9, 3) if decode else None,
            "decode_s": decode * len(entries) if decode else None, "rate_threads": 1}


def run_load(
    kind: str,
    size_mb: float,
    shape: ChunkShape = ChunkShape(),
    *,
    config: StoreConfig | None = None,
    redis_url: str | None = None,
    cluster_urls: list[str] | None = None,
    rounds: int = 5,
    codec: str | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Benchmark one tier kind in `codec` (default: the tier's configured codec); uses its own
    keys/directory and removes them afterwards. ValueError (one line) when the entries, built
    in memory first, cannot fit this machine's available memory."""
    watch = LoadWatch.begin()
    # one entry, with the float32 layer it is drawn in, before anything is allocated
    layer_elems = shape.kv_heads * shape.tokens * shape.head_dim
    check_memory(2 * layer_elems * (shape.layers * dtype_bytes(shape.kv_dtype) + 4),
                 "one entry of --layers x --kv-heads x --chunk-tokens x --head-dim")
    _, template = random_entry(shape, seed=0)
    n = max(1, math.ceil(size_mb * MiB / template.nbytes))
    check_memory(n * template.nbytes * (2 if kind == "cpu" else 1), f"--size-mb {size_mb:g}")
    keyed: list[tuple[str, KVEntry]] = []
    for i in range(n):
        token_ids, entry = random_entry(shape, seed=i)
        keyed.append((document_block_key("bench", token_ids, shape.kv_dtype, namespace=f"bench{os.getpid()}", start=0), entry))
    chosen = codec_named(codec if codec is not None else getattr(one_tier(kind, config, scratch=Path(".")), "codec", "none"))
    rates = codec_rates(chosen, [e for _, e in keyed])
    keyed = [(key, e) for (key, _), e in zip(keyed, rates.pop("encoded"), strict=True)]
    float16 = float16_bytes(template)
    coded = keyed[0][1]
    total = n * coded.nbytes
    block = coded.header.layer_nbytes
    budget = int(total * 1.2) + 64 * MiB
    tag = f"kvblend-bench:{os.getpid()}:"
    log(f"[{kind} {chosen.name}] {n} entries x {coded.nbytes / MiB:.2f} MiB = {total / MiB:.1f} MiB "
        f"({float16 / coded.nbytes:.2f}x smaller than float16), layer {block / 1024:.0f} KiB")
    cleanup: list[Callable[[], None]] = []
    try:
        before: Callable[[], None] | None = None
        # a disk tier goes beside the configured disk cache (the same device), not in it
        disk = next((t for t in config.tiers if t.kind == "disk"), None) if config is not None else None
        parent = Path(disk.path).parent if kind == "disk" and disk is not None else None
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="kvblend-bench-load-", dir=parent))
        cleanup.append(lambda: shutil.rmtree(scratch, ignore_errors=True))
        tier = build_tier(one_tier(kind, config, scratch=scratch / "tier", redis_url=redis_url,
                                   cluster_urls=cluster_urls, key_prefix=tag, budget=budget))
        if kind == "cpu":
            raw: _Raw = _RawCopy([e for _, e in keyed])
        elif kind == "disk":
            raw_file = _RawFile(scratch, n, shape.layers, block, tier)  # type: ignore[arg-type]
            raw, before = raw_file, raw_file.drop
        else:
            raw = _RawRedis(tier._client_or_connect(), tag, n, shape.layers, block)  # type: ignore[attr-defined]
        cleanup.append(tier.close)
        cleanup.append(tier.clear)
        cleanup.append(raw.close)
        if kind == "disk":
            os.sync()  # make the tier's pages clean so DONTNEED can drop them
        result = measure_tier(tier, raw, keyed, rounds=rounds, before_pass=before)
        result["tier"] = kind
        result["codec"] = chosen.name
        result["entry_bytes"] = coded.nbytes
        result["ratio_to_float16"] = round(float16 / coded.nbytes, 3)
        result["encode_gbps"] = rates["encode_gbps"]
        result["decode_gbps"] = rates["decode_gbps"]
        result["rate_threads"] = rates["rate_threads"]
        read_s = total / (result["read_gbps"] * 1e9) if result["read_gbps"] else None
        decode_s = rates["decode_s"] or 0.0
        result["effective_gbps"] = (round(n * float16 / (read_s + decode_s) / 1e9, 3)
                                    if read_s else None)  # float16-equivalent bytes over read + decode
        result.update(watch.finish(f"{kind} load benchmark"))
    finally:
        for fn in reversed(cleanup):
            fn()
    coding = (f"  encode {result['encode_gbps']} decode {result['decode_gbps']} effective {result['effective_gbps']} GB/s"
              if not chosen.raw else "")
    log(
        f"[{kind} {chosen.name}] write {result['write_gbps']:.2f} GB/s  read {result['read_gbps']:.2f} GB/s  "
        f"raw {result['raw_read_gbps']:.2f} GB/s  ratio {result['ratio']:.2f}  "
        f"layer p50 {result['layer_read_ms_p50']:.3f} ms p99 {result['layer_read_ms_p99']:.3f} ms  ({result['raw']}){coding}"
    )
    return result
