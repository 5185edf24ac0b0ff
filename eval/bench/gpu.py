"""`make bench-gpu`: `kvblend bench ttft` on one CUDA GPU with a random-weight Llama-3-8B
(bf16, KV stored in bf16): 6 and 24 chunks of 512 tokens, ratios 0, 0.15 and 1, cpu and
disk tiers, 3 repeats. One model is built and shared by both runs. Writes, under --out:
chunks<N>/ (ttft.json, ttft.md and the plots of `bench ttft --out`), summary.json (both
runs with the device, driver and torch) and summary.md (one table). A machine without
CUDA gets a one-line error and exit code 2.

    python -m eval.bench.gpu [--out out/bench-gpu] [--chunks 6,24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eval.results import write_file

MODEL = "random:llama-3-8b"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/bench-gpu")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--chunks", default="6,24", help="comma-separated chunk counts")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratios", default="0,0.15,1")
    p.add_argument("--tiers", default="cpu,disk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run of this script
    return p.parse_args(argv)


def driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(device: str = "cuda") -> dict[str, Any]:
    import platform

    import torch

    cuda = device.startswith("cuda")
    return {"device_name": torch.cuda.get_device_name(torch.device(device)) if cuda else platform.machine(),
            "driver": driver_version() if cuda else None, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs; returns the combined summary (also written under args.out)."""
    from blend.model.loading import load_model
    from eval.bench.ttft import run_ttft, write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    env = environment(args.device)
    print(f"built {args.model} ({args.dtype}) on {env['device_name']} in {time.perf_counter() - t0:.1f} s", flush=True)
    runs = []
    for chunks in [int(c) for c in args.chunks.split(",") if c]:
        ns = argparse.Namespace(config=args.config, chunks=chunks, chunk_tokens=args.chunk_tokens,
                                ratios=args.ratios, tiers=args.tiers, repeats=args.repeats,
                                redis_url="redis://127.0.0.1:6379/0", cluster_urls=None, model=args.model,
                                dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype)
        t1 = time.perf_counter()
        summary = run_ttft(ns, lm)
        write_report(summary, out / f"chunks{chunks}")
        summary["wall_s"] = round(time.perf_counter() - t1, 1)
        runs.append(summary)
        print(table([summary]), flush=True)
    combined = {"model": args.model, "dtype": args.dtype, "kv_dtype": args.kv_dtype, "random_weights": True,
                **env, "wall_s": round(time.perf_counter() - t0, 1), "runs": runs}
    write_file(out / "summary.json", json.dumps(combined, indent=2) + "\n")
    write_file(out / "summary.md", header(combined) + "\n\n" + table(runs) + "\n")
    return combined


def header(combined: dict[str, Any]) -> str:
    return (f"`make bench-gpu`: {combined['model']} ({combined['dtype']}, random weights: timings only) on "
            f"{combined['device_name']}, driver {combined['driver']}, torch {combined['torch']} (CUDA "
            f"{combined['cuda']}); {combined['wall_s']} s")


def table(runs: list[dict[str, Any]]) -> str:
    """One markdown table over the runs: speedups over full prefill per tier and ratio."""
    lines = ["| context | full prefill | tier | ratio | TTFT (min-max) | speedup | ideal | bound | exposed load | "
             "load GB/s | split | contended |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["results"]:
            if "error" in r:
                lines.append(f"| {run['context_tokens']} | | {r['tier']} | | error: {r['error']} | | | | | | | |")
                continue
            lines.append(
                f"| {run['context_tokens']} | {run['full_ttft_s'] * 1e3:.1f} ms | {r['tier']} | {r['ratio']} | "
                f"{r['ttft_s'] * 1e3:.1f} ms ({r['ttft_min_s'] * 1e3:.1f}-{r['ttft_max_s'] * 1e3:.1f}) | "
                f"{r['speedup']:.2f}x | {r['ideal_speedup']:.2f}x | {r['bound_speedup']:.2f}x | "
                f"{r['exposed_load_s'] * 1e3:.1f} ms | "
                f"{r['load_gbps']} | {r['split_taken']}/{run['repeats']} ({r['split_computed_tokens']} tok) | "
                f"{run['contended']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("kvblend: error: bench-gpu needs a CUDA GPU visible to torch (torch.cuda.is_available() is False); "
              "run `kvblend bench ttft` for the CPU figures", file=sys.stderr)
        return 2
    try:
        run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"kvblend: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
