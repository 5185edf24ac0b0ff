"""Content addresses for cached KV: document block keys and conversation-prefix block keys.

A document block key depends on the model fingerprint, the document's context (by
digest), every token of the document up to the block end, where the block starts, the
storage dtype and the KV layout version - never on what precedes the document in a
prompt, so the same document hits in every prompt that contains it, and the blocks of a
document form a chain whose shared leading blocks are stored once. A prefix block key
covers every token from the start of the sequence up to the block end, and where the
block starts. The start keeps stores shared by engines of different block sizes apart:
block [16, 32) of 16-token blocks and block [0, 32) of 32-token blocks end alike but hold
different rows. The two use different domain tags, so they
never collide (nor with the independent-chunk keys, `c<hex>`, of the retired chunk
layout, which are never looked up). Keys are short ASCII strings (`[namespace-]d<hex>` /
`p<hex>`), safe as file names and Redis keys. A store with a secret keeps its entries in a
namespace of its own (`store_namespace`: the configured one with a digest of the secret after it).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

import numpy as np

# Bump when the meaning of stored KV changes (tensor layout, rotary convention, ...):
# every key changes with it, so old entries are simply never hit again.
LAYOUT_VERSION: int = 1

_DIGEST_HEX = 40  # 160 bits; a hit additionally verifies the stored tokens digest
_SECRET_HEX = 16  # the secret's digest in a signed store's namespace (see store_namespace)
_NAMESPACE_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.]{0,63})?$")  # a configured namespace
# a store's namespace: a configured one, with `.k<hex>` after it when the store has a secret
_STORE_NAMESPACE_RE = re.compile(rf"^(?:[A-Za-z0-9_][A-Za-z0-9_.]{{0,{63 + 2 + _SECRET_HEX}}})?$")
# what a tier accepts as an entry key (every key made here matches): a safe file name and Redis key part
ENTRY_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
# the shape of every key made here, `[namespace-]<kind><hex>`: a name of this shape is the
# store's own; any other name is the store's only if its content says so (storage.disk)
ENGINE_KEY_RE = re.compile(
    rf"^(?:[A-Za-z0-9_][A-Za-z0-9_.]{{0,{63 + 2 + _SECRET_HEX}}}-)?[a-z][0-9a-f]{{{_DIGEST_HEX}}}$")
_SECRET_NAMESPACE_TAG = b"kvblend/secret-namespace/v1\x00"
# what each key kind names (`[namespace-]<kind><hex>`): a document's block, an exact prefix block
# (prefix mode, chat sessions), a preempted sequence's parked block, a block vLLM computed (blend.vllm)
KEY_KINDS: dict[str, str] = {"d": "document", "p": "prefix", "s": "parked", "v": "vllm"}
_PREFIX_TAG = b"kvblend/prefix\x00"
_DOCUMENT_TAG = b"kvblend/document\x00"
_PARKED_TAG = b"kvblend/parked\x00"
_VLLM_TAG = b"kvblend/vllm-block\x00"


def key_kind(key: str) -> str | None:
    """What an engine key names (`KEY_KINDS`: document, prefix, parked); None for a name not made
    here. The store picks each tier's codec by it (storage.stack)."""
    if not isinstance(key, str) or not ENGINE_KEY_RE.match(key):
        return None
    return KEY_KINDS.get(key.rsplit("-", 1)[-1][0])  # a namespace never holds "-"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian 32-bit words (ids must fit int32 or uint32)."""
    arr = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (T,)
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**32):
        raise ValueError("token ids must fit in 32 bits (int32 or uint32); got an id outside that range")
    return (arr & 0xFFFFFFFF).astype("<u4").tobytes()


def tokens_digest(token_ids: Sequence[int]) -> str:
    """sha256 hex digest of the token ids packed as little-endian int32/uint32.

    Accepts a list, tuple, numpy array or CPU tensor of ints. Pure function.
    """
    return hashlib.sha256(_token_bytes(token_ids)).hexdigest()


