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

import logging
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F

from blend.model.attention import (
    AttentionPlan,
    AttentionTuner,
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
from blend.model.loading import LoadedModel
from blend.model.native import (
    blend_kernel,
    decode_kernel,
    native_blend_attention,
    native_decode_attention_batch,
)
from blend.model.projections import Projections, projections_for

log = logging.getLogger(__name__)
T = TypeVar("T")


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


@dataclass(frozen=True)
class Rows:
    """One sequence's rows in a `Runner.forward` step: `token_ids` (T,) at positions
    start..start+T-1 of `cache`, attending its slots 0..start-1 and each other causally.
    `logit_rows`: the local rows whose logits are wanted (None: the last one; (): none,
    only the K/V is written)."""

    token_ids: torch.Tensor  # (T,) int64, on the host
    cache: KVCache
    start: int
    logit_rows: tuple[int, ...] | None = None
    loads: LayerWaiter | None = None  # a loader filling `cache` beside: waited for before each layer reads it

    def chunk(self, a: int, b: int) -> Rows:
        """Rows a..b-1 of these (their logit rows among them, renumbered)."""
        wanted = [r - a for r in self.wanted() if a <= r < b]
        logit_rows = None if wanted == [b - a - 1] else tuple(wanted)
        return Rows(self.token_ids[a:b], self.cache, self.start + a, logit_rows, self.loads)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def wanted(self) -> list[int]:
        n = len(self)
        rows = [n - 1] if self.logit_rows is None else list(self.logit_rows)
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"logit rows {rows} are outside the item's {n} rows")
        return rows

    def decodes(self) -> bool:
        """A decode row: one token at its cache's end, its logits wanted."""
        return len(self) == 1 and self.logit_rows is None and self.start == self.cache.length


