"""Layerwise runner: the loaded transformers model's own modules, one layer at a time,
with explicit positions.

Everything is batch size 1. Hidden states are (T, hidden); per-layer q is
(heads, T, head_dim) and k/v are (kv_heads, T, head_dim). A `KVCache` holds K/V for
positions 0..capacity-1 in slot order (slot i holds position i), so a query at position
p attends exactly the slots 0..p. The runner never infers positions from cache length:
every call takes them explicitly.

Per layer the runner can
  - `qkv`:    compute q/k/v (norm, projections, q/k-norm where the model has it, RoPE at
              the given positions) for any subset of token rows;
  - `attend`: attend those queries over a caller-supplied K/V with the exact causal mask
              by position;
  - `finish`: o_proj, residual, post-attention norm, MLP, residual for that subset only.

Layers of a hybrid model differ by attention type (`ModelDims.layer_types`): a sliding
layer's query at p attends only the keys p - window + 1 .. p (`attend(window=)`, exact
for any set of query rows), and its RoPE may use its own base (Gemma 3: 10k locally,
1M globally): `rope` then gives one cos/sin per RoPE kind, (T, K, D), and `qkv`,
`rotation` and `rerotate` take each layer's own. Gemma 3's sandwich norms (a norm after
attention and after the MLP too), its embedding scale and QK-norm are the model's own
modules, run in the model's order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from blend.model.attention import (
    TAIL,
    AttentionPlan,
    AttentionTuner,
    attention_with_sums,
    biased_attention,
    build_plan,
    candidates,
    causal_float_masks,
    cpu_decode_attention,
    cuda_event_timer,
    decode_attention,
    flash_attn_func,
    flex_biased_attention,
    flex_block_mask,
    flex_function,
    is_tail,
    needs_window,
    rule_strategy,
    run_plan,
    shape_bucket,
    shortcut_plan,
    wall_timer,
    window_plan,
)
from blend.model.cache import KVCache
from blend.model.decode_layer import DecodeLayer, DecodeStack
from blend.model.loading import LoadedModel, cpu_flags
from blend.model.mkl import warn_unless_strict
from blend.model.native import (
    blend_kernel,
    blend_kernel_path,
    decode_kernel,
    native_blend_attention,
    native_decode_attention_batch,
    native_rotate_into,
)
from blend.model.projections import Projections, projections_for

log = logging.getLogger(__name__)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (H, T, D) rotated by cos/sin (T, D): the rotation RoPE applies at each position.

    Same math as transformers' `x * cos + rotate_half(x) * sin` (both halves of cos/sin
    are equal), written with half-width products and no concatenation.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty_like(x)
    torch.addcmul(x1 * c, x2, s, value=-1, out=out[..., :half])  # x1 cos - x2 sin
    torch.addcmul(x2 * c, x1, s, out=out[..., half:])  # x2 cos + x1 sin
    return out



def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in three ops for any x (..., D) with cos (…, D) and sin_signed = sin with
    its first half negated (`Runner.rope_rows`): x cos + roll(x, D/2) sin_signed, i.e.
    [x1 c - x2 s, x2 c + x1 s]. The same products and sums as `apply_rope`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


# transformers' RMS norms that compute weight * (x * rsqrt(mean(x^2) + eps)).to(dtype) in
# float32: `rms_norm` runs them as one fused op (bitwise the same result)
PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMS norm module `norm` applied to x (..., hidden): one `F.rms_norm` for
    the plain kind (float32: weight included; else in float32, cast back, times the
    weight, as the module does), the module itself for any other kind."""
    if type(norm).__name__ not in PLAIN_RMS_NORMS:
        return norm(x)
    shape, eps = (x.shape[-1],), norm.variance_epsilon
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, shape, norm.weight, eps)
    return norm.weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)


class LayerWaiter(Protocol):
    """What fills a cache layer by layer beside the compute (blend.kv.loader.LayerLoader)."""

    def wait(self, layer: int) -> None: ...


