"""The model's linear layers as a GGUF file stores them: quantized blocks (4 to 8 bits a
weight plus the blocks' scales), multiplied straight from those blocks by the native
kernel (blend/model/kernels/quant_matmul.c) for the few rows of a decode step.

Why: a decode step reads every weight once a token. The shipped GGUFs hold SmolLM2 in Q4_1
(its embedding / LM head in Q8_0) and Gemma 3 in Q5_0 / Q4_K / Q6_K / Q8_0; the dequantized
bfloat16 copy is ~3.4x (Q4_1) the bytes, and at batch 1 a token costs its bytes.

- `BLOCK_TYPES`: the block types read here (GGML's ids, weights and bytes a block).
- `QuantizedMatrix`: one weight matrix (out, in) as its blocks, one row of blocks an output.
- `QuantizedWeights`: a model's matrices by the transformers parameter name they stand for
  (`model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`), with `read_blocks`
  (out of a GGUF file: names mapped, llama's Q/K rows put back in transformers' order,
  unsupported types left out) and `save` / `load_weights` (a `blocks.safetensors` file beside
  the converted copy, written once: parsing a GGUF's metadata takes ~20 s for Gemma 3).
- The products themselves (`QuantizedProduct`, `product`) live in blend/model/projections.py,
  beside the dense ones.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BLOCKS_FILE = "blocks.safetensors"
WEIGHTS = ("auto", "quantized", "dequantized")  # the config's `weights` policy (blend.model.projections)
_FORMAT = "kvblend-blocks-1"


@dataclass(frozen=True)
class BlockType:
    """One GGML block type: its id (GGML's), weights and bytes per block."""

    name: str
    ggml_id: int
    weights: int
    nbytes: int
    kquant: bool = False  # a 256-weight super-block

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.weights * self.nbytes


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q4_0", 2, 32, 18), BlockType("Q4_1", 3, 32, 20), BlockType("Q5_0", 6, 32, 22),
    BlockType("Q8_0", 8, 32, 34), BlockType("Q4_K", 12, 256, 144, True), BlockType("Q6_K", 14, 256, 210, True))}
MIN_WIDTH = 64  # the kernel takes inputs in pairs of 32-blocks: in_features a multiple of 64 (256: a K-quant)


@dataclass(frozen=True)
class QuantizedMatrix:
    """W (out, in) as blocks: row i holds output i's blocks along `in`, as the GGUF stores them."""

    kind: str  # a BLOCK_TYPES name
    blocks: torch.Tensor  # (out, row bytes) uint8, rows contiguous
    in_features: int

    @property
    def block_type(self) -> BlockType:
        return BLOCK_TYPES[self.kind]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def problem(self) -> str | None:
        """Why the kernel cannot take this matrix, or None."""
        spec = BLOCK_TYPES.get(self.kind)
        if spec is None:
            return f"block type {self.kind} is not one the kernel reads ({', '.join(BLOCK_TYPES)})"
        if self.in_features % (256 if spec.kquant else MIN_WIDTH):
            return f"{self.in_features} inputs is not a multiple of {256 if spec.kquant else MIN_WIDTH}"
        if (self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2
                or self.blocks.shape[1] != spec.row_bytes(self.in_features) or self.blocks.stride(1) != 1):
            return (f"its blocks {tuple(self.blocks.shape)} {self.blocks.dtype} are not {self.out_features} rows of "
                    f"{spec.row_bytes(self.in_features)} bytes")
        return None

    def dequantize(self) -> torch.Tensor:
        """W (out, in) float32, by the gguf package's own dequantizer (tests, references)."""
        from gguf import GGMLQuantizationType, dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.kind])
        return torch.from_numpy(values.reshape(self.out_features, self.in_features).copy()).float()


@dataclass(frozen=True)
class QuantizedWeights:
    """A model's quantized matrices by transformers parameter name (`lm_head.weight` for the
    LM head, the embedding's blocks when the model ties them)."""

    matrices: Mapping[str, QuantizedMatrix]
    source: str  # the GGUF it came from (its sha256)

    def get(self, name: str) -> QuantizedMatrix | None:
        return self.matrices.get(name)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.matrices.values())

    def kinds(self) -> dict[str, int]:
        """How many matrices of each block type, e.g. {"Q4_1": 210, "Q8_0": 1}."""
        out: dict[str, int] = {}
        for m in self.matrices.values():
            out[m.kind] = out.get(m.kind, 0) + 1
        return dict(sorted(out.items()))

    def save(self, path: Path) -> None:
        """Write them as one safetensors file (uint8 tensors; kinds and widths in its metadata).
        Side effect: writes `path` through a temporary file and a rename."""
        import os

        from safetensors.torch import save_file

        meta = {"format": _FORMAT, "source": self.source,
                "matrices": json.dumps({n: [m.kind, m.in_features] for n, m in self.matrices.items()})}
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_file({n: m.blocks.contiguous() for n, m in self.matrices.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)


def load_weights(path: Path) -> QuantizedWeights | None:
    """The blocks saved at `path` (`QuantizedWeights.save`), or None where there is no such
    file or it is not one (logged; the caller writes it again)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("format") != _FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, not {_FORMAT}")
            listed = json.loads(meta["matrices"])
            matrices = {name: QuantizedMatrix(kind, fh.get_tensor(name), int(width))
                        for name, (kind, width) in listed.items()}
        return QuantizedWeights(matrices, meta.get("source", ""))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        log.warning("the quantized blocks at %s do not read (%s); writing them again", path, err)
        return None


# GGUF tensor name (after "blk.N.") -> the transformers parameter under model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp's converter interleaves their Q / K rows for its RoPE


def _unpermute(blocks: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of Q or K in transformers' order from llama.cpp's (per head, the two RoPE halves
    interleaved row by row): the inverse of the converter's permutation, on whole block rows."""
    rows = blocks.shape[0]
    half = rows // heads // 2
    return blocks.reshape(heads, half, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()


def read_blocks(gguf_path: Path, source: str = "") -> QuantizedWeights:
    """The quantized linear layers of a GGUF file, by transformers parameter name. Tensors in
    a type the kernel does not read (F16, F32, other quants) are left out: those layers run
    dequantized. Reads the whole file (tens of seconds for a large vocabulary)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def scalar(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.parts[-1][0]) if field is not None else None

    heads, kv_heads = scalar("attention.head_count"), scalar("attention.head_count_kv")
    matrices: dict[str, QuantizedMatrix] = {}
    skipped: dict[str, int] = {}
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        kind = t.tensor_type.name
        parts = t.name.split(".")
        if t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
            name = "lm_head.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
            name = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
        else:
            continue
        if kind not in BLOCK_TYPES:
            skipped[kind] = skipped.get(kind, 0) + 1
            continue
        in_features, out_features = (int(x) for x in t.shape[:2])
        blocks = torch.from_numpy(t.data.reshape(out_features, -1).copy())  # (out, row bytes) uint8
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")) and heads:
            blocks = _unpermute(blocks, heads if parts[2] == "attn_q" else (kv_heads or heads))
        matrices[name] = QuantizedMatrix(kind, blocks, in_features)
    if skipped:
        log.info("%s: %s tensors are not in a block type the kernel reads; they run dequantized", gguf_path.name,
                 ", ".join(f"{n} {k}" for k, n in sorted(skipped.items())))
    return QuantizedWeights(matrices, source)
