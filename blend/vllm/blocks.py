"""What names a vLLM block in kvblend's store: the model's identity, the chain of block keys of a
prompt, what a reader expects of each entry. Shared by the connector (inside vLLM) and the
commands that reach what it stored (`kvblend delete`, in kvblend's own venv): imports no vllm.

A block key (storage.keys.vllm_block_key) covers every token from the prompt's start to the block's
end, the model fingerprint (`model_fingerprint`: vLLM's model directory, its config and weights),
the block size and the storage dtype (vLLM's KV cache dtype: entries hold exactly what vLLM
computed). A hit verifies the block's own tokens and positions (storage.entry.Expected).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from storage.dtypes import DTYPE_NAMES
from storage.entry import Expected
from storage.keys import vllm_block_key

_DIGESTS_FILE = "vllm-digests.json"  # under kvblend_home(): a weight file's sha256 by (path, size, mtime)
_FINGERPRINT_TAG = "kvblend/vllm-model/v1"
BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)  # the sizes `kvblend delete` tries when not told


def _file_sha256(path: Path, cache_dir: Path | None) -> str:
    """sha256 of a file, remembered under `cache_dir` by (real path, size, mtime_ns)."""
    real = path.resolve()
    st = real.stat()
    tag = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    table: dict[str, str] = {}
    cache = cache_dir / _DIGESTS_FILE if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except (OSError, ValueError):
            table = {}
        if isinstance(table, dict) and isinstance(table.get(tag), str):
            return table[tag]
    with real.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if cache is not None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            table = table if isinstance(table, dict) else {}
            table[tag] = digest
            tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(table))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: hashed again next time
    return digest


def model_fingerprint(model_dir: str | Path, cache_dir: Path | None = None) -> str:
    """The identity of the model vLLM serves from `model_dir`: sha256 over its config.json and the
    sha256 of each *.safetensors file (by name). Reads the weights once per file version (the
    digests are remembered under `cache_dir`). ValueError for a directory without config.json."""
    directory = Path(model_dir)
    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"{str(directory)!r} has no config.json: not a model directory vLLM reads")
    h = hashlib.sha256(_FINGERPRINT_TAG.encode())
    h.update(config.read_bytes())
    for weights in sorted(directory.glob("*.safetensors")):
        h.update(weights.name.encode() + b"\x00" + _file_sha256(weights, cache_dir).encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class BlockNames:
    """How one vLLM server's blocks are named: model fingerprint, storage dtype (its KV cache's),
    block size, the store's key namespace."""

    fingerprint: str
    kv_dtype: str
    block_size: int
    namespace: str = ""

    def key(self, token_ids: Sequence[int], block: int) -> str:
        """Key of block `block` (0-based) of a sequence whose tokens start with `token_ids`."""
        end = (block + 1) * self.block_size
        if end > len(token_ids):
            raise ValueError(f"block {block} ends at token {end}; only {len(token_ids)} tokens given")
        return vllm_block_key(self.fingerprint, list(token_ids[:end]), self.kv_dtype, self.namespace,
                              block_size=self.block_size)

    def keys(self, token_ids: Sequence[int], first: int = 0, last: int | None = None) -> list[str]:
        """Keys of blocks first .. last - 1 (default: every full block of `token_ids`)."""
        last = len(token_ids) // self.block_size if last is None else last
        return [self.key(token_ids, b) for b in range(first, last)]

    def expected(self, token_ids: Sequence[int], block: int, *, num_layers: int, kv_heads: int,
                 head_dim: int) -> Expected:
        """What the entry of block `block` must be: its own tokens at their positions, this model."""
        start = block * self.block_size
        return Expected.of(list(token_ids[start:start + self.block_size]), fingerprint=self.fingerprint,
                           num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, kv_dtype=self.kv_dtype,
                           pos_start=start)


def candidate_names(fingerprint: str, namespace: str, kv_dtypes: Sequence[str] | None = None,
                    block_sizes: Sequence[int] | None = None) -> list[BlockNames]:
    """Every naming a server of this model may have used (for deletes): the given dtypes and block
    sizes, by default every storage dtype and BLOCK_SIZES."""
    return [BlockNames(fingerprint, d, b, namespace) for d in (kv_dtypes or DTYPE_NAMES)
            for b in (block_sizes or BLOCK_SIZES)]
