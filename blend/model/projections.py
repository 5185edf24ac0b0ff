"""The runner's linear layers laid out for products over few rows (decode steps), where
that measures faster than the model's own modules: bfloat16 on a CPU with oneDNN.

Per decoder layer the model's Q, K and V projections become one product and, in a gated
MLP (gate / up / down, every supported architecture), gate and up become one; the output
and down projections and the LM head stay single. Each matrix is prepacked once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by
`torch.ops.mkldnn._linear_pointwise` (F.linear repacks a bfloat16 weight on every call):
measured on SmolLM2's 30 layers, 1.6x faster than the modules for 1 and 8 rows, 1.2x up
to 256 rows, but 1.6x slower from 1,024 rows on, so more than `PACKED_MAX_ROWS` rows (a
prefill) go through the model's own weights with F.linear.

The packed matrices are copies beside the model's weights (the modules stay untouched:
transformers' forward, `save_pretrained` and the parity tests keep working): 0.27 GB more
for SmolLM2. `projections_for` builds them once per loaded model and shares them between
runners. Elsewhere the modules run as they are (`projections_for` -> None): in float32 a
fused or transposed copy measured slower than the model's own weights (freshly allocated
copies stream at 5-8 GB/s on this machine, the loaded weights at 9), and CUDA has its own
kernels.

Quantized blocks (blend/model/quantized.py): where the model came from a GGUF file whose
linear layers are in block types the native kernel reads, each `Linear` also holds their
`QuantizedProduct`, and a call picks the weights it reads by `quantized` (per call) and the
model's `weights` policy: `dequantized` never reads blocks; `auto` reads them for calls of at
most `QUANTIZED_MAX_ROWS` rows (decode steps) and the dense copies above for more (prefill
chunks), or as the call forces (`quantized=True` / `False`); `quantized` reads them for every
call, so the dense copies are never built. The prepacked bfloat16 copy is built on the first
call that reads it (`Linear.packed`), so a process that only decodes never holds it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blend.model.native import KINDS, QUANT, native_qpack, qpack_native, quant_kernel
from blend.model.quantized import WEIGHTS, QuantizedMatrix, QuantizedWeights

log = logging.getLogger(__name__)

PACKED = "packed"  # dense products: oneDNN's prepacked bfloat16 copies (up to PACKED_MAX_ROWS rows)
MODULES = "modules"  # dense products: F.linear on the model's own weights
PACKED_MAX_ROWS = 256  # more rows than this: F.linear on the model's weights beats the packed product
# at most this many rows: the quantized blocks beat the packed bfloat16 product (measured on SmolLM2-shaped
# Q4_1 products, 30 layers, AMD EPYC 2 cores, avx512_vnni: README "Quantized decode")
QUANTIZED_MAX_ROWS = 3


ONE_ROW_SAMPLES = 256  # rows `Linear.one_row_differs` checks (a 1-in-19 difference is missed with p < 1e-5)
_ONE_ROW_DIFFERS: dict[tuple[int, int, str, int], bool] = {}  # by (in, out, dense layout, threads)


class QuantizedProduct:
    """y = x W^T + b with W several `QuantizedMatrix` of one input width stacked along the
    outputs, by one native call (prepared once: its segment table, its bias)."""

    def __init__(self, matrices: Sequence[QuantizedMatrix], bias: torch.Tensor | None):
        self.matrices = tuple(matrices)
        self.in_features = self.matrices[0].in_features
        self.out_features = sum(m.out_features for m in self.matrices)
        self.bias = bias.detach().float().contiguous() if bias is not None else None  # (out,)
        # the packed layout (16 outputs a vector; kernels/quant_matmul.c) where it runs vectorized (AVX-512
        # VNNI, AVX2): then decode rows read the blocks at every batch size; elsewhere the GGUF's own blocks
        packs = [native_qpack(m.block_type.ggml_id, m.blocks, m.in_features) for m in self.matrices] \
            if qpack_native() else []
        self.packed = bool(packs) and all(p is not None for p in packs)
        self._packs = tuple(packs) if self.packed else ()  # flat uint8 each; the kernel reads only these
        table = []
        for i, m in enumerate(self.matrices):
            w = self._packs[i] if self.packed else m.blocks
            table += (m.block_type.ggml_id, m.out_features, w.data_ptr(), 0 if self.packed else m.blocks.stride(0))
        self._segments = torch.tensor(table, dtype=torch.int64)  # (n, 4): the kernel's kvb_segment records
        self._segments_at = self._segments.data_ptr()
        self._bias_at = self.bias.data_ptr() if self.bias is not None else None
        lib = quant_kernel()
        self._call = (getattr(lib, "kvb_qpack_matmul" if self.packed else QUANT.functions[0][0])
                      if lib is not None else None)

    @property
    def nbytes(self) -> int:
        """Bytes the products read a call (the packed records where packed, else the blocks)."""
        return sum(p.numel() for p in self._packs) if self.packed else sum(m.nbytes for m in self.matrices)

    def table(self) -> tuple[int, int, int]:
        """(segments, the kernel's segment table's address, the float32 bias's address or 0): what
        a native caller of the product passes (kernels/quant_matmul.c; valid while this lives)."""
        return len(self.matrices), self._segments_at, self._bias_at or 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) float32 or bfloat16 -> (T, out) in x's dtype; does not modify x. Each
        output row depends on its own x row only (bitwise, whatever T and the threads)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        kind = KINDS.get(x.dtype)
        if (self._call is None or kind is None or x.dim() != 2 or x.shape[1] != self.in_features
                or x.device.type != "cpu"):
            raise ValueError(f"the quantized product takes (T, {self.in_features}) float32 or bfloat16 rows on a CPU "
                             f"with its native kernel, not {tuple(x.shape)} {x.dtype} on {x.device}")
        if x.shape[0] == 0:
            return out
        done = self._call(kind, x.shape[0], self.in_features, x.data_ptr(), x.stride(0), out.data_ptr(),
                          out.stride(0), self._bias_at, len(self.matrices), self._segments_at)
        if done != 0:
            raise RuntimeError(f"the quantized product kernel failed ({done}) on {tuple(x.shape)} rows")
        return out


def product(matrices: Sequence[QuantizedMatrix | None], biases: Iterable[torch.Tensor | None],
            what: str) -> QuantizedProduct | None:
    """The `QuantizedProduct` of `matrices` stacked, or None (one log line naming `what` and
    why) where one of them is missing or is something the kernel cannot take: those layers
    then run on the dequantized weights."""
    if any(m is None for m in matrices) or quant_kernel() is None:
        return None
    found = [m for m in matrices if m is not None]
    problems = [p for p in (m.problem() for m in found) if p]
    if not problems and len({m.in_features for m in found}) != 1:
        problems.append("the stacked matrices differ in input width")
    if problems:
        log.info("%s runs on the dequantized weights: %s", what, problems[0])
        return None
    parts = list(biases)
    bias = None
    if any(b is not None for b in parts):
        bias = torch.cat([b.detach().float() if b is not None else torch.zeros(m.out_features)
                          for b, m in zip(parts, found, strict=True)])
    return QuantizedProduct(found, bias)


class Linear:
    """One product y = x W^T + b of one or several of the model's linear layers stacked along
    their outputs (q, k, v -> one W of q_out + k_out + v_out rows): dense (prepacked for oneDNN,
    built on first use, or F.linear on the model's weights) and, where the model has them,
    from quantized blocks (`quantized`)."""

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], *,
                 dense: str = PACKED, quantized: QuantizedProduct | None = None, policy: str = "auto"):
        self.parts = tuple((w.detach(), b.detach() if b is not None else None)
                           for w, b in zip(weights, biases, strict=True))  # the model's own tensors, not copies
        first = self.parts[0][0]
        self.dtype = first.dtype
        self.in_features = first.shape[1]
        self.widths = tuple(t.shape[0] for t in weights)  # each stacked layer's outputs, in order
        self.out_features = sum(self.widths)
        self.has_bias = any(b is not None for b in biases)
        self.dense = dense
        self.quantized = quantized
        self.policy = policy if quantized is not None else "dequantized"
        self._packed: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._lock = threading.Lock()

    @property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight in oneDNN's blocked layout, bias): built on first use, then kept."""
        if self._packed is None:
            with self._lock:
                if self._packed is None:
                    ws = [w for w, _ in self.parts]
                    w = torch.cat(ws) if len(ws) > 1 else ws[0]  # (out, in)
                    bias = None
                    if self.has_bias:
                        bias = torch.cat([b if b is not None else w.new_zeros(w_.shape[0]) for w_, b in self.parts])
                    self._packed = (torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1), bias)
        return self._packed

    @property
    def by_row_kind(self) -> bool:
        """Whether `auto` picks the weights by the kind of row (decode rows: the blocks, others:
        the dense weights), where the blocks are packed (AVX-512 VNNI, AVX2); else by the row count."""
        return self.policy == "auto" and self.quantized is not None and self.quantized.packed

    def reads_blocks(self, rows: int, quantized: bool | None = None, lead: int = 0) -> bool:
        """Whether a call of `rows` rows, the first `lead` of them decode rows, reads the
        quantized blocks for all of them (else the dense weights for some or all)."""
        if self.quantized is None or self.policy == "dequantized":
            return False
        if self.policy == "quantized":
            return True
        if quantized is not None:
            return quantized
        return lead >= rows if self.by_row_kind else rows <= QUANTIZED_MAX_ROWS

    def __call__(self, x: torch.Tensor, quantized: bool | None = None, lead: int = 0,
                 cuts: tuple[int, ...] = ()) -> torch.Tensor:
        """x (T, in) -> (T, out) in x's dtype; does not modify x. `quantized`: True reads the
        blocks where this layer has them, False the dense weights, None by the policy: under
        `auto` with packed blocks the first `lead` rows (decode rows) read the blocks and the
        others the dense weights (each row's bits then its own whatever the batch), else by
        the row count (`reads_blocks`). `cuts`: the row counts of the step's items after the
        `lead` rows, in order; in bfloat16 on a CPU each item's rows get a dense product of their
        own (`_dense_cut`)."""
        rows = x.shape[0]
        if self.reads_blocks(rows, quantized, lead):
            return self.quantized(x)
        if quantized is None and lead > 0 and self.by_row_kind:
            return torch.cat([self.quantized(x[:lead]), self._dense_rest(x[lead:], cuts)])
        return self._dense_cut(x, ((lead,) if lead else ()) + cuts if cuts else ())

    def _dense_rest(self, x: torch.Tensor, cuts: tuple[int, ...]) -> torch.Tensor:
        """The dense product of the rows after the decode rows. float32 on a CPU: padded with zero rows to
        a multiple of 4 under 12 rows (MKL runs other kernels for the rest rows there: `runner.rows4`), so
        that these rows' bits do not depend on how many decode rows share the step."""
        n = x.shape[0]
        if x.dtype == torch.float32 and x.device.type == "cpu" and n < 12 and n % 4:
            return self._dense_cut(torch.cat([x, x.new_zeros((4 - n % 4, x.shape[1]))]), ())[:n]
        return self._dense_cut(x, cuts)

    def _dense_cut(self, x: torch.Tensor, cuts: tuple[int, ...]) -> torch.Tensor:
        """The dense product of rows x, in bfloat16 on a CPU one per cut (an item's rows): oneDNN's
        bfloat16 rows depend on the row count of their product (on a Xeon with AMX its kernels at
        SmolLM2's down projection differ from 5 to 189 rows against 256), and over PACKED_MAX_ROWS
        rows another kernel runs (F.linear: items of 200 and 100 rows in one product of 576 -> 960,
        15 of their 300 rows differ from each item's own product, on the same Xeon), so an item's
        bits would depend on what shares its step.
        Its own product gives each item the bits it has alone. float32 products are row-invariant
        (MKL in strict mode: blend/model/mkl.py) and run as one."""
        if len(cuts) > 1 and sum(cuts) == x.shape[0] and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            bounds = [0, *itertools.accumulate(cuts)]
            return torch.cat([self._dense_rows(x[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)])
        return self._dense_rows(x)

    def _dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The dense product, a single bfloat16 row padded where its shape needs (`one_row_differs`)."""
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and self.one_row_differs():
            return self._dense(torch.cat([x, x.new_zeros(x.shape)]))[:1]  # the path of two rows and more
        return self._dense(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense == MODULES or x.shape[0] > PACKED_MAX_ROWS:
            return torch.cat(self._dense_parts(x), dim=-1) if len(self.parts) > 1 else self._dense_parts(x)[0]
        weight, bias = self.packed
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")

    def one_row_differs(self) -> bool:
        """Whether a dense bfloat16 product of one row gives other bits than the same row among
        others (oneDNN runs one row by another kernel, which for wide inputs sums in another
        order): checked once per shape and layout on this machine and its threads, on
        `ONE_ROW_SAMPLES` seeded random rows (`runner.rows4`: 8 of 150 rows differed at SmolLM2's
        1536-wide down projection, 17 of 150 at Gemma 3's 2048-wide one, none at 1024 or less).
        Where it differs, one row runs padded to two (no row's bits then depend on its step)."""
        key = (self.in_features, self.out_features, self.dense, torch.get_num_threads())
        if key not in _ONE_ROW_DIFFERS:
            g = torch.Generator().manual_seed(0)
            x = torch.randn((ONE_ROW_SAMPLES, self.in_features), generator=g).to(torch.bfloat16)
            pairs = torch.cat([self._dense(x[i:i + 64]) for i in range(0, ONE_ROW_SAMPLES, 64)])  # among 64 rows
            _ONE_ROW_DIFFERS[key] = any(not torch.equal(self._dense(x[i:i + 1])[0], pairs[i])
                                        for i in range(ONE_ROW_SAMPLES))
        return _ONE_ROW_DIFFERS[key]

    def _dense_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, w, b) for w, b in self.parts)

    def split(self, x: torch.Tensor, quantized: bool | None = None, lead: int = 0,
              cuts: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
        """Each stacked layer's output (T, its out) for rows x (T, in): views of one product,
        or one F.linear per layer on the model's weights (dense, more than PACKED_MAX_ROWS
        rows, or the MODULES layout). `quantized`, `lead`, `cuts` as in `__call__`."""
        rows = x.shape[0]
        if (not self.reads_blocks(rows, quantized, lead) and (self.dense == MODULES or rows > PACKED_MAX_ROWS)
                and not (lead and quantized is None and self.by_row_kind) and len(cuts) + bool(lead) < 2):
            return self._dense_parts(x)
        return self(x, quantized, lead, cuts).split(self.widths, dim=-1)

    def nbytes(self) -> int:
        """Bytes of the dense copy (weight and bias) where it is built (oneDNN's layout may pad
        a little more); 0 where it is not (not yet, or never: the MODULES layout)."""
        if self._packed is None:
            return 0
        n = self.out_features * self.in_features + (self.out_features if self.has_bias else 0)
        return n * self.dtype.itemsize

    def dense_read_bytes(self) -> int:
        """Bytes one dense call of a few rows reads: the weight (and bias) in the compute dtype."""
        return (self.out_features * self.in_features + (self.out_features if self.has_bias else 0)) * self.dtype.itemsize

    def read_bytes(self, rows: int, quantized: bool | None = None, lead: int = 0) -> int:
        """Weight bytes a call of `rows` rows (the first `lead` decode rows) reads (blocks, the dense
        weights, or both)."""
        if quantized is None and 0 < lead < rows and self.by_row_kind:
            return self.read_bytes(lead, True) + self.dense_read_bytes()
        if self.reads_blocks(rows, quantized, lead):
            return self.quantized.nbytes + (self.out_features * 4 if self.quantized.bias is not None else 0)
        return self.dense_read_bytes()


@dataclass(frozen=True)
class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate and up as one product (`gate_up`: outputs gate | up)."""

    gate_up: Linear
    down: Linear
    act: torch.nn.Module  # the model's own activation module

    def __call__(self, x: torch.Tensor, quantized: bool | None = None, lead: int = 0,
                 cuts: tuple[int, ...] = ()) -> torch.Tensor:
        """Rows x (T, hidden) -> (T, hidden); `quantized`, `lead`, `cuts` as in `Linear.__call__`."""
        gate, up = self.gate_up.split(x, quantized, lead, cuts)  # (T, inter) each
        return self.down(self.act(gate) * up, quantized, lead, cuts)


@dataclass(frozen=True)
class LayerProjections:
    """One decoder layer's products: `qkv` (outputs q | k | v), `o`, and `mlp` (None: the
    model's MLP is not a gated one; the runner calls its module)."""

    qkv: Linear
    o: Linear
    mlp: GatedMLP | None

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o] + ([self.mlp.gate_up, self.mlp.down] if self.mlp is not None else [])


@dataclass(frozen=True)
class Projections:
    """Every layer's `LayerProjections` and the LM head (`layout`: how the dense products are
    stored; `weights`: the policy that picks blocks or dense weights per call)."""

    layers: tuple[LayerProjections, ...]
    lm_head: Linear
    layout: str = PACKED
    weights: str = "dequantized"

    def linears(self) -> list[Linear]:
        return [lin for lp in self.layers for lin in lp.linears()] + [self.lm_head]

    def nbytes(self) -> int:
        """Bytes of the dense copies built so far (beside the model's own weights)."""
        return sum(p.nbytes() for p in self.linears())

    def quantized_nbytes(self) -> int:
        """Bytes of the quantized blocks these products hold (0: none)."""
        return sum(p.quantized.nbytes for p in self.linears() if p.quantized is not None)

    def packed_nbytes(self) -> int:
        """Bytes of the packed copies of the blocks (`QuantizedProduct.packed`; 0: none)."""
        return sum(p.quantized.nbytes for p in self.linears() if p.quantized is not None and p.quantized.packed)

    def read_bytes(self, rows: int = 1, quantized: bool | None = None, lead: int | None = None) -> int:
        """Weight bytes one step of `rows` rows (`lead` of them decode rows: all by default) reads
        through these products (each layer once)."""
        return sum(p.read_bytes(rows, quantized, rows if lead is None else lead) for p in self.linears())

    def block_layers(self) -> int:
        """How many of the products hold quantized blocks."""
        return sum(p.quantized is not None for p in self.linears())


def projection_layout(device: torch.device, dtype: torch.dtype) -> str | None:
    """The layout of the runner's dense products for a model on `device` in `dtype`: `packed`
    for bfloat16 on a CPU with oneDNN's bf16 kernels, None (the model's modules as they are)
    otherwise."""
    if (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return PACKED
    return None


def _blocks_for(blocks: QuantizedWeights | None, model: torch.nn.Module, names: Sequence[str],
                biases: Sequence[torch.Tensor | None], what: str) -> QuantizedProduct | None:
    """The product of the blocks named `names`, checked against the model's own weights (a few
    rows dequantized must equal them in the model's dtype: a mapping, a permutation or a block
    that does not decode the same is declined, with one log line), or None."""
    if blocks is None:
        return None
    found = [blocks.get(n) for n in names]
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, m in zip(names, found, strict=True):
        w = params.get(name)
        if m is None or w is None:
            continue
        if m.problem() is None and tuple(w.shape) == (m.out_features, m.in_features):
            rows = sorted({0, 1, m.out_features // 2 + 1, m.out_features - 1})
            sample = QuantizedMatrix(m.kind, m.blocks[rows], m.in_features).dequantize()  # (3, in) float32
            if torch.equal(sample.to(w.dtype), w.detach()[rows].cpu()):
                continue
            problem = "its blocks do not decode to the model's weights"
        else:
            problem = m.problem() or f"its shape {(m.out_features, m.in_features)} is not the model's {tuple(w.shape)}"
        log.warning("%s runs on the dequantized weights: %s (%s)", what, problem, name)
        return None
    return product(found, biases, what)


def build_projections(model: torch.nn.Module, *, dense: str = PACKED, blocks: QuantizedWeights | None = None,
                      weights: str = "dequantized") -> Projections:
    """The `Projections` of a transformers *ForCausalLM (llama, mistral, qwen2, qwen3,
    gemma3_text): dense products in `dense` layout (the packed copies built on first use),
    and products from `blocks` where it holds the layers' matrices and `weights` is not
    `dequantized`. Does not modify the model."""
    use = blocks if weights != "dequantized" else None

    def linear(prefix: str, names: Sequence[str], mods: Sequence[torch.nn.Module]) -> Linear:
        biases = [getattr(m, "bias", None) for m in mods]
        q = _blocks_for(use, model, [f"{prefix}{n}.weight" for n in names], biases, f"{prefix}{'+'.join(names)}")
        return Linear([m.weight for m in mods], biases, dense=dense, quantized=q, policy=weights)

    layers = []
    for i, block in enumerate(model.model.layers):
        attn, mlp = block.self_attn, block.mlp
        pre = f"model.layers.{i}."
        qkv = linear(pre, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                     [attn.q_proj, attn.k_proj, attn.v_proj])
        o = linear(pre, ["self_attn.o_proj"], [attn.o_proj])
        gated = None
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            gate_up = linear(pre, ["mlp.gate_proj", "mlp.up_proj"], [mlp.gate_proj, mlp.up_proj])
            gated = GatedMLP(gate_up, linear(pre, ["mlp.down_proj"], [mlp.down_proj]), mlp.act_fn)
        layers.append(LayerProjections(qkv, o, gated))
    head = linear("", ["lm_head"], [model.lm_head])
    any_blocks = head.quantized is not None or any(x.quantized is not None for lp in layers for x in lp.linears())
    return Projections(tuple(layers), head, dense, weights if any_blocks else "dequantized")


def quantized_why_not(device: torch.device) -> str:
    """Why the blocks cannot be read on `device` (for messages)."""
    from blend.model.native import kernel_mode

    if device.type != "cpu":
        return f"the blocks are read on a CPU only, not {device}"
    if quant_kernel() is None:
        return f"the native kernel is off or did not build (KVBLEND_DECODE_KERNEL={kernel_mode()})"
    return "the model computes in neither float32 nor bfloat16"


_built: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, Projections]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def projections_for(model: torch.nn.Module, blocks: QuantizedWeights | None = None,
                    weights: str = "auto") -> Projections | None:
    """The shared `Projections` of `model` for its current device and dtype (built on first
    use, then kept as long as the model lives), or None where the modules run as they are
    (`projection_layout` is None and there are no `blocks` the native kernel reads). `blocks`
    (the model's GGUF blocks, `LoadedModel.blocks`) are read under `weights` (`WEIGHTS`). A
    model moved, cast or with weights changed in place since (each parameter's version
    counter), or asked for with other blocks or policy, is built again."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
    params = list(model.parameters())
    device, dtype = params[0].device, params[0].dtype
    layout = projection_layout(device, dtype)
    use_blocks = (blocks is not None and weights != "dequantized" and device.type == "cpu"
                  and dtype in (torch.float32, torch.bfloat16) and quant_kernel() is not None)
    if weights == "quantized" and blocks is not None and not use_blocks:
        raise ValueError(f"weights: quantized needs the native quantized kernel on a CPU ({quantized_why_not(device)}); "
                         "use weights: auto or dequantized")
    if layout is None and not use_blocks:
        return None
    state = (layout, device, dtype, tuple(p.data_ptr() for p in params), tuple(p._version for p in params),
             id(blocks) if use_blocks else None, weights if use_blocks else "dequantized")
    with _lock:
        hit = _built.get(model)
        if hit is not None and hit[0] == state:
            return hit[1]
        built = build_projections(model, dense=layout or MODULES, blocks=blocks if use_blocks else None,
                                  weights=weights if use_blocks else "dequantized")
        _built[model] = (state, built)
        return built