def _field(h: hashlib._Hash, value: str | bytes) -> None:
    data = value.encode() if isinstance(value, str) else value
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def check_namespace(namespace: str) -> str:
    """`namespace` if it is valid (the one rule, used by keys and configs); ValueError otherwise."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise ValueError(f"namespace {namespace!r} must be up to 64 characters from A-Z a-z 0-9 _ . (not starting with .)")
    return namespace


def store_namespace(namespace: str, secret: str | None) -> str:
    """The namespace a store's keys and tiers use (its tiers' directories and key prefixes): the
    configured `namespace` without a secret; with one, `namespace` + ".k" + 16 hex digits of
    HMAC-SHA256(secret, a domain tag) (`k<hex>` for the default namespace). Engines with
    different secrets on one tier then never see, overwrite or clear each other's entries (each
    would only reject the other's, recompute and overwrite them under the same content keys), nor
    do engines without a secret; the secret itself is never part of a name. Pure."""
    check_namespace(namespace)
    if secret is None:
        return namespace
    digest = hmac.new(secret.encode(), _SECRET_NAMESPACE_TAG, hashlib.sha256).hexdigest()[:_SECRET_HEX]
    return f"{namespace}.k{digest}" if namespace else f"k{digest}"


def _with_namespace(namespace: str, kind: str, digest: str) -> str:
    if not isinstance(namespace, str) or not _STORE_NAMESPACE_RE.match(namespace):
        check_namespace(namespace)  # the configured rule's message
    return f"{namespace}-{kind}{digest}" if namespace else f"{kind}{digest}"


def _key(tag: bytes, kind: str, namespace: str, fingerprint: str, token_ids: Sequence[int], kv_dtype: str,
         *extra: str) -> str:
    """`[namespace-]<kind><hex>`: sha256 over the domain tag and length-prefixed (fingerprint,
    tokens, kv_dtype, LAYOUT_VERSION, *extra)."""
    h = hashlib.sha256(tag)
    for value in (fingerprint, _token_bytes(token_ids), kv_dtype, str(LAYOUT_VERSION), *extra):
        _field(h, value)
    return _with_namespace(namespace, kind, h.hexdigest()[:_DIGEST_HEX])


def prefix_block_key(
    fingerprint: str,
    prefix_token_ids: Sequence[int],
    kv_dtype: str,
    namespace: str = "",
    *,
    start: int,
) -> str:
    """Key of a conversation prefix block [start, len(prefix_token_ids)): digest over ALL
    tokens from the sequence start to the block end, and the block's start."""
    return _key(_PREFIX_TAG, "p", namespace, fingerprint, prefix_token_ids, kv_dtype, _block_start(start, prefix_token_ids))


def document_block_key(
    fingerprint: str,
    token_ids: Sequence[int],
    kv_dtype: str,
    namespace: str = "",
    context_digest: str = "",
    *,
    start: int,
) -> str:
    """Key of the block [start, len(token_ids)) of a document's KV: digest over (fingerprint,
    the document's tokens from its first token to the block end, kv_dtype, LAYOUT_VERSION,
    context_digest, start).

    The document is computed as one sequence after the context named by `context_digest`
    (empty: computed standalone at positions 0..); two documents that share their leading
    blocks share those blocks' keys.
    """
    return _key(_DOCUMENT_TAG, "d", namespace, fingerprint, token_ids, kv_dtype, context_digest,
                _block_start(start, token_ids))


def parked_block_key(
    fingerprint: str,
    prefix_token_ids: Sequence[int],
    kv_dtype: str,
    namespace: str = "",
    *,
    owner: str,
    start: int,
) -> str:
    """Key of block [start, len(prefix_token_ids)) of one preempted sequence's parked KV
    (`s<hex>`): like a prefix block key, plus `owner` (a token unique to that parking), under
    its own domain tag. Parked KV may be blended (not exact for its tokens), so it must
    never be found by a prefix lookup, nor by another sequence with the same tokens."""
    if not owner:
        raise ValueError("a parked block key needs its owner's token")
    return _key(_PARKED_TAG, "s", namespace, fingerprint, prefix_token_ids, kv_dtype, owner,
                _block_start(start, prefix_token_ids))


def vllm_block_key(
    fingerprint: str,
    prefix_token_ids: Sequence[int],
    kv_dtype: str,
    namespace: str = "",
    *,
    block_size: int,
) -> str:
    """Key of one of vLLM's KV blocks (`v<hex>`, blend.vllm): the block that ends the tokens
    `prefix_token_ids` (every token from the sequence start: the chain), computed by vLLM with the
    model `fingerprint` (vLLM's model, its dtype) in blocks of `block_size` tokens, stored in
    `kv_dtype`, under its own domain tag (vLLM's KV is never mistaken for kvblend's own prefix
    blocks, nor theirs for its). The entry's layout is the store's (LAYOUT_VERSION), whatever
    vLLM's paged layout: blend.vllm.layout converts."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    n = len(prefix_token_ids)
    if n == 0 or n % block_size:
        raise ValueError(f"a vLLM block key covers whole blocks: {n} tokens is not a multiple of {block_size}")
    return _key(_VLLM_TAG, "v", namespace, fingerprint, prefix_token_ids, kv_dtype, str(block_size),
                _block_start(n - block_size, prefix_token_ids))


def _block_start(start: int, token_ids: Sequence[int]) -> str:
    """`start` as a key field, checked: a block holds at least one token."""
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(token_ids):
        raise ValueError(f"block start {start!r} must be an int in [0, {len(token_ids)}) (the tokens up to the block end)")
    return str(start)
