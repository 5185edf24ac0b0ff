"""A decoder layer for decode rows in one native call (kernels/quant_matmul.c, "a decode layer").

A decode row's layer is ~20 small tensor ops between five native calls (four products from
packed blocks and the decode attention); at batch 1 on SmolLM2 their crossings from Python
cost about as much as the products themselves. `DecodeLayer` runs the whole layer for a
step's decode rows in one call: RMS norm, Q/K/V, RoPE, K/V written into each row's cache,
attention over it, output projection and residual, RMS norm, SiLU-gated MLP and residual.

It applies to Llama-style layers whose four products read packed blocks (`projections`
under `weights: auto` or `quantized` with AVX-512 VNNI or AVX2): plain RMS norms, no q/k norms nor
Gemma's sandwich, a SiLU-gated MLP, full attention (no sliding window), in float32 or
bfloat16, with the native decode kernel built. `Runner.forward` uses it for every decode
row of such a layer whatever else shares the step (a row's bits are then its own: each
stage is per row, the products and the attention batch-invariant); other rows, other
layers and other models go through the runner's torch ops.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from blend.model.cache import KVCache
from blend.model.native import KINDS, MAX_HEAD_DIM, MAX_QUERY_ROWS, decode_kernel, quant_kernel
from blend.model.projections import LayerProjections, Linear

PLAIN_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * (x * rsqrt(mean(x^2) + eps))
SILU = ("SiLUActivation", "SiLU")
ROW_FIELDS = 10  # the kernel's kvb_drow: pos, lo, k, v, k_head, k_row, v_head, v_row, bias, bias_head


class DecodeLayer:
    """One layer's decode rows through `kvb_qdecode_layer` (built by `build`; None where the
    layer is not one it runs)."""

    def __init__(self, table: torch.Tensor, eps: tuple[float, float], scaling: float, dtype: torch.dtype,
                 hidden: int, keep: tuple[object, ...], linears: tuple[Linear, ...]):
        self.table = table  # (20,) int64: the kernel's kvb_layer record
        self.eps = eps
        self.scaling = scaling
        self.dtype = dtype
        self.hidden = hidden
        self._keep = keep  # what the table points into (norm weights, products)
        self.linears = linears
        self._call = quant_kernel().kvb_qdecode_layer

    @classmethod
    def build(cls, block: torch.nn.Module, proj: LayerProjections | None, *, heads: int, kv_heads: int,
              head_dim: int, scaling: float, dtype: torch.dtype, window: int | None,
              sandwich: bool, qk_norm: bool) -> DecodeLayer | None:
        """The layer's `DecodeLayer`, or None where it is not one the kernel runs (see the module doc)."""
        if proj is None or proj.mlp is None or sandwich or qk_norm or window is not None or dtype not in KINDS:
            return None
        linears: list[Linear] = [proj.qkv, proj.o, proj.mlp.gate_up, proj.mlp.down]
        if any(lin.policy not in ("auto", "quantized") or lin.quantized is None or not lin.quantized.packed
               for lin in linears):
            return None
        lib, attention = quant_kernel(), decode_kernel()  # (built already: the products are packed)
        if lib is None or attention is None:
            return None
        norms = (block.input_layernorm, block.post_attention_layernorm)
        if (any(type(n).__name__ not in PLAIN_NORMS or n.weight.dtype != dtype for n in norms)
                or type(proj.mlp.act).__name__ not in SILU):
            return None
        if heads % kv_heads or heads // kv_heads > MAX_QUERY_ROWS or head_dim > MAX_HEAD_DIM or head_dim % 2:
            return None
        hidden, inter = proj.qkv.in_features, proj.mlp.down.in_features
        if (proj.qkv.out_features != (heads + 2 * kv_heads) * head_dim or proj.o.in_features != heads * head_dim
                or proj.mlp.gate_up.out_features != 2 * inter or proj.mlp.down.out_features != hidden):
            return None
        weights = tuple(n.weight.detach().contiguous() for n in norms)
        table = [hidden, heads, kv_heads, head_dim, inter, weights[0].data_ptr(), weights[1].data_ptr()]
        for lin in linears:
            table += lin.quantized.table()
        table.append(ctypes.cast(attention.kvb_decode_attention_batch, ctypes.c_void_p).value)
        eps = tuple(float(n.variance_epsilon) for n in norms)
        return cls(torch.tensor(table, dtype=torch.int64), eps, float(scaling), dtype, hidden,
                   (weights, tuple(lin.quantized for lin in linears)), tuple(linears))

    def on(self) -> bool:
        """Whether the layer's products still read the blocks for decode rows (their policy may be
        changed after the runner is built: `dequantized` then turns this off)."""
        return all(lin.policy != "dequantized" for lin in self.linears)

    def takes(self, cache: KVCache, layer: int) -> bool:
        """Whether a decode row on `cache` can run this layer here: the layer is not a ring, its
        K/V are in the compute dtype on the CPU with contiguous rows."""
        k, v = cache.k[layer], cache.v[layer]
        return (not cache.is_ring(layer) and k.dtype == self.dtype and v.dtype == self.dtype
                and k.device.type == "cpu" and k.stride(2) == 1 and v.stride(2) == 1)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rows: Sequence[tuple[KVCache, int]], layer: int) -> torch.Tensor:
        """Decode rows h (B, hidden) at their RoPE rows cos, sin_signed (B, D), each row b on cache
        rows[b][0] at position rows[b][1] (`takes`): their K/V written there, the layer's output
        (B, hidden) returned."""
        b = h.shape[0]
        if h.stride(-1) != 1:
            h = h.contiguous()
        if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
        table: list[int] = []
        for cache, pos in rows:
            k, v = cache.k[layer], cache.v[layer]
            bias = cache.bias[layer] if cache.bias is not None else None
            table += (pos, 0, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      bias.data_ptr() if bias is not None else 0, bias.stride(0) if bias is not None else 0)
        drows = torch.tensor(table, dtype=torch.int64)  # (B, ROW_FIELDS)
        out = torch.empty((b, self.hidden), dtype=self.dtype)
        done = self._call(KINDS[self.dtype], b, self.table.data_ptr(), self.eps[0], self.eps[1], self.scaling,
                          h.data_ptr(), h.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                          drows.data_ptr(), out.data_ptr(), out.stride(0))
        if done != 0:
            raise RuntimeError(f"the native decode layer failed ({done}) on {b} rows at layer {layer}")
        return out