class _BeforeLayer:
    """A callable `before_layer(i)` as a `LayerWaiter`."""

    def __init__(self, fn: Callable[[int], None]):
        self.wait = fn


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Runner:
    """Runs a supported decoder-only transformers model layer by layer."""

    def __init__(self, lm: LoadedModel, attention: str = "auto"):
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
        self.strategies: Counter[str] = Counter()  # attention calls per strategy run
        # the linear layers as few, prepacked products (bfloat16 on a CPU; None: the modules as they are)
        self.projections: Projections | None = projections_for(lm.model, lm.blocks, lm.weights)
        self.qk_norm = getattr(self.layers[0].self_attn, "q_norm", None) is not None  # Qwen3, Gemma 3
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # decode's cos/sin (P, D) by position
        # CPU: the native kernels, built (once per machine) or loaded now, not inside the first request;
        # `native_blend`: query rows other than a plain causal block go through the blend kernel
        self.native_blend = False
        # CUDA: rows with a bias or a window through FlexAttention (one fused kernel; the masked SDPA groups
        # are the fallback, taken for good after a failure)
        self.use_flex = self.device.type == "cuda" and flex_function(self.device) is not None
        self._flex_masks: dict[int | None, tuple[torch.Tensor, int, Any]] = {}
        if self.device.type == "cpu":
            decode_kernel()
            self.native_blend = blend_kernel() is not None and self.dtype in (torch.float32, torch.bfloat16)

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

    def rope_rows(self, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` of a few positions (a decode step's) read from a table of every position up
        to the largest asked so far (grown by doubling, built by `rope` itself: the same
        values). cos, sin_signed (B, D) or (B, K, D) (`rope`) in the model dtype, sin_signed
        being sin with its first half negated (what `rotate` takes)."""
        need = max(positions) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < need:
            size = min(max(need, 2 * (self._rope_table[0].shape[0] if self._rope_table else 512)), self.max_positions)
            cos, sin = self.rope(torch.arange(size))  # (P, D) or (P, K, D) each
            half = sin.shape[-1] // 2
            self._rope_table = (cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
        index = torch.tensor(positions, device=self.device)
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

    def qkv(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows h (T, hidden) at the positions of cos/sin (T, D) or (T, K, D) (`rope`) -> q (H, T, D),
        k and v (Hkv, T, D)."""
        q, k, v = self.project_qkv(layer, h)  # (T, H, D), (T, Hkv, D) x2
        if self.qk_norm:  # Qwen3, Gemma 3
            attn = self.layers[layer].self_attn
            q = rms_norm(attn.q_norm, q)
            k = rms_norm(attn.k_norm, k)
        cos, sin = self.layer_rope_of(layer, cos, sin)  # (T, D) of this layer's RoPE kind
        q = apply_rope(q.transpose(0, 1), cos, sin)  # (H, T, D)
        k = apply_rope(k.transpose(0, 1), cos, sin)  # (Hkv, T, D)
        return q, k, v.transpose(0, 1)

    def project_qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm and the Q/K/V projections of rows h (T, hidden) (one product where the
        runner has `projections`): q (T, H, D), k and v (T, Hkv, D), before any q/k-norm or
        RoPE."""
        block = self.layers[layer]
        x = rms_norm(block.input_layernorm, h)
        t, d = x.shape[0], self.head_dim
        if self.projections is not None:
            q, k, v = self.projections.layers[layer].qkv.split(x)  # (T, H*D), (T, Hkv*D) x2
            return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        attn = block.self_attn
        return attn.q_proj(x).view(t, -1, d), attn.k_proj(x).view(t, -1, d), attn.v_proj(x).view(t, -1, d)

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
        that shape's own). None where the kernel declines (the torch strategies run)."""
        tq, tk = q.shape[1], k.shape[1]
        if (bias is None and tq == tk and int(q_pos[0]) == 0 and int(q_pos[-1]) == tk - 1
                and not needs_window(q_pos, window)):
            return None
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
                         window: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`attend` (no bias) that also sums each key's attention probability over the query
        rows and the query heads of its KV head: (Tq, H*D) and (Hkv, Tk) float32. The native
        kernel only (a CPU): None where it does not run (the caller computes the probabilities)."""
        if not self.native_blend:
            return None
        sums = torch.empty((k.shape[0], k.shape[1]), dtype=torch.float32)
        out = self._native(q, q_pos, k, v, None, window, sums)
        return None if out is None else (out, sums)

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
    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + MLP + residual, for rows h (T, hidden)
        (Gemma's sandwich: the attention and MLP outputs normed before their residual adds,
        the MLP input by its pre-feed-forward norm)."""
        block = self.layers[layer]
        proj = self.projections.layers[layer] if self.projections is not None else None
        out = proj.o(attn_out) if proj is not None else block.self_attn.o_proj(attn_out)
        mlp = proj.mlp if proj is not None and proj.mlp is not None else block.mlp
        if self.sandwich:
            h = h + rms_norm(block.post_attention_layernorm, out)
            return h + rms_norm(block.post_feedforward_layernorm, mlp(rms_norm(block.pre_feedforward_layernorm, h)))
        h = h + out
        return h + mlp(rms_norm(block.post_attention_layernorm, h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head (+ the model's final soft-capping) for rows h (T, hidden) -> (T, vocab) float32."""
        x = rms_norm(self.norm, h)
        logits = (self.projections.lm_head(x) if self.projections is not None else self.lm_head(x)).float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # --------------------------------------------------------- whole passes
    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: KVCache, start: int = 0,
                logit_rows: Sequence[int] | None = None,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute tokens at positions start..start+T-1 attending cache slots 0..start-1.

        Writes their K/V into `cache` at positions start..start+T-1 (a ring layer: its slots of
        them) and sets cache.length.
        `before_layer(i)` is called before layer i reads the cache (a loader's wait).
        Returns logits (len(logit_rows), vocab) for the requested rows (default: last);
        with no rows (`logit_rows=()`, only the KV is wanted) the last layer stops after
        writing its K/V and the result is (0, vocab). `forward` of one sequence's rows.
        """
        rows = None if logit_rows is None else tuple(logit_rows)
        hook = _BeforeLayer(before_layer) if before_layer is not None else None
        return self.forward([Rows(token_ids, cache, start, rows, hook)])[0]

    @torch.inference_mode()
    def forward(self, items: Sequence[Rows]) -> list[torch.Tensor]:
        """One step over several sequences' rows at once: each item's tokens at positions
        start..start+T-1 of its own cache (a prefill chunk, or a decode row: T = 1).

        The linear layers (QKV, output projection, MLP, LM head) run once over every item's
        rows; attention runs per item over its own cache: a decode row through the decode
        kernel (as `decode_step`), a chunk of rows through `attend` (causal by position over
        the cache's slots 0..start-1 and the chunk itself; a ring layer: its window). Each
        item's K/V is written into its cache, its length set to start + T. Each item's
        numbers are those it gets run alone (tests/test_executor.py). Returns per item the
        logits of its `logit_rows` (default: its last row), (rows, vocab) float32. Only
        decode rows (each at its cache's end, its last row wanted): `decode_step`.
        """
        if not items:
            raise ValueError("forward needs at least one item")
        if all(it.decodes() and it.loads is None for it in items):
            logits = self.decode_step([int(it.token_ids[0]) for it in items], [it.cache for it in items])
            return [logits[b:b + 1] for b in range(len(items))]
        sizes = [len(it) for it in items]
        for it, n in zip(items, sizes, strict=True):
            self.check_length(it.start + n)
            if n < 1:
                raise ValueError("empty prompt: give at least one token")
        first = [0]
        for n in sizes[:-1]:
            first.append(first[-1] + n)
        for it, n in zip(items, sizes, strict=True):
            it.cache.ensure_capacity(it.start + n)
            it.cache.clear_bias(it.start, it.start + n)  # computed afresh here
        positions = torch.cat([torch.arange(it.start, it.start + n) for it, n in zip(items, sizes, strict=True)])  # (T,)
        pos_of = [positions[a:a + n] for a, n in zip(first, sizes, strict=True)]  # host: attention plans need no sync
        wanted = [it.wanted() for it in items]  # local rows whose logits are returned
        cos, sin = self.rope(positions)  # (T, D) or (T, K, D)
        h = self.embed(torch.cat([it.token_ids for it in items]))  # (T, hidden)
        heads, hkv, d = self.num_heads, self.kv_heads, self.head_dim
        last, on_cpu = self.num_layers - 1, self.device.type == "cpu"
        keep = [a + r for a, rows in zip(first, wanted, strict=True) for r in rows]  # rows the last layer finishes
        keep_dev = torch.tensor(keep, dtype=torch.long, device=self.device)
        sel_of = [torch.tensor(rows, dtype=torch.long) for rows in wanted]
        waiters = [it.loads for it in items if it.loads is not None]
        for layer in range(self.num_layers):
            for waiter in waiters:
                waiter.wait(layer)
            q, k, v = self.qkv(layer, h, cos, sin)  # (H, T, D), (Hkv, T, D) x2
            window, final = self.windows[layer], layer == last
            parts: list[torch.Tensor] = []  # per item, in order: its rows' attention output (rows, H*D)
            decoding = []  # decode rows: (part index, q (Hkv, g, D) scaled float32, keys, values, bias, out)
            for i, (it, a, n) in enumerate(zip(items, first, sizes, strict=True)):
                cache, start, end = it.cache, it.start, it.start + n
                qs, ks, vs = q[:, a:a + n], k[:, a:a + n], v[:, a:a + n]
                if n == 1:  # one row: the decode kernel over its keys (a sliding layer: its window)
                    cache.put(layer, start, ks, vs)
                    if final and not wanted[i]:
                        continue
                    lo = 0 if window is None else max(0, start - window + 1)
                    keys, values = cache.window(layer, lo, end)  # (Hkv, end - lo, D)
                    bias = cache.window_bias(layer, lo, end)
                    part = h.new_empty((1, heads * d))
                    parts.append(part)
                    if on_cpu:
                        qd = (qs[:, 0].float() * self.scaling).view(hkv, heads // hkv, d)  # (Hkv, g, D)
                        decoding.append((qd, keys, values, bias, part[0].view(hkv, heads // hkv, d)))
                    else:
                        decode_attention(qs[:, 0], keys, values, self.scaling, bias, out=part[0])
                    continue
                if cache.is_ring(layer) and end > cache.k[layer].shape[1]:
                    # a ring that wraps: the keys of the rows' windows in position order, then the new ones
                    lo = max(0, start - window + 1)
                    past_k, past_v = cache.window(layer, lo, start)  # (Hkv, start - lo, D)
                    keys, values = torch.cat([past_k, ks], dim=1), torch.cat([past_v, vs], dim=1)  # positions lo..end-1
                    bias = cache.window_bias(layer, lo, start)
                    if bias is not None:
                        bias = torch.cat([bias, bias.new_zeros((bias.shape[0], n))], dim=1)
                    q_pos = pos_of[i] - lo
                    cache.put(layer, start, ks, vs)
                else:
                    cache.k[layer][:, start:end] = ks
                    cache.v[layer][:, start:end] = vs
                    keys, values = cache.layer(layer, end)
                    bias, q_pos = cache.layer_bias(layer, end), pos_of[i]
                if final:  # only the rows whose logits are wanted need the last layer's output
                    if wanted[i]:
                        sel = sel_of[i]
                        parts.append(self.attend(qs[:, sel.to(self.device)], q_pos[sel], keys, values, bias=bias,
                                                 window=window))
                else:
                    parts.append(self.attend(qs, q_pos, keys, values, bias=bias, window=window))
            if decoding and not native_decode_attention_batch(decoding):  # one call for every decode row
                for qd, keys, values, bias, od in decoding:
                    cpu_decode_attention(qd, keys, values, bias, out=od)
            if final:
                if not keep:  # only the K/V was wanted
                    break
                h = self.finish(layer, h[keep_dev] if len(keep) < h.shape[0] else h, _joined(parts))
            else:
                h = self.finish(layer, h, _joined(parts))
        for it, n in zip(items, sizes, strict=True):
            it.cache.length = it.start + n
        if not keep:
            return [torch.zeros((0, self.lm_head.weight.shape[0]), dtype=torch.float32, device=self.device)
                    for _ in items]
        logits = self.logits(h)  # (len(keep), vocab)
        return list(logits.split([len(rows) for rows in wanted]))

    def run(self, steps: Generator[Rows | None, Any, T]) -> T:
        """A plan's steps run to the end alone (no scheduler: nothing else shares its steps):
        each `Rows` it yields is computed by `forward` on its own and its logits sent back;
        a None it yields was a unit of compute done inside it. Returns the plan's value."""
        reply = None
        while True:
            try:
                request = steps.send(reply)
            except StopIteration as done:
                return done.value
            reply = self.forward([request])[0] if isinstance(request, Rows) else None

    @torch.inference_mode()
    def prefill_packed(self, sequences: Sequence[Sequence[int]], context: KVCache | None = None,
                       start: int = 0) -> KVCache:
        """K/V of several independent sequences computed in one pass: each sequence sits at
        positions start..start+n-1 after the first `start` slots of `context` (shared, only
        read) and attends to them and to its own earlier tokens, never to another sequence;
        the same computation as one `prefill` per sequence after that context. The linear
        layers see every row at once; attention is one masked call per layer over the
        sequences padded to the longest (pack sequences of similar lengths).

        Returns a new cache holding their K/V back to back, in order (slot = packed row,
        length = total tokens). Only K/V: the last layer stops after writing them.
        """
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) < 1:
            raise ValueError("prefill_packed needs at least one sequence and no empty one")
        if start and (context is None or context.length < start):
            raise ValueError(f"prefill_packed after {start} context slots needs a context cache filled that far")
        self.check_length(start + max(lengths))
        total, batch, longest = sum(lengths), len(lengths), max(lengths)
        ids = torch.tensor([t for seq in sequences for t in seq])  # (T,)
        cos, sin = self.rope(torch.cat([torch.arange(start, start + n) for n in lengths]))  # (T, D) each
        # the batch of padded sequences: row i of sequence b is packed row first[b] + i
        first = torch.tensor([0, *lengths[:-1]]).cumsum(0)  # (B,)
        n = torch.tensor(lengths)  # (B,)
        i = torch.arange(longest)  # (Lq,)
        valid = i[None, :] < n[:, None]  # (B, Lq)
        rows = torch.where(valid, first[:, None] + i[None, :], 0)  # (B, Lq) packed rows (padding: row 0)
        width = start + longest
        key = torch.arange(width)  # (Lk,) key slot: context 0..start-1, then the sequence's own rows
        own = key[None, :] - start  # (1, Lk) offset into the sequence
        key_rows = torch.where(own >= 0, start + first[:, None] + own.clamp(min=0), key[None, :])  # (B, Lk)
        key_rows = torch.where(own < n[:, None], key_rows, 0)  # padding keys: any row, masked below
        mask = (own[:, None, :] < 0) | (own[:, None, :] <= i[None, :, None])  # (1, Lq, Lk): context or causal
        mask = mask & (own[:, None, :] < n[:, None, None])  # (B, Lq, Lk): not past the sequence's end
        masks = {None: mask[:, None].to(self.device)}  # (B, 1, Lq, Lk); a padded query row still sees key 0
        for window in set(self.windows) - {None}:  # key slot = key position; a query row i sits at start + i
            band = key[None, None, :] > (start + i)[None, :, None] - window  # (1, Lq, Lk)
            masks[window] = (mask & band)[:, None].to(self.device)
        rows_d, key_rows_d = rows.to(self.device), key_rows.to(self.device)
        keep = (torch.arange(batch)[:, None] * longest + i[None, :])[valid].to(self.device)  # (T,) in packed order
        packed = self.new_cache(total)
        h = self.embed(ids)  # (T, hidden)
        for layer in range(self.num_layers):
            q, k, v = self.qkv(layer, h, cos, sin)  # (H, T, D), (Hkv, T, D) x2
            packed.k[layer][:, :total] = k
            packed.v[layer][:, :total] = v
            if layer == self.num_layers - 1:  # the last layer's output feeds nothing wanted
                break
            if start:
                assert context is not None
                k_all = torch.cat([context.k[layer][:, :start], k], dim=1)  # (Hkv, start + T, D)
                v_all = torch.cat([context.v[layer][:, :start], v], dim=1)
            else:
                k_all, v_all = k, v
            qb = q[:, rows_d].transpose(0, 1)  # (B, H, Lq, D)
            kb = k_all[:, key_rows_d].transpose(0, 1)  # (B, Hkv, Lk, D)
            vb = v_all[:, key_rows_d].transpose(0, 1)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=masks[self.windows[layer]], scale=self.scaling,
                                                 enable_gqa=True)  # (B, H, Lq, D)
            out = out.transpose(1, 2).reshape(batch * longest, -1)[keep]  # (T, H*D)
            h = self.finish(layer, h, out)
        packed.length = total
        return packed

    @torch.inference_mode()
    def decode_step(self, token_ids: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """One decode step for B sequences at once: token_ids[b] is fed at position
        caches[b].length of its own cache (written there, length advanced by one).

        The linear layers (QKV, output projection, MLP, LM head) run once over the B rows
        (`projections` where the runner has them); q and k are rotated together from the
        RoPE table (`rope_rows`, `rotate`); attention runs per sequence over its own keys,
        the cache's stale-key bias folded in (CPU: on queries scaled once per layer, one
        native kernel call for the batch, `native_decode_attention_batch`, else
        `cpu_decode_attention` per sequence; elsewhere `decode_attention`; a sliding layer
        over its window only, from a ring where the cache has one). Every cache needs room
        for one more position (`ensure_capacity`). Returns logits (B, vocab) float32. Each
        sequence's logits are those it gets decoding alone (tests/test_scheduler.py).
        """
        batch = len(caches)
        if batch != len(token_ids) or batch == 0:
            raise ValueError(f"decode_step needs one token per cache, got {len(token_ids)} tokens for {batch} caches")
        pos = [c.length for c in caches]
        if max(pos) >= self.max_positions:
            raise ValueError(f"a sequence reached the model's {self.max_positions} positions")
        for c, p in zip(caches, pos, strict=True):
            if p >= c.capacity:
                raise ValueError(f"cache full at {p} positions: ensure_capacity before decode_step")
        cos, sin = self.rope_rows(pos)  # (B, D) or (B, K, D) each; sin with its first half negated
        h = self.embed(torch.tensor(token_ids))  # (B, hidden)
        for c, p in zip(caches, pos, strict=True):
            c.clear_bias(p, p + 1)  # the new slot is computed afresh
        heads, hkv, d = self.num_heads, self.kv_heads, self.head_dim
        on_cpu = self.device.type == "cpu"
        out = h.new_empty((batch, heads * d))  # (B, H*D): every layer's attention output, in turn
        for layer in range(self.num_layers):
            q, k, v = self.project_qkv(layer, h)  # (B, H, D), (B, Hkv, D) x2
            if self.qk_norm:  # Qwen3, Gemma 3: normed per head, then rotated
                attn = self.layers[layer].self_attn
                q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
            c_l, s_l = self.layer_rope_of(layer, cos, sin)  # (B, D) of this layer's RoPE kind
            qk = rotate(torch.cat((q, k), dim=1), c_l[:, None], s_l[:, None])  # (B, H + Hkv, D): one rotation
            k = qk[:, heads:, None]  # (B, Hkv, 1, D)
            if on_cpu:  # scaled float32 queries, the H / Hkv heads of a KV head as its rows
                q = (qk[:, :heads].float() * self.scaling).view(batch, hkv, heads // hkv, d)  # (B, Hkv, g, D)
            window = self.windows[layer]
            seqs = []  # per sequence: q (Hkv, g, D), its keys and values (Hkv, Tk, D), bias, out (Hkv, g, D)
            for b, (c, p) in enumerate(zip(caches, pos, strict=True)):
                # a sliding layer: the keys of the last `window` positions only (a ring: gathered)
                lo = 0 if window is None else max(0, p - window + 1)
                c.put(layer, p, k[b], v[b, :, None])
                keys, values = c.window(layer, lo, p + 1)  # (Hkv, p + 1 - lo, D)
                bias = c.window_bias(layer, lo, p + 1)
                if on_cpu:
                    seqs.append((q[b], keys, values, bias, out[b].view(hkv, heads // hkv, d)))
                else:
                    decode_attention(qk[b, :heads], keys, values, self.scaling, bias, out=out[b])
            if on_cpu and not native_decode_attention_batch(seqs):  # one call for the batch, else per sequence
                for qb, keys, values, bias, ob in seqs:
                    cpu_decode_attention(qb, keys, values, bias, out=ob)
            h = self.finish(layer, h, out)
        for c, p in zip(caches, pos, strict=True):
            c.length = p + 1
        return self.logits(h)  # (B, vocab)

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