class LayerNeeds:
    """What an item of a step does at each layer besides computing its rows: blend's selective
    recompute (blend.recompute.layers) waits for loads, corrects stale K/V, selects rows at check
    layers and sums the query's attention. `Runner.forward` calls these at every layer the item
    runs, with the item's current rows (positions (T,) int64 on the host, sorted); this base class
    needs nothing (every row goes on, nothing is summed)."""

    def wait(self, layer: int) -> None:
        """Before the layer reads the item's cache (a loader's wait; LoadStalled ends the item)."""

    def before_write(self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """q (H, T, D), k and v (Hkv, T, D) of the rows are computed; the cache still holds what it
        held at their positions (their loaded K/V): read it, correct other slots."""

    def keep(self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor | None:
        """After the rows' K/V are written: the local rows (T',) int64, sorted, that attend and go
        on to the next layer; None: all of them."""
        return None

    def summed(self, layer: int) -> torch.Tensor | None:
        """Local rows (among those kept) whose attention probabilities are summed per key at this
        layer ((S,) int64, sorted), or None."""
        return None

    def take_sums(self, layer: int, sums: torch.Tensor, values: torch.Tensor) -> None:
        """sums (Hkv, N) float32: each key's probability summed over the `summed` rows and the
        query heads of its KV head; values (Hkv, N, D): the layer's values."""


@dataclass(frozen=True)
class Rows:
    """One item of a `Runner.forward` step: rows of one sequence at explicit positions of its own
    cache, run through layers `layers` (first, end) (None: every layer).

    Rows enter layer `first` as `token_ids` (first 0) or as `hidden` states (a later layer range of
    the same rows). Their positions are start..start+T-1, or `positions` (sorted, scattered: a
    blend's recomputed rows). Each attends the cache's slots up to its own position (a sliding
    layer: its window), the slots written by the step included. `logit_rows`: the rows (as they
    enter the last layer) whose logits are wanted (None: the last one; (): none, only the K/V).
    `loads` is waited for before each layer reads the cache; `needs` acts at each layer
    (`LayerNeeds`)."""

    token_ids: torch.Tensor | None  # (T,) int64, on the host; None: `hidden` given
    cache: KVCache
    start: int = 0
    logit_rows: tuple[int, ...] | None = None
    loads: LayerWaiter | None = None
    positions: torch.Tensor | None = None  # (T,) int64 host, sorted (None: start..start+T-1)
    hidden: torch.Tensor | None = None  # (T, hidden) entering layer `layers[0]` > 0
    layers: tuple[int, int] | None = None
    needs: LayerNeeds | None = None

    def chunk(self, a: int, b: int) -> Rows:
        """Rows a..b-1 of contiguous token rows (their logit rows among them, renumbered)."""
        if self.token_ids is None or self.positions is not None:
            raise ValueError("only contiguous token rows are cut into chunks")
        wanted = [r - a for r in self.wanted(len(self)) if a <= r < b]
        logit_rows = None if wanted == [b - a - 1] else tuple(wanted)
        return dataclasses.replace(self, token_ids=self.token_ids[a:b], start=self.start + a, logit_rows=logit_rows)

    def __len__(self) -> int:
        if self.positions is not None:
            return int(self.positions.shape[0])
        return int((self.token_ids if self.token_ids is not None else self.hidden).shape[0])

    def span(self) -> tuple[int, int]:
        """(first, end) layers."""
        return self.layers if self.layers is not None else (0, self.cache.num_layers)

    def wanted(self, n: int) -> list[int]:
        """The local rows among n whose logits are wanted."""
        rows = [n - 1] if self.logit_rows is None else list(self.logit_rows)
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"logit rows {rows} are outside the item's {n} rows")
        return rows

    def decodes(self) -> bool:
        """A decode row: one token at its cache's end through every layer, its logits wanted."""
        return (len(self) == 1 and self.logit_rows is None and self.positions is None and self.hidden is None
                and self.layers is None and self.needs is None and self.start == self.cache.length)


@dataclass(frozen=True)
class Output:
    """What `Runner.forward` gives back for one item: the logits of its wanted rows (it ran the last
    layer) or the hidden states of its rows entering its `end` layer, and those rows' positions;
    `error` when the item failed alone (its loads stalled, its needs raised): nothing else is set."""

    positions: torch.Tensor  # (T',) int64 host
    logits: torch.Tensor | None = None  # (R, vocab) float32
    hidden: torch.Tensor | None = None  # (T', hidden)
    error: Exception | None = None


def cost(items: Sequence[Rows], key_rows: float | None = None) -> float:
    """Row-layers of work (a step's budget unit): each item's rows times the layers it runs; with
    `key_rows` (`Runner.key_rows`) a row attending K keys counts 1 + K / key_rows rows (a blend's
    few query rows attend every key of a long prompt)."""
    total = 0.0
    for it in items:
        first, end = it.span()
        rows = len(it)
        if key_rows:
            mean_keys = float(it.positions.float().mean()) + 1 if it.positions is not None else it.start + rows / 2
            rows = rows * key_weight(mean_keys, key_rows)
        total += rows * (end - first)
    return total


def key_weight(mean_keys: float, key_rows: float) -> float:
    """What a row attending `mean_keys` keys costs, in rows attending none (`cost`)."""
    return 1 + mean_keys / key_rows


class Cursor(Protocol):
    """A plan's model work as data, driven a step at a time (blend.engine.scheduler; alone:
    `drive`): `want` gives the items of its next step within `budget` row-layers (at least its
    smallest piece; None: no bound; `ready_only`: only work whose loads have arrived, [] when none
    has), `take` gets their outputs (raising an item's error: the plan falls back or fails)."""

    @property
    def done(self) -> bool: ...

    def want(self, budget: int | None = None, *, ready_only: bool = False) -> list[Rows]: ...

    def take(self, outs: list[Output]) -> None: ...


class RowsCursor:
    """Token rows a plan asked for (one `Rows`, or several items: a pass of documents), computed
    in pieces cut at multiples of `chunk` positions (the cut `Runner.forward` makes), item after
    item in order. Within a budget a piece runs a layer range per step (its hidden states carried
    to the next step): pieces advance as a wavefront, a later piece of an item never past the
    layers an earlier one has written. The layer ranges change no number (a row's layers are the
    same operations however they are grouped into steps); a piece of one row runs whole (alone
    through every layer it may be a decode row, which other kernels compute). `value`: the logits
    of the wanted rows (rows, vocab) (one item), or a list of them per item."""

    def __init__(self, items: Rows | Sequence[Rows], chunk: int, key_rows: float | None = None):
        self.single = isinstance(items, Rows)
        self.items: list[Rows] = [items] if isinstance(items, Rows) else list(items)
        self.chunk, self.key_rows = chunk, key_rows  # pieces priced as `cost` prices them
        self._next = [0] * len(self.items)  # rows of each item whose piece has started
        self._open: list[_Piece] = []  # pieces started and not through every layer, oldest first
        self._logits: list[list[torch.Tensor]] = [[] for _ in self.items]
        self._asked: list[tuple[_Piece, int]] = []  # the pieces `want` gave, with the layer each ends at

    @property
    def done(self) -> bool:
        return not self._open and all(d == len(it) for d, it in zip(self._next, self.items, strict=True))

    def _pieces(self) -> Iterator[_Piece]:
        """The open pieces, then the next ones, in order (a new one opened as it is reached)."""
        yield from list(self._open)
        for i, it in enumerate(self.items):
            n = len(it)
            while self._next[i] < n:
                a = self._next[i]
                b = min(n, ((it.start + a) // self.chunk + 1) * self.chunk - it.start)
                piece = _Piece(i, b, it if (a, b) == (0, n) else it.chunk(a, b))
                yield piece

    def want(self, budget: int | None = None, *, ready_only: bool = False) -> list[Rows]:
        out: list[Rows] = []
        self._asked, spent = [], 0.0
        ceiling: dict[int, int] = {}  # per item: the layer its last piece given reaches (later ones stop there)
        for piece in self._pieces():
            layers = piece.rows.span()[1]
            first = piece.layer
            per_layer = cost([piece.rows], self.key_rows) / layers
            end = min(layers, ceiling.get(piece.item, layers))
            if budget is not None and len(piece.rows) > 1:
                end = min(end, first + int((budget - spent) // per_layer))
                if not out:
                    end = max(end, first + 1)  # at least one layer of the first piece
            elif budget is not None and out and spent + per_layer * (layers - first) > budget:
                end = first  # a one-row piece runs whole or waits
            if end <= first:
                break
            if piece not in self._open:
                self._open.append(piece)
                self._next[piece.item] = piece.b
            out.append(piece.step(first, end, layers))
            self._asked.append((piece, end))
            spent += per_layer * (end - first)
            ceiling[piece.item] = end
        return out

    def take(self, outs: list[Output]) -> None:
        asked, self._asked = self._asked, []
        for (piece, end), out in zip(asked, outs, strict=True):
            if out.error is not None:
                raise out.error
            piece.layer, piece.hidden = end, out.hidden
            if out.logits is not None:
                self._logits[piece.item].append(out.logits)
                self._open.remove(piece)

    def value(self) -> torch.Tensor | list[torch.Tensor]:
        per_item = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in self._logits]
        return per_item[0] if self.single else per_item


class _Piece:
    """One piece of a `RowsCursor`: rows of item `item` up to row b-1 (`rows`), through `layer` so
    far (its hidden states entering that layer)."""

    def __init__(self, item: int, b: int, rows: Rows):
        self.item, self.b, self.rows = item, b, rows
        self.layer = 0
        self.hidden: torch.Tensor | None = None

    def step(self, first: int, end: int, layers: int) -> Rows:
        """The `Rows` of layers first..end-1 (the piece itself when that is all of them)."""
        if (first, end) == (0, layers):
            return self.rows
        if first == 0:
            return dataclasses.replace(self.rows, layers=(0, end))
        return dataclasses.replace(self.rows, token_ids=None, hidden=self.hidden, layers=(first, end))


@torch.inference_mode()
def rows4(fn: Any, x: torch.Tensor, single: bool = True) -> torch.Tensor:
    """fn(x) for a row-wise product over rows x (T, in). On a CPU, float32 products (MKL) of fewer
    than 12 rows run other kernels for the rows past the last multiple of 4 (measured: 1-3, 5-7
    and 9-11 rows give other bits than the same rows inside a larger product; 4, 8 and 12 on
    do not), so a row's bits would depend on the rows beside it: those run padded with zero rows
    to the next multiple of 4, each row then the same whatever else shares its step. bfloat16
    products of one row (oneDNN's and F.linear alike) take another path than two or more for wide
    inputs: with SmolLM2's 1536-wide down projection 8 of 150 random rows came out with other bits,
    Gemma 3's 2048-wide one 17 of 150; from two rows on, none, and none at widths up to 1024. With
    `single` a single bfloat16 row runs padded to two; without it `fn` pads where it must itself
    (`projections.Linear` does, per product shape)."""
    n = x.shape[0]
    padded = pad_rows(x, single)
    return fn(x) if padded is x else fn(padded)[:n]


def pad_rows(x: torch.Tensor, single: bool = True) -> torch.Tensor:
    """x (T, in) with the zero rows `rows4` adds (x itself when none)."""
    n = x.shape[0]
    if x.device.type != "cpu":
        return x
    if n < 12 and n % 4 and x.dtype == torch.float32:
        return torch.cat([x, x.new_zeros((4 - n % 4, *x.shape[1:]))])
    if single and n == 1 and x.dtype == torch.bfloat16:
        return torch.cat([x, x.new_zeros(x.shape)])
    return x


CHUNK_TOKENS = 256  # the default of engine.prefill_chunk_tokens (the engine sets its own)


def _pieces(it: Rows, chunk: int, num_layers: int) -> list[Rows]:
    """Contiguous token rows through every layer cut at multiples of `chunk` positions (the same cut
    whatever else runs); other items whole."""
    n = len(it)
    if it.token_ids is None or it.positions is not None or it.needs is not None or n < 2 or \
            it.span() != (0, num_layers):
        return [it]
    cuts = [it.start + n] if (it.start + n - 1) // chunk == it.start // chunk else \
        [*range((it.start // chunk + 1) * chunk, it.start + n, chunk), it.start + n]
    if len(cuts) == 1:
        return [it]
    out, a = [], 0
    for end in cuts:
        b = end - it.start
        out.append(it.chunk(a, b))
        a = b
    return out


def _merged(parts: list[Output]) -> Output:
    """The outputs of one item's pieces as the item's."""
    if len(parts) == 1:
        return parts[0]
    positions = torch.cat([p.positions for p in parts])
    for p in parts:
        if p.error is not None:
            return Output(positions, error=p.error)
    return Output(positions, logits=torch.cat([p.logits for p in parts]))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Runner:
    """Runs a supported decoder-only transformers model layer by layer."""

    def __init__(self, lm: LoadedModel, attention: str = "auto", weights: str | None = None):
        if attention not in ("auto", "sdpa", "flash"):
            raise ValueError(f"unknown attention backend {attention!r}; use auto, sdpa or flash")
        self.lm = lm
        inner = lm.model.model
        self.embed_tokens = inner.embed_tokens  # Gemma: scales by sqrt(hidden) itself
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = lm.model.lm_head
        d = lm.dims
        self.dims = d
        self.num_layers, self.num_heads, self.kv_heads, self.head_dim = d.num_layers, d.num_heads, d.kv_heads, d.head_dim
        self.max_positions = d.max_positions
        self.windows: tuple[int | None, ...] = tuple(d.layer_window(i) for i in range(d.num_layers))  # None: full
        # RoPE kinds: one (None) for most models; Gemma 3's rotary holds one per layer type
        per_type = isinstance(getattr(self.rotary, "rope_type", None), dict)
        self.rope_kinds: tuple[str | None, ...] = tuple(sorted(self.rotary.rope_type)) if per_type else (None,)
        types = list(getattr(lm.config, "layer_types", None) or [])
        self.layer_rope: tuple[int, ...] = (tuple(self.rope_kinds.index(t) for t in types) if per_type
                                            else (0,) * d.num_layers)  # each layer's RoPE kind
        self.inv_freqs = [getattr(self.rotary, "inv_freq" if k is None else f"{k}_inv_freq") for k in self.rope_kinds]
        self.sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm")  # norms before and after attn / MLP
        self.logit_softcap = getattr(lm.config, "final_logit_softcapping", None)
        self.scaling = self.layers[0].self_attn.scaling
        self.device = lm.device
        self.dtype = lm.dtype
        use_flash = attention == "flash" or (attention == "auto" and self.device.type == "cuda")
        if attention == "flash" and flash_attn_func is None:
            raise ValueError("attention='flash' needs the optional extra: pip install 'kvblend[gpu]'")
        # flash-attn kernels take fp16/bf16 only; fp32 models use SDPA on CUDA too
        self.use_flash = (use_flash and flash_attn_func is not None and self.device.type == "cuda"
                          and self.dtype in (torch.float16, torch.bfloat16))
        self._shifts: dict[tuple[int, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._plan: tuple[torch.Tensor, AttentionPlan] | None = None  # the last attention plan and its q_pos
        self._window_plans: dict[int, tuple[torch.Tensor, AttentionPlan]] = {}  # the same per window
        self._biased_window_plans: dict[int, tuple[torch.Tensor, AttentionPlan, list[torch.Tensor]]] = {}
        self._biased_plan: tuple[torch.Tensor, AttentionPlan, list[torch.Tensor]] | None = None  # biased attention's
        # scattered query rows: on CUDA the fastest exact strategy per shape, measured once
        # (the engine's warm-up and the benches' warm-ups absorb it); elsewhere a fixed rule
        self.autotune = self.device.type == "cuda"
        self.tuner = AttentionTuner(cuda_event_timer if self.autotune else wall_timer)
        # token rows of a prefill are cut at multiples of this many positions into items of their own
        # (`forward`): a row's attention then never depends on how many rows shared its step
        self.chunk_tokens = CHUNK_TOKENS
        # keys a row attends that cost as much as the row's linear layers (2 x parameters per layer
        # over 4 x heads x head_dim flops per key): SmolLM2 ~3,000
        cfg = lm.model.config
        params = (cfg.hidden_size * self.head_dim * (self.num_heads * 2 + self.kv_heads * 2)
                  + 3 * cfg.hidden_size * cfg.intermediate_size)
        self.key_rows = params / (2 * self.num_heads * self.head_dim)
        self.strategies: Counter[str] = Counter()  # attention calls per strategy run
        # the linear layers as few, prepacked products (bfloat16 on a CPU; None: the modules as they are)
        # `weights`: the policy for a GGUF's blocks (None: the one the model was loaded with)
        self.projections: Projections | None = projections_for(lm.model, lm.blocks, weights or lm.weights)
        self.qk_norm = getattr(self.layers[0].self_attn, "q_norm", None) is not None  # Qwen3, Gemma 3
        # decode rows of a layer whose products read packed blocks (Llama-style): the whole layer in one
        # native call (None: the torch ops below)
        self.decode_layers: tuple[DecodeLayer | None, ...] = tuple(
            DecodeLayer.build(self.layers[i], self.projections.layers[i], heads=self.num_heads,
                              kv_heads=self.kv_heads, head_dim=self.head_dim, scaling=self.scaling, dtype=self.dtype,
                              window=self.windows[i], sandwich=self.sandwich, qk_norm=self.qk_norm)
            if self.projections is not None and self.device.type == "cpu" else None
            for i in range(self.num_layers))
        # a step of decode rows only, every layer such a layer: all of them in one native call
        self.decode_stack = DecodeStack.build(self.decode_layers)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # decode's cos/sin (P, D) by position
        # CPU: the native kernels, built (once per machine) or loaded now, not inside the first request;
        # `native_blend`: query rows other than a plain causal block go through the blend kernel
        self.native_blend = False
        # `sdpa_tails`: contiguous rows ending at the last key without a bias or a window (a prefill's
        # pieces after its first) go through torch's SDPA instead, where its bfloat16 kernels run on AMX
        # tiles and the blend kernel does not: measured on a Xeon with AMX, 2 cores, the 13 pieces of a
        # 3.1k-token prompt take 31 ms a layer that way against 63 ms in the blend kernel with AVX-512 BF16
        # dot products. The blend kernel's own tiles (`blend_kernel_path` amx) are faster again (256 rows
        # over 3,107 keys: 3.7 against 4.4 ms a layer), and without AMX the blend kernel stays (on an AMD
        # EPYC the pieces through it beat the whole prompt's SDPA)
        self.sdpa_tails = False
        # CUDA: rows with a bias or a window through FlexAttention (one fused kernel; the masked SDPA groups
        # are the fallback, taken for good after a failure)
        self.use_flex = self.device.type == "cuda" and flex_function(self.device) is not None
        self._flex_masks: dict[int | None, tuple[torch.Tensor, int, Any]] = {}
        if self.device.type == "cpu":
            decode_kernel()
            self.native_blend = blend_kernel() is not None and self.dtype in (torch.float32, torch.bfloat16)
            self.sdpa_tails = (self.dtype == torch.bfloat16 and "amx_bf16" in cpu_flags()
                               and blend_kernel_path() != "amx")
            if self.dtype == torch.float32:
                warn_unless_strict()

    # ----------------------------------------------------------------- helpers
    def new_cache(self, capacity: int, ring: bool = False) -> KVCache:
        """An empty cache for `capacity` positions; with `ring`, sliding layers are rings of
        window + RING_SLACK slots from the start (a resumed conversation: its windows only)."""
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype, self.device,
                       windows=self.windows, ring=ring)

    def check_length(self, n: int, new_tokens: int = 0, shorten: str = "use fewer or shorter documents") -> None:
        """Raise if a prompt of n tokens plus `new_tokens` to generate does not fit the
        model's positions (the message says which of the two to reduce; `shorten`: how to
        make the prompt shorter)."""
        if n <= 0:
            raise ValueError("empty prompt: give at least one token")
        if n > self.max_positions:
            raise ValueError(
                f"prompt of {n} tokens is longer than the model's maximum of {self.max_positions} positions; {shorten}"
            )
        if n + new_tokens > self.max_positions:
            raise ValueError(
                f"prompt of {n} tokens plus {new_tokens} new tokens needs {n + new_tokens} positions, more than the "
                f"model's {self.max_positions}; ask for at most {max(self.max_positions - n, 0)} new tokens "
                f"(max_new_tokens) or {shorten}"
            )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for explicit integer positions (T,), as the model applies them (including
        YaRN's attention scaling), in the model dtype: (T, D), or (T, K, D) for a model with
        K RoPE kinds (one per layer type; `qkv` takes each layer's own). Rows index dim 0."""
        dummy = torch.empty(0, dtype=self.dtype, device=self.device)
        pos = positions.to(self.device)[None]
        if self.rope_kinds == (None,):
            cos, sin = self.rotary(dummy, pos)
            return cos[0], sin[0]
        pairs = [self.rotary(dummy, pos, kind) for kind in self.rope_kinds]
        return torch.stack([c[0] for c, _ in pairs], dim=1), torch.stack([s[0] for _, s in pairs], dim=1)

    def rope_rows(self, positions: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` of a few positions (a decode step's) read from a table of every position up
        to the largest asked so far (grown by doubling, built by `rope` itself: the same
        values). cos, sin_signed (B, D) or (B, K, D) (`rope`) in the model dtype, sin_signed
        being sin with its first half negated (what `rotate` takes)."""
        index = positions if isinstance(positions, torch.Tensor) else torch.tensor(positions, dtype=torch.long)
        need = int(index.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < need:
            size = min(max(need, 2 * (self._rope_table[0].shape[0] if self._rope_table else 512)), self.max_positions)
            cos, sin = self.rope(torch.arange(size))  # (P, D) or (P, K, D) each
            half = sin.shape[-1] // 2
            self._rope_table = (cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
        index = index.to(self.device)
        return self._rope_table[0][index], self._rope_table[1][index]

    def layer_rope_of(self, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (T, D) cos/sin of `layer` out of `rope`'s (or `rope_rows`') result."""
        if cos.dim() == 3:
            kind = self.layer_rope[layer]
            return cos[:, kind], sin[:, kind]
        return cos, sin

    def rotation(self, delta: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, D) float32 of the pure rotations R(delta) of `layer`'s RoPE for integer
        offsets (T,).

        The rotary module's own frequencies (so llama3/YaRN/linear rescaling included, and
        each layer type's own base) and its math (float32 angles), but never its attention
        scaling: a key computed at p already carries that factor once, and R(d) R(p) =
        R(p + d) moves it without adding another.
        """
        inv_freq = self.inv_freqs[self.layer_rope[layer]]
        freqs = delta.reshape(-1, 1).to(self.device).float() * inv_freq.float()  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos(), emb.sin()

    def rerotate(self, k: torch.Tensor, delta: torch.Tensor | int, layer: int = 0) -> torch.Tensor:
        """Move keys of `layer` rotated at positions p to positions p + delta (delta may be negative).

        RoPE rotations compose: R(p + d) = R(d) R(p), so rotating a cached key by the
        position shift gives exactly the key computed at the new position (with the
        layer's own RoPE frequencies). k: (kv_heads, T, D); delta: int or (T,) ints.
        Returns a new tensor (k itself when delta is 0); does not modify k.
        """
        if isinstance(delta, int):
            if delta == 0:
                return k
            cos, sin = self._shift(delta, k.dtype, layer)  # (1, D), broadcast over T
        else:
            cos, sin = self.rotation(delta, layer)
            cos, sin = cos.to(k.dtype), sin.to(k.dtype)
        return apply_rope(k, cos, sin)

    def rerotate_(self, k: torch.Tensor, delta: torch.Tensor | int, layer: int = 0) -> None:
        """In-place `rerotate` of k (Hkv, T, D) of `layer` (the loader's hot path: per layer per segment).

        delta: int (memoised cos/sin) or (T,) ints. Modifies k; delta 0 is a no-op.
        """
        if isinstance(delta, int):
            if delta == 0:
                return
            cos, sin = self._shift(delta, k.dtype, layer)  # (1, D)
        else:
            cos, sin = self.rotation(delta, layer)
            cos, sin = cos.to(k.dtype), sin.to(k.dtype)
        half = k.shape[-1] // 2
        c, s = cos[:, :half], sin[:, :half]
        x1, x2 = k[..., :half], k[..., half:]
        first = x1.clone()
        x1.mul_(c).addcmul_(x2, s, value=-1)  # x1 cos - x2 sin
        x2.mul_(c).addcmul_(first, s)  # x2 cos + x1 sin

    def rotate_into(self, dst: torch.Tensor, src: torch.Tensor, delta: int, layer: int = 0,
                    table: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """dst (Hkv, T, D) = src (Hkv, T, D, any float dtype) moved by `delta` positions
        (`rerotate`) of `layer`'s RoPE, computed in float32 and rounded once into dst's dtype;
        or, with `table` (cos, sin (T, D/2) float32), rotated by those angles row by row.

        The loader's placement into a bfloat16 / float16 cache: in-place rotation in those
        dtypes runs at ~0.4 GB/s on a CPU and rounds three times; this is ~6x faster there.
        """
        half = src.shape[-1] // 2
        if table is None:
            if delta == 0:
                dst.copy_(src)
                return
            cos, sin = self._shift(delta, torch.float32, layer)  # (1, D)
            table = (cos[:, :half], sin[:, :half])
        c, s = table
        if self.native_blend and native_rotate_into(dst, src, c, s):  # the same bits, one pass
            return
        x = src.float()  # (Hkv, T, D)
        x1, x2 = x[..., :half], x[..., half:]
        dst[..., :half] = x1 * c - x2 * s
        dst[..., half:] = x2 * c + x1 * s

    def _shift(self, delta: int, dtype: torch.dtype, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (1, D) of the pure rotation R(delta) of `layer`'s RoPE in `dtype`, memoised
        (the loader asks per layer per segment)."""
        kind = self.layer_rope[layer]
        key = (delta, dtype, kind)
        hit = self._shifts.get(key)
        if hit is None:
            cos, sin = self.rotation(torch.tensor([delta]), layer)
            hit = (cos.to(dtype), sin.to(dtype))
            if len(self._shifts) > 512:
                self._shifts.clear()
            self._shifts[key] = hit
        return hit

    # ------------------------------------------------------------ per layer
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden)."""
        return self.embed_tokens(token_ids.to(self.device))

    def qkv(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, lead: int = 0,
            cuts: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows h (T, hidden) at the positions whose `rope_rows` are cos, sin_signed ((T, D) or
        (T, K, D)) -> q (T, H, D), k and v (T, Hkv, D): projected, q/k-normed where the model
        does, q and k rotated in one call (`rotate`). The first `lead` rows are decode rows
        (`projections.Linear`: they may read other weights), `cuts` the other items' row counts
        (where the products' rows vary with the row count each item gets its own product)."""
        q, k, v = self.project_qkv(layer, h, lead, cuts)  # (T, H, D), (T, Hkv, D) x2
        if self.qk_norm:  # Qwen3, Gemma 3: normed per head, then rotated
            attn = self.layers[layer].self_attn
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        c, s = self.layer_rope_of(layer, cos, sin_signed)  # (T, D) of this layer's RoPE kind
        qk = rotate(torch.cat((q, k), dim=1), c[:, None], s[:, None])  # (T, H + Hkv, D)
        return qk[:, : q.shape[1]], qk[:, q.shape[1]:], v

    def heads_qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv` of rows h (T, hidden) at `positions` (T,) in attention's head-major layout: q (H, T, D),
        k and v (Hkv, T, D) (what `attend` takes; tests and studies compute layers by hand with it)."""
        q, k, v = self.qkv(layer, h, *self.rope_rows(positions))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def project_qkv(self, layer: int, h: torch.Tensor, lead: int = 0, cuts: tuple[int, ...] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm and the Q/K/V projections of rows h (T, hidden) (one product where the
        runner has `projections`): q (T, H, D), k and v (T, Hkv, D), before any q/k-norm or
        RoPE."""
        block = self.layers[layer]
        x = rms_norm(block.input_layernorm, h)
        t, d = x.shape[0], self.head_dim
        if self.projections is not None:
            q, k, v = (r[:t] for r in self.projections.layers[layer].qkv.split(pad_rows(x, single=False), lead=lead, cuts=cuts))  # (T, H*D), (T, Hkv*D) x2
            return q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d)
        attn = block.self_attn
        return tuple(rows4(proj, x).view(t, -1, d) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))

    def plan_attention(self, q_pos: torch.Tensor, tk: int, fold: int | None = None,
                       strategy: str | None = None) -> AttentionPlan:
        """How `attend` computes queries at positions q_pos (Tq,), sorted, over tk keys.

        Built once per set of query rows (`attend` keeps the last plan and reuses it while it
        is called with the same q_pos tensor and key count): the kernel choice, the query
        groups or bands and their masks or indices on the device. Reads q_pos on the host
        (one copy from the device if it lives there). `fold`: query heads per KV head folded
        into the rows of masked groups (default: all of them on CUDA, none elsewhere).
        `strategy` forces one of `groups`, `pad`, `merge` (optionally `/N` groups or bands,
        `/foldN`; see blend.attention); otherwise every row, the last rows and a single
        query take their one kernel, and other row sets take the fixed rule on a CPU, or on
        CUDA the strategy the tuner measured fastest for this shape bucket (a `tune` plan
        when the bucket has not been measured yet: `attend` measures it).
        """
        pos = q_pos.cpu() if q_pos.device.type != "cpu" else q_pos  # (Tq,)
        tq = pos.numel()
        if fold is None:  # fold GQA into the query rows where masked SDPA has no fast GQA kernel
            fold = self.num_heads // self.kv_heads if self.device.type == "cuda" else 1
        if strategy is not None:
            return build_plan(strategy, pos, tk, fold, self.device)
        plan = shortcut_plan(pos, tk, self.use_flash)
        if plan is not None:
            return plan
        if not self.autotune:
            if self.sdpa_tails and is_tail(pos, tk):
                return build_plan(TAIL, pos, tk, fold, self.device)
            return build_plan(rule_strategy(tq, tk), pos, tk, fold, self.device)
        bucket = shape_bucket(tq, tk)
        chosen = self.tuner.winner(bucket)
        if chosen is not None:
            return build_plan(chosen, pos, tk, fold, self.device)
        names = candidates(self.device, self.dtype, self.num_heads // self.kv_heads, is_tail(pos, tk))
        return AttentionPlan("tune", tq, tk, options=tuple(build_plan(n, pos, tk, fold, self.device) for n in names),
                             bucket=bucket)

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               plan: AttentionPlan | None = None, bias: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
        """Exact causal attention by position.

        q (H, Tq, D) at positions q_pos (Tq,), sorted ascending; k, v (Hkv, Tk, D) hold
        positions 0..Tk-1. A query at position p sees exactly the keys at positions <= p.
        `plan` (from `plan_attention`) is found or built when not given. A `tune` plan's
        first use times its candidates (synchronizing the device; see AttentionTuner) and
        from then on runs the winner. Counts the strategy run in `self.strategies`.
        `bias` (Hkv, Tk) float: a logit added to every query's score of each key (per KV
        head; `KVCache.bias`); then the rows go through masked groups with a float mask
        (`biased` in `strategies`). `window` (a sliding layer's, `windows[layer]`): a query
        at p sees only the keys p - window + 1 .. p (a `window` plan, built once per row
        set and window, once some row's window starts after key 0). Returns (Tq, H*D).
        """
        tq, tk = q.shape[1], k.shape[1]
        if self.native_blend and plan is None:
            out = self._attend_native(q, q_pos, k, v, bias, window)
            if out is not None:
                return out
        if self.use_flex and plan is None and (bias is not None or window is not None):
            out = self._attend_flex(q, q_pos, k, v, bias, window)
            if out is not None:
                return out
        if window is not None:
            pos = q_pos.cpu() if q_pos.device.type != "cpu" else q_pos
            if needs_window(pos, window):
                return self._attend_window(q, q_pos, pos, k, v, window, bias)
        if bias is not None:
            return self._attend_biased(q, q_pos, k, v, bias)
        if plan is None:
            cached = self._plan
            if cached is not None and cached[0] is q_pos and cached[1].tk == tk and cached[1].tq == tq:
                plan = cached[1]
            else:
                plan = self.plan_attention(q_pos, tk)
                self._plan = (q_pos, plan)  # keeps q_pos alive: its identity stays unique
        out = None
        if plan.kind == "tune":
            tuned, out = self._tune(q, k, v, plan)
            if self._plan is not None and self._plan[1] is plan:
                self._plan = (self._plan[0], tuned)  # later layers run the winner directly
            plan = tuned
        self.strategies[plan.strategy] += 1
        return out if out is not None else run_plan(plan, q, k, v, self.scaling)

    def _attend_native(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
        """`attend` by the native blend kernel (CPU): every row set except a plain causal block
        (every row from 0, no bias, no window that hides a key: torch's fused causal kernel is
        that shape's own) and, with `sdpa_tails`, the last rows. None where the kernel declines
        or leaves the rows to torch (the torch strategies run)."""
        tk = k.shape[1]
        if (bias is None and is_tail(q_pos, tk) and not needs_window(q_pos, window)
                and (int(q_pos[0]) == 0 or self.sdpa_tails)):
            return None  # a causal block, or the last rows where SDPA has AMX (`sdpa_tails`): torch's kernel
        return self._native(q, q_pos, k, v, bias, window, None)

    def _native(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor | None, window: int | None, sums: torch.Tensor | None) -> torch.Tensor | None:
        """One call of the native blend kernel into a new (Tq, H*D) output (and `sums`, when given);
        None where it declines."""
        pos = q_pos if q_pos.dtype == torch.int64 and q_pos.is_contiguous() else q_pos.long().contiguous()
        out = torch.empty((q.shape[1], q.shape[0] * q.shape[2]), dtype=q.dtype)
        if not native_blend_attention(q, pos, k, v, bias, self.scaling, window, out, sums):
            return None
        self.strategies["native"] += 1
        return out

    def _attend_flex(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
        """`attend` through FlexAttention (CUDA): the block mask built once per row set, key count and
        window; None after a failure (logged once; the torch strategies run from then on)."""
        tk = k.shape[1]
        hit = self._flex_masks.get(window)
        try:
            if hit is None or hit[0] is not q_pos or hit[1] != tk:
                pos = q_pos.cpu() if q_pos.device.type != "cpu" else q_pos
                hit = (q_pos, tk, flex_block_mask(pos, tk, window, self.device))  # keeps q_pos alive
                self._flex_masks[window] = hit
            out = flex_biased_attention(q, k, v, bias, self.scaling, hit[2])
        except Exception as err:  # noqa: BLE001 - a kernel this GPU or torch cannot build: the fallback
            log.warning("FlexAttention failed (%s: %s); biased and windowed attention use masked SDPA from now on",
                        type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            self.use_flex = False
            return None
        self.strategies["flex"] += 1
        return out

    def attend_with_sums(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         window: int | None = None, bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` that also sums each key's attention probability over the query rows and the query
        heads of its KV head: (Tq, H*D) and (Hkv, Tk) float32. The native kernel on a CPU (one call),
        else exact torch math in float32 (`attention_with_sums`)."""
        if self.native_blend:
            sums = torch.empty((k.shape[0], k.shape[1]), dtype=torch.float32)
            out = self._native(q, q_pos, k, v, bias, window, sums)
            if out is not None:
                return out, sums
        return attention_with_sums(q, q_pos, k, v, self.scaling, window, bias)

    def _attend_biased(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor) -> torch.Tensor:
        """`attend` with a per-key logit bias: one call with a broadcast mask for a single
        query that sees every key, else masked groups (plan built once per row set)."""
        tq, tk = q.shape[1], k.shape[1]
        cached = self._biased_plan
        if cached is not None and cached[0] is q_pos and cached[1].tk == tk and cached[1].tq == tq:
            plan, masks = cached[1], cached[2]
        else:
            pos = q_pos.cpu() if q_pos.device.type != "cpu" else q_pos
            plan = (AttentionPlan("all", tq, tk) if tq == 1 and int(pos[0]) >= tk - 1
                    else build_plan("groups", pos, tk, 1, self.device))
            masks = causal_float_masks(plan, q.dtype)
            self._biased_plan = (q_pos, plan, masks)  # keeps q_pos alive: its identity stays unique
        self.strategies["biased"] += 1
        return biased_attention(q, k, v, bias, self.scaling, plan, masks)

    def _attend_window(self, q: torch.Tensor, q_pos: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, window: int, bias: torch.Tensor | None) -> torch.Tensor:
        """`attend` in a sliding-window layer (plans kept per window for the same q_pos tensor)."""
        tq, tk = q.shape[1], k.shape[1]
        if bias is None:
            cached = self._window_plans.get(window)
            if cached is not None and cached[0] is q_pos and cached[1].tk == tk and cached[1].tq == tq:
                plan = cached[1]
            else:
                plan = window_plan(pos, tk, window, self.device)
                self._window_plans[window] = (q_pos, plan)  # keeps q_pos alive: its identity stays unique
            self.strategies["window"] += 1
            return run_plan(plan, q, k, v, self.scaling)
        hit = self._biased_window_plans.get(window)
        if hit is not None and hit[0] is q_pos and hit[1].tk == tk and hit[1].tq == tq:
            plan, masks = hit[1], hit[2]
        else:
            plan = window_plan(pos, tk, window, self.device)
            masks = causal_float_masks(plan, q.dtype)
            self._biased_window_plans[window] = (q_pos, plan, masks)
        self.strategies["biased"] += 1
        return biased_attention(q, k, v, bias, self.scaling, plan, masks)

    def _tune(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
              ) -> tuple[AttentionPlan, torch.Tensor | None]:
        """The candidate of a `tune` plan to run: measured now on these inputs (returning its
        output too) unless the bucket already has a winner."""
        by_name = {p.strategy: p for p in plan.options}
        chosen = self.tuner.winner(plan.bucket)
        if chosen in by_name:
            return by_name[chosen], None
        runs = {name: (lambda p=p: run_plan(p, q, k, v, self.scaling)) for name, p in by_name.items()}
        chosen, out = self.tuner.choose(plan.bucket, runs)
        return by_name[chosen], out
    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor, lead: int = 0,
               cuts: tuple[int, ...] = ()) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + MLP + residual, for rows h (T, hidden)
        (Gemma's sandwich: the attention and MLP outputs normed before their residual adds,
        the MLP input by its pre-feed-forward norm). The first `lead` rows are decode rows, `cuts`
        the other items' row counts (as in `qkv`)."""
        block = self.layers[layer]
        proj = self.projections.layers[layer] if self.projections is not None else None
        # `projections` pad a single row themselves where their shape needs it (`single=False`)
        out = (rows4(partial(proj.o, lead=lead, cuts=cuts), attn_out, single=False) if proj is not None
               else rows4(block.self_attn.o_proj, attn_out))
        gated = proj is not None and proj.mlp is not None
        mlp = partial(proj.mlp, lead=lead, cuts=cuts) if gated else block.mlp
        if self.sandwich:
            h = h + rms_norm(block.post_attention_layernorm, out)
            return h + rms_norm(block.post_feedforward_layernorm,
                                rows4(mlp, rms_norm(block.pre_feedforward_layernorm, h), single=not gated))
        h = h + out
        return h + rows4(mlp, rms_norm(block.post_attention_layernorm, h), single=not gated)

    def logits(self, h: torch.Tensor, lead: int = 0, cuts: tuple[int, ...] = ()) -> torch.Tensor:
        """Final norm + lm_head (+ the model's final soft-capping) for rows h (T, hidden) -> (T, vocab)
        float32; the first `lead` rows are decode rows, `cuts` the other items' row counts."""
        x = rms_norm(self.norm, h)
        head = self.projections.lm_head if self.projections is not None else None
        if head is not None and head.reads_blocks(x.shape[0], None, lead):  # row-invariant unpadded (no dense row)
            logits = head(x, lead=lead, cuts=cuts).float()
        else:
            logits = (rows4(partial(head, lead=lead, cuts=cuts), x, single=False) if head is not None
                      else rows4(self.lm_head, x)).float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # --------------------------------------------------------- the executor
    @torch.inference_mode()
    def forward(self, items: Sequence[Rows]) -> list[Output]:
        """One step: several items' rows through the layers at once (the one layer loop).

        At each layer, the rows of every item whose layer range holds it: the linear layers (Q/K/V,
        output projection, MLP) run once over all of them (`qkv`, `finish`); attention runs per
        item over its own cache (each item's K/V written there first): a decode row through the
        decode kernel (every decode row of the step in one call on a CPU), other rows through
        `attend` (causal by position, a sliding layer's window, the cache's stale-key bias), with
        the item's `needs` (loads waited for, stale K/V corrected, rows selected, attention summed).
        Items that reach the last layer get the logits of their wanted rows (one LM head product);
        the others their rows' hidden states. A row's numbers depend on its item only: never on
        the other items of the step (tests/test_executor.py). An item that fails alone (its loads
        stalled, its needs raised) gets its `error` and drops out of the step; the others go on.
        Contiguous items that reach the last layer set their cache's length to their end. Token rows
        of a prefill are cut at multiples of `chunk_tokens` positions into items of their own (their
        K/V written and read in order at each layer): the same cut alone, in chunks or beside others.
        """
        if not items:
            raise ValueError("forward needs at least one item")
        pieces = [_pieces(it, self.chunk_tokens, self.num_layers) for it in items]
        if any(len(p) > 1 for p in pieces):
            outs = iter(self.forward([p for ps in pieces for p in ps]))
            return [_merged([next(outs) for _ in ps]) for ps in pieces]
        work, refused = [], {}
        for i, it in enumerate(items):
            try:
                work.append(_Item(self, it))
            except ValueError as err:  # rows refused (past the positions, empty, bad logit rows): that item only
                refused[i] = err
        if refused:
            outs = iter(self.forward([it for i, it in enumerate(items) if i not in refused])
                        if len(refused) < len(items) else ())
            return [Output(torch.empty(0, dtype=torch.long), error=refused[i]) if i in refused else next(outs)
                    for i in range(len(items))]
        if self._stacked(work):  # decode rows only, through every layer: one native call
            for w in work:
                w.enter(self)
            hd = self.decode_stack(_joined([w.h for w in work]), _joined([w.cos for w in work]),
                                   _joined([w.sin for w in work]), [(w.cache, w.start) for w in work])
            for i, w in enumerate(work):
                w.h = hd[i:i + 1]
            return self._outputs(work)
        members: list[_Item] = []  # the items whose rows make up `h` (in step order)
        h = cos = sin = torch.empty(0)
        order = sorted(work, key=lambda w: not w.decode)  # decode rows first: the linear layers' `lead`
        for layer in range(min(w.first for w in work), max(w.end for w in work)):
            live = []
            for w in order:
                if w.error is None and w.rows and w.first <= layer < w.end:
                    w.enter(self)
                    if w.wait(layer):
                        live.append(w)
            if not live:
                continue
            if live != members or any(w.moved for w in live):  # the rows changed: gather them again
                h = _joined([w.h for w in live])  # (T, hidden)
                cos, sin = _joined([w.cos for w in live]), _joined([w.sin for w in live])  # (T, D) or (T, K, D)
                members = live
                for w in live:
                    w.moved = False
            lead = sum(w.decode for w in live)  # decode rows come first (`order`)
            fused = self.decode_layers[layer] if lead else None
            if fused is not None and fused.on() and all(fused.takes(w.cache, layer) for w in live[:lead]):
                # the decode rows' whole layer in one native call (`DecodeLayer`), the others as below
                hd = fused(h[:lead], cos[:lead], sin[:lead], [(w.cache, w.start) for w in live[:lead]], layer)
                for i, w in enumerate(live[:lead]):
                    w.h = hd[i:i + 1]
                if lead == len(live):
                    h = hd
                    continue
                rest, same = self._layer(layer, live[lead:], h[lead:], cos[lead:], sin[lead:], 0)
                h = torch.cat([hd, rest]) if same else h
            else:
                h, same = self._layer(layer, live, h, cos, sin, lead)
            if not same:
                members = []  # rows dropped or failed: gathered again next layer
        return self._outputs(work)

    def _stacked(self, work: list[_Item]) -> bool:
        """Whether the step is decode rows only, each through every layer with nothing to wait for,
        on caches every `DecodeLayer` takes: then `DecodeStack` runs them, the same bits as the layer
        loop's native call at each layer."""
        stack = self.decode_stack
        return (stack is not None and stack.layers == self.decode_layers and all(w.decode and w.first == 0 and w.end == self.num_layers
                                          and w.loads is None and w.needs is None for w in work)
                and stack.on() and all(stack.takes(w.cache) for w in work))

    def _layer(self, layer: int, live: list[_Item], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               lead: int) -> tuple[torch.Tensor, bool]:
        """`layer` for the rows h (T, hidden) of the items `live` (in that order; the first `lead`
        rows decode rows) at their RoPE rows cos, sin: their K/V written, attention per item, the
        linear layers once over all rows; each item that goes on gets its rows' new hidden states
        (`h`). Returns the new h of every row of `live` and True, or (h, False) where some rows
        were dropped or an item failed (the rows are then gathered again from the items)."""
        q, k, v = self.qkv(layer, h, cos, sin, lead, tuple(w.rows for w in live[lead:]))  # (T, H, D), (T, Hkv, D) x2
        window, final = self.windows[layer], layer == self.num_layers - 1
        parts: list[torch.Tensor] = []  # per item that goes on: its kept rows' attention output (T', H*D)
        kept: list[tuple[int, int, torch.Tensor | None]] = []  # ... and which rows of h those are (first, n, keep)
        cuts: list[int] = []  # the rows each item but the decode rows keeps (the products' `cuts`)
        decoding = []  # decode rows (CPU): q (Hkv, g, D) scaled float32, keys, values, bias, out (Hkv, g, D)
        # the decode rows' outputs (lead, H*D), filled row by row; q scaled for the CPU kernel (lead, H, D)
        decoded = q.new_empty((lead, self.num_heads * self.head_dim))
        scaled = q[:lead].float() * self.scaling if lead and self.device.type == "cpu" else None
        a = 0
        for w in live:
            n = w.rows
            try:
                if w.decode:
                    part = self._decode_row(w, layer, q[a], k[a:a + 1], v[a:a + 1], window, decoding,
                                            decoded[a:a + 1], scaled[a] if scaled is not None else None)
                    keep = None
                else:
                    part, keep = self._rows(w, layer, q[a:a + n], k[a:a + n], v[a:a + n], window, final)
            except Exception as err:  # noqa: BLE001 - this item fails alone; the step goes on
                w.error, part = err, None
            if part is not None:
                kept.append((a, n, keep))
                if not w.decode:
                    parts.append(part)
                    cuts.append(n if keep is None else int(keep.numel()))
            w.keep(keep)
            a += n
        went_on = [i for i in range(lead) if live[i].error is None]  # decode rows (first in `live`)
        if went_on:
            parts[:0] = [decoded] if len(went_on) == lead else [decoded[i:i + 1] for i in went_on]
        if decoding and not native_decode_attention_batch(decoding):  # one call for every decode row
            for qd, keys, values, bias, od in decoding:
                cpu_decode_attention(qd, keys, values, bias, out=od)
        if not parts:
            return h, False
        same = True
        if any(keep is not None for _, _, keep in kept) or sum(n for _, n, _ in kept) < h.shape[0]:
            rows = torch.cat([torch.arange(a, a + n) if keep is None else keep + a for a, n, keep in kept])
            h, same = h[rows.to(self.device)], False  # rows dropped: gathered again next layer
        h = self.finish(layer, h, _joined(parts), len(went_on), tuple(cuts))
        b = 0
        for w in live:
            if w.error is None and w.rows:
                w.h, b = h[b:b + w.rows], b + w.rows
        return h, same

    def _decode_row(self, w: _Item, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    window: int | None, decoding: list, part: torch.Tensor, scaled: torch.Tensor | None
                    ) -> torch.Tensor:
        """A decode row at `layer`: q (H, D), k and v (1, Hkv, D) -> its output `part` (1, H*D) (on a CPU
        filled by the batched decode kernel after every item is seen: `decoding`, from q already scaled
        in float32, `scaled` (H, D))."""
        cache, p = w.cache, w.start
        cache.put(layer, p, k.transpose(0, 1), v.transpose(0, 1))
        lo = 0 if window is None else max(0, p - window + 1)
        keys, values = cache.window(layer, lo, p + 1)  # (Hkv, p + 1 - lo, D)
        bias = cache.window_bias(layer, lo, p + 1)
        if self.device.type == "cpu":
            hkv, d = self.kv_heads, self.head_dim
            qd = scaled.view(hkv, self.num_heads // hkv, d)  # (Hkv, g, D)
            decoding.append((qd, keys, values, bias, part[0].view(hkv, self.num_heads // hkv, d)))
        else:
            decode_attention(q, keys, values, self.scaling, bias, out=part[0])
        return part

    def _rows(self, w: _Item, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
              final: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An item's rows at `layer`: q (T, H, D), k and v (T, Hkv, D). Their K/V written into the
        item's cache, then the rows that go on attend. Returns their output (T', H*D) (None: no row
        goes on) and which rows those are (local, (T',); None: all)."""
        cache, pos, needs = w.cache, w.positions, w.needs
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, T, D), (Hkv, T, D) x2
        if needs is not None:
            needs.before_write(layer, pos, q, k, v)
        past = None
        if w.contiguous:
            start, end = w.start, w.start + w.rows
            if cache.is_ring(layer) and end > cache.k[layer].shape[1]:
                # a ring that wraps: the keys of the rows' windows in position order, read before the write
                lo = max(0, start - window + 1)
                past = (lo, *cache.window(layer, lo, start), cache.window_bias(layer, lo, start))
            cache.put(layer, start, k, v)
        else:
            cache.put_rows(layer, w.positions_dev, k, v)
        keep = needs.keep(layer, pos, q, k, v) if needs is not None else None
        summed = needs.summed(layer) if needs is not None else None
        wanted = None
        if final:  # only the wanted rows need the last layer's output (rows summed attend all the same)
            wanted = torch.tensor(w.wanted(w.rows if keep is None else int(keep.numel())), dtype=torch.long)
            if summed is None:
                keep, wanted = (wanted if keep is None else keep[wanted]), None
        if keep is not None:
            if keep.numel() == 0:
                return None, keep
            if keep.numel() == w.rows:
                keep = None
        qs, qpos = (q, pos) if keep is None else (q[:, keep.to(self.device)], pos[keep])
        if past is not None:
            lo, past_k, past_v, bias = past
            keys, values = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)  # positions lo..end-1
            if bias is not None:
                bias = torch.cat([bias, bias.new_zeros((bias.shape[0], w.rows))], dim=1)
            qpos = qpos - lo
        else:
            end = int(qpos[-1]) + 1
            keys, values = cache.layer(layer, end)  # (Hkv, end, D)
            bias = cache.layer_bias(layer, end)
        if summed is None:
            return self.attend(qs, qpos, keys, values, bias=bias, window=window), keep
        out, sums = self.attend_with_sums(qs[:, summed.to(self.device)], qpos[summed], keys, values, window, bias)
        needs.take_sums(layer, sums, values)
        if summed.numel() < qpos.numel():  # the other rows attend as usual
            others = torch.ones(qpos.numel(), dtype=torch.bool)
            others[summed] = False
            rest = others.nonzero().flatten()
            full = out.new_empty((qpos.numel(), out.shape[1]))
            full[summed.to(self.device)] = out
            full[rest.to(self.device)] = self.attend(qs[:, rest.to(self.device)], qpos[rest], keys, values,
                                                     bias=bias, window=window)
            out = full
        if wanted is not None:  # the last layer of rows summed: only the wanted ones go on
            out = out[wanted.to(self.device)]
            keep = wanted if keep is None else keep[wanted]
        return out, keep

    def _outputs(self, work: list[_Item]) -> list[Output]:
        """Each item's `Output`: one LM head product for the rows of every item that ran the last layer."""
        done = [w for w in work if w.error is None and w.end == self.num_layers]
        with_rows = [w for w in done if w.rows]
        with_rows.sort(key=lambda w: not w.decode)  # decode rows first (`Linear`'s `lead`)
        logits = (self.logits(_joined([w.h for w in with_rows]), sum(w.decode for w in with_rows),
                              tuple(w.rows for w in with_rows if not w.decode))
                  .split([w.rows for w in with_rows]) if with_rows else [])
        by_item = dict(zip(map(id, with_rows), logits, strict=True))
        vocab = self.lm_head.weight.shape[0]
        out = []
        for w in work:
            if w.error is not None:
                out.append(Output(w.positions, error=w.error))
            elif w.end == self.num_layers:
                if w.fill_end is not None:
                    w.cache.length = w.fill_end
                got = by_item.get(id(w))
                out.append(Output(w.positions, logits=got if got is not None else
                                  torch.zeros((0, vocab), dtype=torch.float32, device=self.device)))
            else:
                out.append(Output(w.positions, hidden=w.h))
        return out

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: KVCache, start: int = 0,
                logit_rows: Sequence[int] | None = None, loads: LayerWaiter | None = None) -> torch.Tensor:
        """Compute tokens at positions start..start+T-1 attending cache slots 0..start-1 (`forward` of
        one item): their K/V written into `cache` (a ring layer: its slots of them), cache.length
        set. `loads` is waited for before each layer reads the cache. Returns the logits
        (len(logit_rows), vocab) of the requested rows (default: the last); with `logit_rows=()`
        (only the K/V) the result is (0, vocab)."""
        rows = None if logit_rows is None else tuple(logit_rows)
        out = self.forward([Rows(token_ids, cache, start, rows, loads)])[0]
        if out.error is not None:
            raise out.error
        return out.logits

    @torch.inference_mode()
    def decode_step(self, token_ids: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """One decode step for B sequences at once (`forward` of B decode rows): token_ids[b] fed at
        position caches[b].length of its own cache (written there, length advanced by one). Every
        cache needs room for one more position (`ensure_capacity`). Returns logits (B, vocab)
        float32, each sequence's those it gets decoding alone."""
        batch = len(caches)
        if batch != len(token_ids) or batch == 0:
            raise ValueError(f"decode_step needs one token per cache, got {len(token_ids)} tokens for {batch} caches")
        for c in caches:
            if c.length >= c.capacity:
                raise ValueError(f"cache full at {c.length} positions: ensure_capacity before decode_step")
        out = self.forward([Rows(torch.tensor([int(t)]), c, c.length) for t, c in zip(token_ids, caches, strict=True)])
        return torch.cat([o.logits for o in out])

    @torch.inference_mode()
    def step(self, token_id: int, cache: KVCache) -> torch.Tensor:
        """Decode one token at position cache.length (`decode_step` of one sequence); returns
        its logits (vocab,)."""
        cache.ensure_capacity(cache.length + 1)
        return self.decode_step([token_id], [cache])[0]

    @torch.inference_mode()
    def decode(self, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
               eos_ids: Sequence[int] = ()) -> list[int]:
        """Greedy reference decoding: up to max_new_tokens from the prefill's last logits (vocab,),
        one `step` at a time (the engine decodes through blend.decode; tests compare against this).

        Continues from `cache` (filled to cache.length) and appends to it. Stops after an
        EOS id (which is included in the result).
        """
        tokens: list[int] = []
        logits = first_logits
        cache.ensure_capacity(cache.length + max_new_tokens)
        for i in range(max_new_tokens):
            token = int(torch.argmax(logits))
            tokens.append(token)
            if token in eos_ids or i == max_new_tokens - 1:
                break
            logits = self.step(token, cache)
        return tokens


class _Item:
    """One item of a `Runner.forward` step while it runs: its rows (positions, hidden states, RoPE
    rows) as they go through its layers."""

    def __init__(self, runner: Runner, it: Rows):
        self.src, self.cache, self.needs, self.loads = it, it.cache, it.needs, it.loads
        self.first, self.end = it.span()
        n = len(it)
        if n < 1:
            raise ValueError("empty prompt: give at least one token")
        if not 0 <= self.first < self.end <= runner.num_layers:
            raise ValueError(f"layer range {self.first}..{self.end} is outside the model's {runner.num_layers} layers")
        if (it.token_ids is None) != (self.first > 0) or (it.hidden is None) != (self.first == 0):
            raise ValueError("rows enter layer 0 as token ids, a later layer as hidden states")
        if it.positions is None:
            self.positions = torch.arange(it.start, it.start + n)  # (T,) host
        else:
            self.positions = it.positions.to("cpu", torch.long)
            if n > 1 and not bool((self.positions[1:] > self.positions[:-1]).all()):
                raise ValueError("an item's positions must be sorted and unique")
        self.start, self.rows = int(self.positions[0]), n
        self.contiguous = it.positions is None or int(self.positions[-1]) - self.start + 1 == n
        self.fill_end = self.start + n if self.contiguous else None  # the cache's length once it ran the last layer
        runner.check_length(int(self.positions[-1]) + 1)
        self.cache.ensure_capacity(int(self.positions[-1]) + 1)
        self.decode = it.decodes()
        it.wanted(n)  # logit rows checked now: refused before any work
        self.positions_dev = self.positions.to(runner.device)
        self.h: torch.Tensor | None = None
        self.cos = self.sin = None
        self.moved = True  # its rows changed since `forward` last gathered them
        self.error: Exception | None = None

    def enter(self, runner: Runner) -> None:
        """Its rows' hidden states and RoPE rows, made when it enters its first layer."""
        if self.h is not None:
            return
        it = self.src
        self.h = runner.embed(it.token_ids) if it.token_ids is not None else it.hidden.to(runner.device)
        self.cos, self.sin = runner.rope_rows(self.positions)  # (T, D) or (T, K, D); sin signed

    def wait(self, layer: int) -> bool:
        """Its loads for `layer` (False: they failed; `error` holds why)."""
        try:
            if self.loads is not None:
                self.loads.wait(layer)
            if self.needs is not None:
                self.needs.wait(layer)
        except Exception as err:  # noqa: BLE001 - the item fails alone
            self.error = err
            return False
        return True

    def wanted(self, n: int) -> list[int]:
        return self.src.wanted(n)

    def keep(self, keep: torch.Tensor | None) -> None:
        """Only the rows `keep` (local; None: all) go on; a failed item keeps none."""
        if self.error is not None:
            self.rows, self.moved = 0, True
            return
        if keep is None:
            return
        self.positions = self.positions[keep]
        self.positions_dev = self.positions.to(self.positions_dev.device)
        dev = keep.to(self.cos.device)
        self.cos, self.sin, self.rows, self.moved = self.cos[dev], self.sin[dev], int(keep.numel()), True
        self.contiguous = self.rows > 0 and int(self.positions[-1]) - int(self.positions[0]) + 1 == self.rows
        if self.rows:
            self.start = int(self.positions[0])