class DecodeStack:
    """Every layer's `DecodeLayer` one after the other in one native call (`kvb_qdecode_layers`), for a
    step of decode rows only: the same bits as the layers' calls in turn, without Python between them
    (at batch 1 on SmolLM2, 1,024 positions, 2 cores: 5.2 against 5.8 ms a step, the two alternating)."""

    def __init__(self, layers: Sequence[DecodeLayer]):
        self.layers = tuple(layers)
        first = self.layers[0]
        self.dtype, self.hidden = first.dtype, first.hidden
        self.records = torch.tensor([dl.table.data_ptr() for dl in self.layers], dtype=torch.int64)  # (L,)
        # (L, 3) float32: each layer's eps (two) and scaling, as the per-layer call passes them (c_float)
        self.params = torch.tensor([(dl.eps[0], dl.eps[1], dl.scaling) for dl in self.layers], dtype=torch.float32)
        self._call = quant_kernel().kvb_qdecode_layers

    @classmethod
    def build(cls, layers: Sequence[DecodeLayer | None]) -> DecodeStack | None:
        """The stack of a model whose every layer has a `DecodeLayer` of one dtype (else None). (A
        `DecodeLayer` exists only where the kernel library loaded, every function of it bound.)"""
        if not layers or any(dl is None for dl in layers) or len({(dl.dtype, dl.hidden) for dl in layers}) != 1:
            return None
        return cls(layers)

    def on(self) -> bool:
        """Whether every layer's products still read the blocks (`DecodeLayer.on`)."""
        return all(dl.on() for dl in self.layers)

    def takes(self, cache: KVCache) -> bool:
        """Whether a decode row on `cache` can run every layer here (`DecodeLayer.takes`)."""
        return all(dl.takes(cache, layer) for layer, dl in enumerate(self.layers))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rows: Sequence[tuple[KVCache, int]]) -> torch.Tensor:
        """Decode rows h (B, hidden) at their RoPE rows cos, sin_signed (B, D), each row b on cache
        rows[b][0] at position rows[b][1] (`takes`), through every layer: their K/V written at each,
        the last layer's output (B, hidden) returned."""
        b, n = h.shape[0], len(self.layers)
        if h.stride(-1) != 1:
            h = h.contiguous()
        if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
        per_row = []  # each row's ROW_FIELDS values at every layer
        for cache, pos in rows:
            ks, vs = cache.k, cache.v
            bias = cache.bias
            per_row.append([(pos, 0, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             bias[i].data_ptr() if bias is not None else 0,
                             bias[i].stride(0) if bias is not None else 0)
                            for i, (k, v) in enumerate(zip(ks, vs, strict=True))])
        drows = torch.tensor([per_row[r][layer] for layer in range(n) for r in range(b)],
                             dtype=torch.int64)  # (L * B, ROW_FIELDS): layer-major
        work = torch.empty((2, b, self.hidden), dtype=self.dtype)
        out = torch.empty((b, self.hidden), dtype=self.dtype)
        done = self._call(KINDS[self.dtype], b, n, self.records.data_ptr(), self.params.data_ptr(), h.data_ptr(),
                          h.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), drows.data_ptr(),
                          work.data_ptr(), out.data_ptr(), out.stride(0))
        if done != 0:
            raise RuntimeError(f"the native decode layers failed ({done}) on {b} rows")
        return out
