"""Transfer-budget planner: is loading a precomputed KV cache faster than recomputing it?

Given a model's KV shape and a context length, the planner sizes the KV payload, finds
the slowest stage on the path that brings it to the accelerator (a storage read limited
by bandwidth and/or IOPS, a host-to-device link), and compares the resulting load-time
lower bound with the prefill time it would replace. It then recommends a CacheBlend
recompute ratio: loading layer i+1 overlaps recomputing a fraction r of the tokens of
layer i, so the load is hidden when r * T_prefill >= T_load, giving
r = max(r_min, T_load / T_prefill), capped at 1.0.

KV accounting by attention kind (`attention` in the result): "mha" (MHA and GQA: K and V per KV
head, 2 * L * n * h * d * b), "hybrid" (some layers keep a sliding window of tokens only) and "mla"
(multi-head latent attention, DeepSeek-V2/V3, Kimi-K2: per layer and token one latent of R =
kv_lora_rank elements and one RoPE key of D = qk_rope_head_dim elements, shared by every head:
L * n * (R + D) * b). `mha_equivalent_bytes` is what the MHA formula gives for the model's heads, so
the difference shows. Under tensor parallelism over N ranks (`tp`) MHA/GQA KV heads split across the
ranks (h / N each when N divides h; when h divides N each rank holds one head, every head on N / h
ranks: vLLM's rule; other N are refused), while every rank holds the whole MLA latent: a store that
every rank writes to keeps N copies of it.

Units: MiB/s = 2**20 bytes/s, GiB/s = 2**30 bytes/s; sizes accept "16KiB", "4096", "1MiB".

CLI: `kvblend plan ...` (see `register_plan`); with `--json` the last stdout line is one
JSON object with the fields of `PlanResult.to_dict()`.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from storage.dtypes import kv_bytes_per_token, mla_bytes_per_token
from storage.units import GIB, MIB, format_bytes

if TYPE_CHECKING:
    from blend.model.runner import Runner

__all__ = ["GIB", "MIB", "kv_bytes_per_token", "mla_bytes_per_token"]
DEFAULT_MIN_RATIO = 0.15
DEFAULT_KV_DTYPE_BYTES = 2  # KV stored as fp16/bf16
PROFILE_TOKENS = 512



@dataclass(frozen=True)
class Stage:
    """One stage of the transfer path and the limit that sets its throughput."""

    name: str  # "storage" or "link"
    bytes_per_s: float
    limited_by: str  # human description of the binding limit, e.g. "20000 IOPS x 16 KiB"


@dataclass(frozen=True)
class MLAShape:
    """What an MLA layer caches per token: a latent of `latent_dim` (kv_lora_rank) elements and a RoPE
    key of `rope_head_dim` (qk_rope_head_dim) elements, shared by every head. The heads' own dims
    (`heads`, `qk_nope_head_dim`, `v_head_dim`; None when not known) only price the MHA equivalent:
    keys of qk_nope + qk_rope dims and values of v_head_dim dims per head."""

    latent_dim: int
    rope_head_dim: int
    heads: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def mha_bytes_per_token(self, layers: int, dtype_bytes: int) -> int | None:
        """L * h * (k_dim + v_dim) * b: the K and V the MHA formula would count (None without the heads' dims)."""
        if self.heads is None or self.qk_nope_head_dim is None or self.v_head_dim is None:
            return None
        return layers * self.heads * (self.qk_nope_head_dim + self.rope_head_dim + self.v_head_dim) * dtype_bytes


@dataclass(frozen=True)
class PlanInputs:
    """Everything `plan` needs; all rates are per second, sizes in bytes.

    The KV shape is `kv_heads` and `head_dim` (MHA / GQA, sliding layers by `layer_types`), or
    `mla` with both of them None. At least one transfer stage is required: `read_mibps` and/or
    `read_iops` (with `io_block_bytes`) for storage, `link_gibps` for the link.
    """

    layers: int
    kv_heads: int | None
    head_dim: int | None
    dtype_bytes: int
    tokens: int
    prefill_tokens_per_s: float
    read_mibps: float | None = None
    read_iops: float | None = None
    io_block_bytes: int | None = None
    link_gibps: float | None = None
    min_ratio: float = DEFAULT_MIN_RATIO
    prefill_source: str = "given"  # how prefill_tokens_per_s was obtained, e.g. "measured on cpu"
    # per layer "full" or "sliding" (empty: every layer full); a sliding layer keeps the last `window` tokens
    layer_types: tuple[str, ...] = ()
    window: int | None = None
    mla: MLAShape | None = None
    tp: int = 1  # tensor-parallel ranks


def kept_token_layers(layers: int, layer_types: Sequence[str], window: int | None, tokens: int) -> int:
    """Sum over layers of the tokens each must keep for a sequence of `tokens`: all of them in a
    full layer, min(tokens, window) in a sliding one (ModelDims.kv_bytes, without a model)."""
    if not layer_types:
        return layers * tokens
    sliding = sum(t == "sliding" for t in layer_types)
    return (layers - sliding) * tokens + sliding * min(tokens, window or tokens)


@dataclass(frozen=True)
class PlanResult:
    """The plan: payload size, path bandwidth, load vs prefill time, and the verdict."""

    kv_bytes_per_token: int
    payload_bytes: int
    path_bytes_per_s: float
    t_load_min_s: float
    t_prefill_s: float
    recommended_ratio: float
    verdict: str  # "load" or "recompute"
    tokens: int
    prefill_tokens_per_s: float
    prefill_source: str
    min_ratio: float
    bottleneck: str  # name of the slowest stage
    stages: tuple[Stage, ...]
    # KV accounting per layer type: `payload_bytes` counts a sliding layer at min(tokens, window)
    # tokens, `uniform_payload_bytes` every layer at every token (2 * L * n * h * d * b)
    layers_by_type: dict[str, int] = field(default_factory=dict)
    window: int | None = None
    uniform_payload_bytes: int = 0
    # the attention kind ("mha": MHA / GQA, "hybrid": some sliding layers, "mla"); an MLA layer's latent
    # and RoPE key dims (None for the others); `bytes_per_token` = `kv_bytes_per_token`
    attention: str = "mha"
    latent_dim: int | None = None
    rope_head_dim: int | None = None
    bytes_per_token: int = 0
    # the MHA formula 2 * L * n * h * d * b over the model's heads for the `tokens` (an MLA model: keys of
    # qk_nope + qk_rope dims and values of v_head_dim dims per head; None when its heads are not known)
    mha_equivalent_bytes: int | None = None
    mha_equivalent_bytes_per_token: int | None = None
    # tensor parallelism over `tp` ranks, for the payload: what each rank holds, what a store keeps when
    # every rank writes what it holds, and when every byte is written once (MLA: one rank writes)
    tp: int = 1
    bytes_per_rank: int = 0
    stored_bytes_every_rank: int = 0
    stored_bytes_single_copy: int = 0

    def to_dict(self) -> dict:
        """A JSON-ready dict; `stages` becomes a list of {name, bytes_per_s, limited_by}."""
        d = asdict(self)
        d["stages"] = [asdict(s) for s in self.stages]
        return d


def fmt_bytes(n: float) -> str:
    return format_bytes(n, sep=" ")


def _check_positive(value: float | None, what: str) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a positive number, got {value!r}")


def transfer_stages(
    read_mibps: float | None = None,
    read_iops: float | None = None,
    io_block_bytes: int | None = None,
    link_gibps: float | None = None,
) -> tuple[Stage, ...]:
    """Build the stages of the transfer path from the limits that were given.

    The storage stage is min(read bandwidth, IOPS x I/O block size) over the parts given;
    the link stage is `link_gibps`. Raises ValueError naming the flags to pass when no
    stage is given or when IOPS comes without a block size.
    """
    _check_positive(read_mibps, "read bandwidth (--read-mibps)")
    _check_positive(read_iops, "read IOPS (--read-iops)")
    _check_positive(io_block_bytes, "I/O block size (--io-block)")
    _check_positive(link_gibps, "link bandwidth (--link-gibps)")
    stages: list[Stage] = []
    storage_limits: list[tuple[float, str]] = []
    if read_mibps is not None:
        storage_limits.append((read_mibps * MIB, f"read bandwidth {read_mibps:g} MiB/s"))
    if read_iops is not None:
        if io_block_bytes is None:
            raise ValueError(
                "--read-iops needs the I/O block size: pass --io-block too (e.g. --io-block 16KiB)"
            )
        storage_limits.append(
            (read_iops * io_block_bytes, f"{read_iops:g} IOPS x {fmt_bytes(io_block_bytes)}")
        )
    if storage_limits:
        bps, why = min(storage_limits, key=lambda lim: lim[0])  # first wins a tie
        stages.append(Stage("storage", bps, why))
    if link_gibps is not None:
        stages.append(Stage("link", link_gibps * GIB, f"link {link_gibps:g} GiB/s"))
    if not stages:
        raise ValueError(
            "no transfer stage given: pass --read-mibps and/or --read-iops with --io-block "
            "(storage), and/or --link-gibps (host-to-device link)"
        )
    return tuple(stages)


def recommended_ratio(t_load_s: float, t_prefill_s: float, min_ratio: float = DEFAULT_MIN_RATIO) -> float:
    """CacheBlend's rule: r = max(r_min, T_load / T_prefill), capped at 1.0."""
    return min(1.0, max(min_ratio, t_load_s / t_prefill_s))


MLA_AND_MHA = ("--kv-lora-rank/--rope-head-dim (MLA: one latent per layer shared by all heads) and "
               "--kv-heads/--head-dim (MHA/GQA: K and V per head) describe different caches; pass one pair, not both")


def heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads each of `tp` tensor-parallel ranks holds (vLLM's rule): kv_heads / tp when tp divides
    them, one (each head on tp / kv_heads ranks) when kv_heads divides tp; ValueError otherwise."""
    if kv_heads % tp == 0:
        return kv_heads // tp
    if tp % kv_heads == 0:
        return 1
    raise ValueError(f"--tp {tp} does not split {kv_heads} KV heads evenly: pass a --tp that divides {kv_heads} "
                     f"or a multiple of it")


def _check_positive_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def plan(inputs: PlanInputs) -> PlanResult:
    """Compute the transfer budget for `inputs`. Pure: no I/O.

    Verdict "load" when the load-time lower bound is below the prefill time (the load can
    then be hidden behind recomputing `recommended_ratio` of the tokens), else "recompute"
    with the ratio capped at 1.0. The payload is what the sequence must keep to go on
    decoding: a sliding layer's last min(tokens, window) tokens, every token of a full
    layer; an MLA layer's latent and RoPE key per token. The load is timed for the whole
    payload through the path whatever `tp` is. Raises ValueError for invalid inputs.
    """
    mla = inputs.mla
    if mla is not None and (inputs.kv_heads is not None or inputs.head_dim is not None):
        raise ValueError(MLA_AND_MHA)
    dims = ((mla.latent_dim, "latent dim (--kv-lora-rank)"), (mla.rope_head_dim, "RoPE head dim (--rope-head-dim)")
            ) if mla is not None else ((inputs.kv_heads, "kv heads (--kv-heads)"), (inputs.head_dim, "head dim (--head-dim)"))
    for value, what in ((inputs.layers, "layers (--layers)"), *dims, (inputs.tokens, "tokens (--tokens)"),
                        (inputs.tp, "tensor-parallel ranks (--tp)")):
        _check_positive_int(value, what)
    if inputs.dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype bytes (--dtype-bytes) must be 1, 2 or 4, got {inputs.dtype_bytes!r}")
    _check_positive(inputs.prefill_tokens_per_s, "prefill rate (--prefill-tokens-per-s)")
    if not 0.0 <= inputs.min_ratio <= 1.0:
        raise ValueError(f"minimum recompute ratio (--min-ratio) must be in [0, 1], got {inputs.min_ratio!r}")
    stages = transfer_stages(inputs.read_mibps, inputs.read_iops, inputs.io_block_bytes, inputs.link_gibps)
    bottleneck = min(stages, key=lambda s: s.bytes_per_s)  # first wins a tie
    if inputs.layer_types and (len(inputs.layer_types) != inputs.layers or not set(inputs.layer_types) <= {
            "full", "sliding"} or ("sliding" in inputs.layer_types and not (inputs.window or 0) > 0)):
        raise ValueError(f"layer types must be {inputs.layers} of full / sliding, with a window > 0 for sliding ones; "
                         f"got {inputs.layer_types!r} and window {inputs.window!r}")
    if mla is not None and "sliding" in inputs.layer_types:
        raise ValueError("an MLA model's layers are all full attention here; drop the sliding layer types")
    types = inputs.layer_types or ("full",) * inputs.layers
    kept = kept_token_layers(inputs.layers, inputs.layer_types, inputs.window, inputs.tokens)
    if mla is not None:
        attention = "mla"
        per_layer_token = mla_bytes_per_token(1, mla.latent_dim, mla.rope_head_dim, inputs.dtype_bytes)
        mha_per_token = mla.mha_bytes_per_token(inputs.layers, inputs.dtype_bytes)
        rank_share = (1, 1)  # every rank holds the whole latent
    else:
        attention = "hybrid" if "sliding" in types else "mha"
        per_layer_token = kv_bytes_per_token(1, inputs.kv_heads, inputs.head_dim, inputs.dtype_bytes)
        mha_per_token = per_layer_token * inputs.layers
        rank_share = (heads_per_rank(inputs.kv_heads, inputs.tp), inputs.kv_heads)
    per_token = per_layer_token * inputs.layers
    uniform = per_token * inputs.tokens
    payload = per_layer_token * kept
    per_rank = payload * rank_share[0] // rank_share[1]  # exact: payload is a multiple of the KV heads
    t_load = payload / bottleneck.bytes_per_s
    t_prefill = inputs.tokens / inputs.prefill_tokens_per_s
    return PlanResult(
        kv_bytes_per_token=per_token,
        payload_bytes=payload,
        path_bytes_per_s=bottleneck.bytes_per_s,
        t_load_min_s=t_load,
        t_prefill_s=t_prefill,
        recommended_ratio=recommended_ratio(t_load, t_prefill, inputs.min_ratio),
        verdict="load" if t_load < t_prefill else "recompute",
        tokens=inputs.tokens,
        prefill_tokens_per_s=inputs.prefill_tokens_per_s,
        prefill_source=inputs.prefill_source,
        min_ratio=inputs.min_ratio,
        bottleneck=bottleneck.name,
        stages=stages,
        layers_by_type={t: types.count(t) for t in ("full", "sliding") if t in types},
        window=inputs.window if "sliding" in types else None,
        uniform_payload_bytes=uniform,
        attention=attention,
        latent_dim=mla.latent_dim if mla is not None else None,
        rope_head_dim=mla.rope_head_dim if mla is not None else None,
        bytes_per_token=per_token,
        mha_equivalent_bytes=None if mha_per_token is None else mha_per_token * inputs.tokens,
        mha_equivalent_bytes_per_token=mha_per_token,
        tp=inputs.tp,
        bytes_per_rank=per_rank,
        stored_bytes_every_rank=per_rank * inputs.tp,
        stored_bytes_single_copy=payload,
    )


@dataclass(frozen=True)
class ModelKVShape:
    """KV-relevant dims read from a model config (no weights loaded): KV heads and head dim, or
    `mla` (both None then). `unsupported`: why the runner cannot run the model (None: it can)."""

    layers: int
    kv_heads: int | None
    head_dim: int | None
    layer_types: tuple[str, ...] = ()  # per layer full / sliding (empty: all full)
    window: int | None = None
    mla: MLAShape | None = None
    unsupported: str | None = None


def mla_kv_shape(config: Any, source: str) -> ModelKVShape | None:
    """The MLA shape of a config (a mapping, e.g. a config.json, or a transformers config), or None
    when it has no kv_lora_rank. ValueError naming the field when a dim is not a positive integer."""
    from blend.model.loading import MLA_UNSUPPORTED, mla_config

    body = mla_config(config if isinstance(config, dict) else config.to_dict())
    if body is None:
        return None
    dims: dict[str, int | None] = {}
    for name in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "num_attention_heads",
                 "qk_nope_head_dim", "v_head_dim"):
        value = body.get(name)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not ok and name in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim"):
            raise ValueError(f"{source}: MLA config field {name} must be a positive integer, got {value!r}")
        dims[name] = value if ok else None  # a head dim that is missing only leaves the MHA equivalent unknown
    mla = MLAShape(dims["kv_lora_rank"], dims["qk_rope_head_dim"], dims["num_attention_heads"],
                   dims["qk_nope_head_dim"], dims["v_head_dim"])
    reason = MLA_UNSUPPORTED.format(arch=body.get("model_type"), rank=mla.latent_dim)
    return ModelKVShape(dims["num_hidden_layers"], None, None, mla=mla, unsupported=reason)


def model_kv_shape(model_name: str) -> ModelKVShape:
    """Read layers, KV heads and head dim (an MLA model: its latent and RoPE key dims) from the
    config of an alias, a shape or a local model.

    Reads only the config (for GGUF, the metadata), not the weights. A local directory whose
    config.json has kv_lora_rank is read as MLA from the JSON itself (transformers need not know
    its model type).
    """
    from blend.model.loading import check_supported, local_config_json, model_config

    raw = local_config_json(model_name)
    shape = mla_kv_shape(raw, f"{model_name}/config.json") if raw is not None else None
    if shape is not None:
        return shape
    config = model_config(model_name)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = mla_kv_shape(config, model_name)
    if shape is not None:
        return shape
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    try:  # layer types of a model the runner supports; another model's KV is counted uniformly
        dims = check_supported(config)
    except ValueError as err:
        return ModelKVShape(int(config.num_hidden_layers), int(kv_heads), int(head_dim), unsupported=str(err))
    return ModelKVShape(int(config.num_hidden_layers), int(kv_heads), int(head_dim), dims.layer_types, dims.window)


@dataclass(frozen=True)
class PrefillProfile:
    """A measured prefill rate and where it was measured."""

    tokens_per_s: float
    device: str
    tokens: int
    seconds: float  # median time of one prefill over `tokens` tokens


def profile_prefill(model_name: str, tokens: int = PROFILE_TOKENS, repeats: int = 3) -> PrefillProfile:
    """Load `model_name` and time a forward prefill over `tokens` random token ids.

    One untimed warm-up pass, then the median of `repeats` timed passes (synchronized on
    CUDA). Side effect: loads the model weights (seconds). The rate is extrapolated
    linearly to other lengths by the caller, which underestimates long prefills a little
    (attention is quadratic).
    """
    import torch

    from blend.model.loading import load_model

    if tokens <= 0:
        raise ValueError(f"profile tokens must be a positive integer, got {tokens!r}")
    loaded = load_model(model_name)
    model, device = loaded.model, loaded.device
    tokens = min(tokens, loaded.dims.max_positions)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.dims.vocab_size, (1, tokens), generator=gen).to(device)  # (1, T)

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()  # warm-up: kernels, allocator, lazy init
    seconds = statistics.median(once() for _ in range(max(1, repeats)))
    return PrefillProfile(tokens / seconds, str(device), tokens, seconds)


def measure_prefill_tokens_per_s(model_name: str, tokens: int = PROFILE_TOKENS) -> float:
    """Prefill throughput of `model_name` in tokens/s, measured by `profile_prefill`."""
    return profile_prefill(model_name, tokens).tokens_per_s


# ------------------------------------------------------------------ cost models
EMA_WEIGHT = 0.5  # weight of the newest observation in the running bandwidth estimates
MIN_OBSERVED_BYTES = 256 << 10  # smaller loads say more about per-call overhead than bandwidth
COMPUTE_SAMPLES = 16
# Bandwidth assumed before a tier was ever read from (GB/s), and the rates of the calibrated cost
# model (engine.blend.split: auto). Memory reads hand out views (a copy happens in placement); disk and
# Redis figures are modest cold reads.
PRIOR_READ_GBPS: dict[str, float] = {"cpu": 50.0, "computed": 10.0, "disk": 1.5, "redis": 1.0, "redis-cluster": 1.0}
PRIOR_PLACE_GBPS: dict[str, float] = {"cuda": 20.0, "cpu": 4.0}
# The calibration of a model's compute (`measure_layer_cost`): plain prefills of these many random
# tokens, smallest first, until one takes CALIBRATION_STOP_S (a large model on a CPU stops early);
# each size the fastest of CALIBRATION_REPEATS runs (a busy moment only ever slows a run).
CALIBRATION_ROWS: tuple[int, ...] = (16, 64, 256, 1024, 4096)
CALIBRATION_STOP_S = 0.25
CALIBRATION_REPEATS = 2


class PrefillCosts:
    """How long the model takes to compute: seconds per layer as a function of the rows computed
    in it (`LayerCost`). One per model (`for_model`): engines sharing a model share it.
    Thread-safe. Two estimates, kept apart:

    - `calibrated(runner)`: measured once, on the first call, by timed prefills of fixed sizes
      (`measure_layer_cost`), then never changed: what `engine.blend.split: auto` decides with.
    - `layer_cost()`: the live estimate, interpolated through the last `COMPUTE_SAMPLES`
      requests' (rows per layer, seconds per layer) points (`observe`): what
      `engine.blend.split: adaptive` decides with.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calibration = threading.Lock()  # held while measuring: a second engine waits and reuses it
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=COMPUTE_SAMPLES)  # (layers, rows, seconds)
        self._calibrated: LayerCost | None = None

    @classmethod
    def for_model(cls, model: Any) -> PrefillCosts:
        """The prefill costs of a loaded model (an nn.Module), created on first use."""
        with _COST_LOCK:
            found = _PREFILL_COSTS.get(model)
            if found is None:
                found = _PREFILL_COSTS[model] = cls()
            return found

    @property
    def is_calibrated(self) -> bool:
        return self._calibrated is not None

    def calibrated(self, runner: Runner) -> LayerCost:
        """The calibrated estimate: measured with `runner` (its model's) on the first call, on the
        calling thread (the thread that owns the model: the engine's scheduler), the same
        object on every later call."""
        with self._calibration:
            if self._calibrated is None:
                self._calibrated = measure_layer_cost(runner)
            return self._calibrated

    def observe(self, rows_per_layer: Sequence[int], seconds: float) -> None:
        """One request computed `rows_per_layer[l]` rows in layer l in `seconds` (not waiting for loads).

        A request of about the same size as a kept sample (rows within 15%) updates that
        sample instead of adding one: a faster time replaces it at once, a slower one moves
        it half way. So the first request of a process (kernel selection, allocator warm-up,
        several times slower on a GPU) or a busy moment cannot stand for the model's speed,
        while a lasting slowdown still shows within a few requests. Never changes the
        calibrated estimate."""
        if seconds <= 0 or not rows_per_layer or sum(rows_per_layer) <= 0:
            return
        layers, rows, seconds = len(rows_per_layer), int(sum(rows_per_layer)), float(seconds)
        with self._lock:
            for i, (n0, r0, t0) in enumerate(self._samples):
                if n0 == layers and abs(r0 - rows) <= 0.15 * max(r0, rows):
                    scaled = seconds * r0 / rows  # this request's time at the sample's size
                    self._samples[i] = (n0, r0, scaled if scaled <= t0 else 0.5 * (t0 + scaled))
                    return
            self._samples.append((layers, rows, seconds))

    def layer_cost(self) -> LayerCost | None:
        """The live estimate: seconds per layer as a function of the rows it computes, or None
        before any observation."""
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return None
        return LayerCost([(r / n, t / n) for n, r, t in samples])


def measure_layer_cost(runner: Runner) -> LayerCost:
    """Seconds per layer of `runner`'s model for r rows, measured now: plain prefills (the last
    row's logits, as a request's) of CALIBRATION_ROWS random tokens (up to the model's
    positions), after one untimed warm-up; each size the fastest of CALIBRATION_REPEATS runs,
    synchronised on CUDA; sizes stop growing once a run takes CALIBRATION_STOP_S. Side
    effects: runs the model (tenths of a second for SmolLM2 on 2 cores; seconds for a large
    model on a CPU), on the calling thread."""
    import torch

    device = runner.device
    generator = torch.Generator().manual_seed(0)
    vocab = int(runner.lm_head.weight.shape[0])
    sizes = sorted({min(r, runner.max_positions) for r in CALIBRATION_ROWS})
    points: list[tuple[float, float]] = []

    def timed(fn: Any) -> float:
        """Seconds of one call of fn (CUDA synchronised on both sides)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    def once(ids: torch.Tensor) -> float:
        cache = runner.new_cache(int(ids.numel()))
        return timed(lambda: runner.prefill(ids, cache))

    with torch.inference_mode():
        for n, rows in enumerate(sizes):
            ids = torch.randint(0, vocab, (rows,), generator=generator).to(device)  # (rows,)
            if n == 0:
                once(ids)  # warm-up: kernel selection, allocator, lazy init
            best = min(once(ids) for _ in range(CALIBRATION_REPEATS))
            points.append((float(rows), best / runner.num_layers))
            if best >= CALIBRATION_STOP_S:
                break
        # attention alone at the largest size: its price per (query, key) pair
        n = int(points[-1][0])
        q = torch.randn(runner.num_heads, n, runner.head_dim, generator=generator).to(device, runner.dtype)
        k = torch.randn(runner.kv_heads, n, runner.head_dim, generator=generator).to(device, runner.dtype)
        positions = torch.arange(n)

        def attend() -> float:
            return timed(lambda: runner.attend(q, positions, k, k))

        attend()  # its plan, its kernel's first call
        pair_s = min(attend() for _ in range(CALIBRATION_REPEATS)) / (n * (n + 1) / 2)  # the fastest, as above
    return LayerCost(points, pair_s)


class LayerCost:
    """Seconds one layer takes for r rows, interpolated through observed (rows, seconds) points.

    Between points: linear; below the smallest: proportional to rows (an optimistic
    guess until a small request is seen: a plan then rather loads than computes; on a GPU
    the first small request shows the layer's fixed cost of launches and weight reads);
    above the largest: proportional to rows. Times are made non-decreasing in rows by
    capping each point at the time of every larger one: more rows never cost less, so a
    larger request's time bounds a smaller one's (a slow small sample, e.g. the first call
    of a new kernel shape, cannot make full prefills look slower than they were measured,
    and no small sample ever lowers a larger one).
    A GPU layer costs about the same for 20 rows as for 500 (launch-bound) and grows with
    rows only past a few thousand: a single straight line fits both ends badly. Immutable.
    """

    def __init__(self, points: Sequence[tuple[float, float]], pair_s: float = 0.0):
        if not points:
            raise ValueError("a layer cost needs at least one (rows, seconds) point")
        # seconds per (query, key) pair of attention past the pairs a point's plain prefill had:
        # rows attending over a longer context (a blend's rows over the whole prompt, a prefill
        # longer than the largest point) cost more than a prefill of as many rows
        self.pair_s = max(0.0, float(pair_s))
        merged: list[tuple[float, float]] = []
        for rows, seconds in sorted(points):
            if merged and rows <= merged[-1][0] * 1.0001:
                merged[-1] = (merged[-1][0], min(merged[-1][1], seconds))
            else:
                merged.append((rows, seconds))
        capped: list[tuple[float, float]] = []
        cap = float("inf")
        for rows, seconds in reversed(merged):
            cap = min(cap, seconds)
            capped.append((rows, cap))
        self.points: tuple[tuple[float, float], ...] = tuple(capped[::-1])

    def with_pairs(self, rows: float, pairs: float) -> float:
        """One layer computing `rows` rows that attend over `pairs` (query, key) pairs in all: the
        rows' cost plus `pair_s` for every pair past those a plain prefill of `rows` rows (as the
        points were measured; past the largest point, `rows` rows over its length) includes."""
        if rows <= 0:
            return 0.0
        included = rows * (min(rows, self.points[-1][0]) + 1) / 2
        return self(rows) + self.pair_s * max(0.0, pairs - included)

    def __call__(self, rows: float) -> float:
        pts = self.points
        if rows <= pts[0][0]:
            return pts[0][1] * rows / pts[0][0] if pts[0][0] > 0 else pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:], strict=False):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        r_max, t_max = pts[-1]
        return t_max * rows / r_max

    def __repr__(self) -> str:
        return f"LayerCost({list(self.points)!r})"


class LoadCosts:
    """How long loads take from one tier stack into one device: per tier, the host time its
    reads take (bytes / read bandwidth); then placement (copies into the cache, on the
    device when it is a GPU). On a GPU the reads, the copies and compute overlap; on a CPU
    the loader reads then places, and only its reads overlap compute. Thread-safe. One per
    engine (tiers are the engine's). Live estimates (`observe`) where a tier was read,
    the priors of its kind (PRIOR_READ_GBPS, PRIOR_PLACE_GBPS) elsewhere; `rates(live=False)`:
    the priors only (the calibrated cost model's).
    """

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self._lock = threading.Lock()
        self._read_bps: dict[str, float] = {}
        self._place_bps: float | None = None

    @property
    def pipelined(self) -> bool:
        """Whether placement overlaps reads and compute (a copy engine does it)."""
        return self.device_type == "cuda"

    def observe(self, bytes_by_tier: dict[str, int], read_s_by_tier: dict[str, float], place_s: float, *,
                other_bytes: int = 0) -> None:
        """One request's loads: bytes and host read time per tier name, and placement time;
        `other_bytes`: bytes placed in that time that no tier read (entries computed by the
        request), without which the placement rate would come out far too low (a request
        that read 1 MB and placed 50 MB of computed documents once priced loads at 13 MB/s,
        and the split then computed every later request whole)."""
        with self._lock:
            for name, nbytes in bytes_by_tier.items():
                seconds = read_s_by_tier.get(name, 0.0)
                if nbytes >= MIN_OBSERVED_BYTES and seconds > 0:
                    self._read_bps[name] = _ema_rate(self._read_bps.get(name), nbytes / seconds)
            total = sum(bytes_by_tier.values()) + other_bytes
            if total >= MIN_OBSERVED_BYTES and place_s > 0:
                self._place_bps = _ema_rate(self._place_bps, total / place_s)

    def read_seconds(self, name: str, kind: str, nbytes: int) -> float:
        """Host time to read `nbytes` from the tier `name` (of `kind`): the live estimate, else the prior."""
        with self._lock:
            bps = self._read_bps.get(name)
        if bps is None:
            bps = PRIOR_READ_GBPS.get(kind, 1.0) * 1e9
        return nbytes / bps

    def place_seconds(self, nbytes: int) -> float:
        """Time to move `nbytes` into the cache (device copies and placement on a GPU): the live
        estimate, else the prior."""
        with self._lock:
            bps = self._place_bps
        if bps is None:
            bps = PRIOR_PLACE_GBPS.get(self.device_type, 4.0) * 1e9
        return nbytes / bps

    def rates(self, tier_kinds: Mapping[str, str], *, live: bool) -> tuple[dict[str, float], float]:
        """(read bytes/s per tier name of `tier_kinds` (name -> kind), placement bytes/s): with
        `live`, the estimates where observed and the priors elsewhere; else the priors only."""
        with self._lock:
            read = dict(self._read_bps) if live else {}
            place = self._place_bps if live else None
        reads = {name: read.get(name, PRIOR_READ_GBPS.get(kind, 1.0) * 1e9) for name, kind in tier_kinds.items()}
        reads.setdefault("computed", read.get("computed", PRIOR_READ_GBPS["computed"] * 1e9))
        return reads, place if place is not None else PRIOR_PLACE_GBPS.get(self.device_type, 4.0) * 1e9

    def snapshot(self) -> dict[str, Any]:
        """The current estimates (GB/s), for stats and benchmarks."""
        with self._lock:
            return {"read_gbps": {k: v / 1e9 for k, v in self._read_bps.items()},
                    "place_gbps": self._place_bps / 1e9 if self._place_bps else None}


@dataclass(frozen=True)
class CostModel:
    """The prices one load-or-compute decision is made with: immutable, read by the split
    (blend.planning.split) and by any other planner that weighs computing against loading
    (`Splitter.cost_model()` hands out the engine's).

    `layer`: seconds one layer takes for r rows; `read_bps`: read bandwidth per tier name
    (and "computed": an entry in memory); `place_bps`: placement into the cache; `pipelined`:
    placement overlaps reads and compute (CUDA) rather than running on the compute threads
    (CPU); `source`: "calibrated" (engine.blend.split: auto, fixed for the engine's life) or "live"
    (engine.blend.split: adaptive, a snapshot of the running estimates).
    """

    layer: LayerCost
    read_bps: Mapping[str, float]
    place_bps: float
    pipelined: bool
    source: str

    def layer_seconds(self, rows: float) -> float:
        """One layer computing `rows` rows."""
        return self.layer(rows)

    def compute_seconds(self, rows_per_layer: Sequence[float]) -> float:
        """A layer loop computing rows_per_layer[l] rows in layer l (nothing loaded)."""
        return sum(self.layer(r) for r in rows_per_layer)

    def prefill_seconds(self, tokens: int, num_layers: int) -> float:
        """A plain prefill of `tokens` tokens through `num_layers` layers (e.g. a full prefill, or a
        missed document computed after its context: its own tokens)."""
        return num_layers * self.layer(tokens)

    def read_seconds(self, tier: str, nbytes: int) -> float:
        """Host time to read `nbytes` from the tier named `tier` (an unknown name: 1 GB/s)."""
        return nbytes / self.read_bps.get(tier, 1e9)

    def place_seconds(self, nbytes: int) -> float:
        """Time to place `nbytes` into the cache."""
        return nbytes / self.place_bps

    def load_per_layer(self, bytes_by_tier: Mapping[str, int]) -> tuple[float, float]:
        """For one layer's bytes per tier name: (seconds of the load beside compute, seconds of
        placement on the compute threads). Pipelined (CUDA): max(reads, placement), 0; else
        reads, placement."""
        read = sum(self.read_seconds(name, nbytes) for name, nbytes in bytes_by_tier.items())
        place = self.place_seconds(sum(bytes_by_tier.values()))
        return (max(read, place), 0.0) if self.pipelined else (read, place)


def _ema_rate(old: float | None, new: float) -> float:
    """Running average of a rate, taken over its inverse (time per byte): one slow observation
    weighs as much as it costs, so a tier that turned slow is believed at once."""
    return new if old is None else 1.0 / ((1 - EMA_WEIGHT) / old + EMA_WEIGHT / new)


_COST_LOCK = threading.Lock()
_PREFILL_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------- CLI
