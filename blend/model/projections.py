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
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED = "packed"
PACKED_MAX_ROWS = 256  # more rows than this: F.linear on the model's weights beats the packed product


class Linear:
    """One product y = x W^T + b of one or several of the model's linear layers stacked along
    their outputs (q, k, v -> one W of q_out + k_out + v_out rows), prepacked for oneDNN."""

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]):
        self.parts = tuple((w.detach(), b.detach() if b is not None else None)
                           for w, b in zip(weights, biases, strict=True))  # the model's own tensors, not copies
        w = torch.cat([t.detach() for t in weights]) if len(weights) > 1 else weights[0].detach()  # (out, in)
        self.dtype = w.dtype
        self.out_features, self.in_features = w.shape
        self.widths = tuple(t.shape[0] for t in weights)  # each stacked layer's outputs, in order
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else w.new_zeros(n)
                                   for b, n in zip(biases, self.widths, strict=True)])  # (out,)
        else:
            self.bias = None
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)  # oneDNN's blocked layout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out) in x's dtype; does not modify x."""
        if x.shape[0] > PACKED_MAX_ROWS:
            return torch.cat(self.split(x), dim=-1)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each stacked layer's output (T, its out) for rows x (T, in): views of one product,
        or (more than PACKED_MAX_ROWS rows) one F.linear per layer on the model's weights."""
        if x.shape[0] > PACKED_MAX_ROWS:
            return tuple(F.linear(x, w, b) for w, b in self.parts)
        return self(x).split(self.widths, dim=-1)

    def nbytes(self) -> int:
        """Bytes of the weight and bias (oneDNN's layout may pad a little more)."""
        n = self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate and up as one product (`gate_up`: outputs gate | up)."""

    gate_up: Linear
    down: Linear
    act: torch.nn.Module  # the model's own activation module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x (T, hidden) -> (T, hidden)."""
        gate, up = self.gate_up.split(x)  # (T, inter) each
        return self.down(self.act(gate) * up)


@dataclass(frozen=True)
class LayerProjections:
    """One decoder layer's products: `qkv` (outputs q | k | v), `o`, and `mlp` (None: the
    model's MLP is not a gated one; the runner calls its module)."""

    qkv: Linear
    o: Linear
    mlp: GatedMLP | None


@dataclass(frozen=True)
class Projections:
    """Every layer's `LayerProjections` and the LM head (`layout`: how they are stored)."""

    layers: tuple[LayerProjections, ...]
    lm_head: Linear
    layout: str = PACKED

    def nbytes(self) -> int:
        """Bytes these copies hold (beside the model's own weights)."""
        parts = [self.lm_head]
        for lp in self.layers:
            parts += [lp.qkv, lp.o] + ([lp.mlp.gate_up, lp.mlp.down] if lp.mlp is not None else [])
        return sum(p.nbytes() for p in parts)


def projection_layout(device: torch.device, dtype: torch.dtype) -> str | None:
    """The layout of the runner's products for a model on `device` in `dtype`: `packed` for
    bfloat16 on a CPU with oneDNN's bf16 kernels, None (the model's modules as they are)
    otherwise."""
    if (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return PACKED
    return None


def build_projections(model: torch.nn.Module) -> Projections:
    """The packed `Projections` of a transformers *ForCausalLM (llama, mistral, qwen2, qwen3).
    Copies the weights; does not modify the model."""
    layers = []
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = Linear([p.weight for p in parts], [p.bias for p in parts])
        o = Linear([attn.o_proj.weight], [attn.o_proj.bias])
        gated = None
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            gate_up = Linear([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias])
            gated = GatedMLP(gate_up, Linear([mlp.down_proj.weight], [mlp.down_proj.bias]), mlp.act_fn)
        layers.append(LayerProjections(qkv, o, gated))
    head = model.lm_head
    return Projections(tuple(layers), Linear([head.weight], [getattr(head, "bias", None)]))


_built: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, Projections]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def projections_for(model: torch.nn.Module) -> Projections | None:
    """The shared `Projections` of `model` for its current device and dtype (built on first
    use, then kept as long as the model lives), or None where the modules run as they are
    (`projection_layout`). A model moved, cast or with weights changed in place since (each
    parameter's version counter) is built again."""
    params = list(model.parameters())
    layout = projection_layout(params[0].device, params[0].dtype)
    if layout is None:
        return None
    state = (layout, params[0].device, params[0].dtype, tuple(p.data_ptr() for p in params),
             tuple(p._version for p in params))
    with _lock:
        hit = _built.get(model)
        if hit is not None and hit[0] == state:
            return hit[1]
        built = build_projections(model)
        _built[model] = (state, built)
        return built

