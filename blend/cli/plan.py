"""`kvblend plan`: the transfer-budget planner (blend.planner) from the command line.

With `--json` the last stdout line is one JSON object with the fields of `PlanResult.to_dict()`.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Any

from blend.cli.common import emit_json
from blend.planning import planner
from blend.planning.planner import (
    DEFAULT_KV_DTYPE_BYTES,
    DEFAULT_MIN_RATIO,
    MLA_AND_MHA,
    PROFILE_TOKENS,
    MLAShape,
    ModelKVShape,
    PlanInputs,
    PlanResult,
    fmt_bytes,
    plan,
    transfer_stages,
)
from storage.dtypes import DTYPE_BYTES
from storage.units import format_rate, parse_bytes


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


def _ratio(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a ratio between 0 and 1 (e.g. 0.15), got {value!r}")
    return x


def _io_block(value: str) -> int:
    try:
        n = parse_bytes(value, "I/O block size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"--io-block must be > 0 bytes (e.g. 4096, '16KiB', '1MiB'), got {value!r}")
    return n


def _dtype_bytes(value: str) -> int:
    """Bytes per element: 1, 2 or 4, or a dtype name from storage.dtypes."""
    key = value.strip()
    if key in ("1", "2", "4"):
        return int(key)
    if key in DTYPE_BYTES:
        return DTYPE_BYTES[key]
    raise argparse.ArgumentTypeError(f"expected 1, 2 or 4 or a dtype name ({', '.join(DTYPE_BYTES)}), got {value!r}")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; returns its parser.

    The handler is set as the `func` default (`args.func(args)` returns an exit code).
    """
    p = subparsers.add_parser(
        "plan",
        help="transfer budget: is loading a KV cache faster than recomputing it?",
        description=(
            "Size the KV payload for --tokens, bound its load time by the slowest transfer stage "
            "(storage: --read-mibps / --read-iops x --io-block; link: --link-gibps), compare with the "
            "prefill time (--prefill-tokens-per-s, or measured with --model) and recommend a "
            "CacheBlend recompute ratio."
        ),
    )
    shape = p.add_argument_group(
        "KV shape (--model, or --layers/--kv-heads/--head-dim, or --layers/--kv-lora-rank/--rope-head-dim for MLA)")
    shape.add_argument("--model", help="alias, shape (deepseek-v2-lite, deepseek-v2, deepseek-v3, kimi-k2, "
                                       "random:<shape>) or local model; dims are read from its config")
    shape.add_argument("--layers", type=_positive_int, help="number of transformer layers L")
    shape.add_argument("--kv-heads", type=_positive_int, help="number of KV heads H")
    shape.add_argument("--head-dim", type=_positive_int, help="head dimension D")
    shape.add_argument("--kv-lora-rank", type=_positive_int,
                       help="MLA: elements of the latent each layer caches per token (kv_lora_rank R)")
    shape.add_argument("--rope-head-dim", type=_positive_int,
                       help="MLA: elements of the decoupled RoPE key each layer caches per token (qk_rope_head_dim)")
    shape.add_argument(
        "--dtype-bytes", type=_dtype_bytes, default=DEFAULT_KV_DTYPE_BYTES,
        help="bytes per stored KV element: 1, 2 or 4, or float16/bfloat16/float32 (default 2)",
    )
    shape.add_argument("--tp", type=_positive_int, default=1,
                       help="tensor-parallel ranks: bytes per rank, and stored when every rank writes vs one copy "
                            "(MHA/GQA heads split across ranks; every rank holds the whole MLA latent)")
    p.add_argument("--tokens", type=_positive_int, required=True, help="context tokens N to load")
    path = p.add_argument_group("transfer path (at least one stage)")
    path.add_argument("--read-mibps", type=_positive_float, help="storage read bandwidth, MiB/s")
    path.add_argument("--read-iops", type=_positive_float, help="storage read IOPS (needs --io-block)")
    path.add_argument("--io-block", type=_io_block, help="bytes per read I/O: 4096, 16KiB, 1MiB ...")
    path.add_argument("--link-gibps", type=_positive_float, help="host-to-device link bandwidth, GiB/s")
    p.add_argument(
        "--prefill-tokens-per-s", type=_positive_float,
        help="prefill throughput; if absent it is measured with --model",
    )
    p.add_argument(
        "--min-ratio", type=_ratio, default=DEFAULT_MIN_RATIO,
        help=f"minimum recompute ratio r_min (default {DEFAULT_MIN_RATIO})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=functools.partial(run_plan, parser=p))
    return p


def _inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Resolve the KV shape, validate the path, and get the prefill rate (may measure)."""
    dims = (args.layers, args.kv_heads, args.head_dim)
    mla_dims = (args.kv_lora_rank, args.rope_head_dim)
    if any(d is not None for d in mla_dims) and any(d is not None for d in dims[1:]):
        raise ValueError(MLA_AND_MHA)
    transfer_stages(args.read_mibps, args.read_iops, args.io_block, args.link_gibps)  # before any model loads
    if args.prefill_tokens_per_s is None and args.model is None:
        raise ValueError("pass --prefill-tokens-per-s, or --model to measure the prefill rate")
    if args.model is not None:
        if any(d is not None for d in (*dims, *mla_dims)):
            raise ValueError("pass either --model or --layers/--kv-heads/--head-dim (MLA: --layers/--kv-lora-rank/"
                             "--rope-head-dim), not both")
        shape = planner.model_kv_shape(args.model)
        if args.prefill_tokens_per_s is None and shape.unsupported is not None:
            raise ValueError(f"{args.model} cannot be run here to measure its prefill rate ({shape.unsupported}); "
                             "pass --prefill-tokens-per-s")
    elif any(d is not None for d in mla_dims):
        if args.layers is None or any(d is None for d in mla_dims):
            raise ValueError("an MLA cache needs all of --layers, --kv-lora-rank and --rope-head-dim")
        shape = ModelKVShape(args.layers, None, None, mla=MLAShape(*mla_dims))
    elif any(d is None for d in dims):
        raise ValueError("pass --model NAME, or all of --layers, --kv-heads and --head-dim (MLA: --layers, "
                         "--kv-lora-rank and --rope-head-dim)")
    else:
        shape = ModelKVShape(*dims)
    rate, source = args.prefill_tokens_per_s, "given"
    if rate is None:
        print(f"measuring prefill of {args.model} ({PROFILE_TOKENS} tokens) ...", file=sys.stderr)
        prof = planner.profile_prefill(args.model, PROFILE_TOKENS)
        rate, source = prof.tokens_per_s, f"measured on {prof.device} ({prof.tokens} tokens)"
    return PlanInputs(
        layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        dtype_bytes=args.dtype_bytes, tokens=args.tokens, prefill_tokens_per_s=rate,
        read_mibps=args.read_mibps, read_iops=args.read_iops, io_block_bytes=args.io_block,
        link_gibps=args.link_gibps, min_ratio=args.min_ratio, prefill_source=source,
        layer_types=shape.layer_types, window=shape.window, mla=shape.mla, tp=args.tp,
    )


def format_plan(result: PlanResult) -> list[str]:
    """Human-readable lines for `result`."""
    lines = []
    if result.attention == "mla":
        lines.append(f"attention          : MLA, per layer and token a latent of {result.latent_dim} and a RoPE key "
                     f"of {result.rope_head_dim} elements, shared by all heads")
    lines += [
        f"KV per token       : {result.kv_bytes_per_token} B ({fmt_bytes(result.kv_bytes_per_token)})",
        f"payload            : {result.payload_bytes} B ({fmt_bytes(result.payload_bytes)}) for {result.tokens} tokens",
    ]
    mha = result.mha_equivalent_bytes_per_token
    if result.attention == "mla":
        lines.append(f"MHA formula        : {mha} B ({fmt_bytes(mha)}) per token over the model's heads, "
                     f"{mha / result.kv_bytes_per_token:.1f}x the MLA bytes" if mha is not None else
                     "MHA formula        : unknown (pass --model for the heads' dims)")
    if result.tp > 1:
        held = "the whole latent" if result.attention == "mla" else "its share of the KV heads"
        lines.append(f"tensor parallel    : {result.tp} ranks, each holds {held}: {fmt_bytes(result.bytes_per_rank)}; "
                     f"stored {fmt_bytes(result.stored_bytes_every_rank)} when every rank writes, "
                     f"{fmt_bytes(result.stored_bytes_single_copy)} as one copy")
    if "sliding" in result.layers_by_type:
        share = result.payload_bytes / result.uniform_payload_bytes
        lines += [
            f"layers             : {', '.join(f'{n} {t}' for t, n in result.layers_by_type.items())} "
            f"(window {result.window} tokens)",
            f"uniform payload    : {result.uniform_payload_bytes} B ({fmt_bytes(result.uniform_payload_bytes)}); "
            f"the windows keep {share:.1%} of it",
        ]
    for s in result.stages:
        mark = "  <- bottleneck" if s.name == result.bottleneck else ""
        lines.append(f"stage {s.name:<13}: {format_rate(s.bytes_per_s)} (limited by {s.limited_by}){mark}")
    lines += [
        f"path bandwidth     : {format_rate(result.path_bytes_per_s)}",
        f"t_load_min         : {result.t_load_min_s:.4g} s",
        f"t_prefill          : {result.t_prefill_s:.4g} s at {result.prefill_tokens_per_s:.6g} tokens/s "
        f"({result.prefill_source})",
        f"recommended ratio  : {result.recommended_ratio:.3g} (r_min {result.min_ratio:g})",
        f"verdict            : {result.verdict}",
    ]
    return lines


def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Handle `kvblend plan`: print the plan (JSON last line with --json); returns 0.

    Invalid flag combinations exit with status 2 through `parser.error` (raise ValueError
    when no parser is given). May load the model to measure prefill.
    """
    try:
        result = plan(_inputs_from_args(args))
    except ValueError as exc:
        if parser is None:
            raise
        parser.error(str(exc))
    if args.json:
        emit_json(result)
    else:
        print("\n".join(format_plan(result)))
    return 0
