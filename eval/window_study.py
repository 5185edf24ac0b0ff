"""What a sliding window changes about which reused rows deserve recompute, measured on a
hybrid model (`python -m eval.window_study --config configs/gemma3.yaml --dataset ... --limit N`).

Per example the passages are ingested, then the prompt is prefilled in full (the reference)
and in reuse mode (each document's KV computed after the system part only, placed at its
prompt position). For every reused context row and every layer the relative K and V
deviation ||reuse - full||^2 / ||full||^2 is taken, and rows are bucketed by their offset in
their document: a row at offset >= window - 1 sees only its own document in a sliding layer,
so below the first global layer its KV is exact once every sliding layer under it can only
reach its own document (offset >= k (window - 1) after k sliding layers). The same buckets
count the rows blend's query selection recomputes at each ratio.

The last stdout line is one JSON object: per layer (type, mean deviation per bucket) and per
ratio (selected share per bucket against the bucket's share of the rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

BUCKETS = ((0, 64), (64, 511), (511, 1 << 30))  # offsets in the document; 511 = window - 1 for Gemma 3 270M


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi - 1}"


def main(argv: list[str] | None = None) -> int:
    from blend.engine.engine import BlendEngine
    from eval.loaders import load_examples

    parser = argparse.ArgumentParser(prog="python -m eval.window_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratios", default="0.05,0.15,0.3")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    examples = load_examples(args.dataset, limit=args.limit, passages=args.passages)
    dev_sum: dict[tuple[int, str, str], float] = defaultdict(float)  # (layer, bucket, k|v) -> summed deviation
    dev_n: dict[tuple[int, str], int] = defaultdict(int)
    rows_in: dict[str, int] = defaultdict(int)
    chosen: dict[tuple[float, str], int] = defaultdict(int)
    with BlendEngine.from_config(args.config) as engine:
        runner = engine.runner
        window = engine.lm.dims.window
        for n, ex in enumerate(examples):
            passages = list(ex.passages)
            engine.ingest(passages)
            prompt = engine.build_prompt(ex.question, passages)
            full = engine.prefill(prompt, mode="full").cache
            reuse = engine.prefill(prompt, mode="reuse").cache
            offset = torch.full((len(prompt),), -1)  # each document row's offset in its document
            for seg in prompt.documents:
                offset[seg.start:seg.end] = torch.arange(seg.end - seg.start)
            names = {}
            for lo, hi in BUCKETS:
                rows = ((offset >= lo) & (offset < hi)).nonzero().flatten()
                if seg_first := prompt.documents[0]:  # the first document is exact (computed after the system part)
                    rows = rows[(rows < seg_first.start) | (rows >= seg_first.end)]
                names[bucket_name(lo, hi)] = rows
                rows_in[bucket_name(lo, hi)] += rows.numel()
            for layer in range(runner.num_layers):
                for name, rows in names.items():
                    if not rows.numel():
                        continue
                    for kind, a, b in (("k", full.k[layer], reuse.k[layer]), ("v", full.v[layer], reuse.v[layer])):
                        ref, got = a[:, rows].float(), b[:, rows].float()
                        rel = (got - ref).pow(2).sum(dim=(0, 2)) / ref.pow(2).sum(dim=(0, 2)).clamp_min(1e-12)  # (R,)
                        dev_sum[(layer, name, kind)] += float(rel.sum())
                    dev_n[(layer, name)] += rows.numel()
            for ratio in ratios:
                pre = engine.prefill(prompt, mode="blend", ratio=ratio)
                picked = pre.stats.selection.selected_rows[-1] if pre.stats.selection.selected_rows else torch.zeros(0)
                for name, rows in names.items():
                    chosen[(ratio, name)] += int(torch.isin(rows, picked.long()).sum())
            print(f"example {n + 1}/{len(examples)}: {len(prompt)} tokens", file=sys.stderr)
    layers = []
    for layer in range(runner.num_layers):
        layers.append({"layer": layer, "type": "sliding" if runner.windows[layer] else "full",
                       **{f"{kind}_{name}": round(dev_sum[(layer, name, kind)] / dev_n[(layer, name)], 5)
                          for name in rows_in for kind in ("k", "v") if dev_n[(layer, name)]}})
    total = sum(rows_in.values())
    selection = [{"ratio": r, **{name: {"rows_share": round(rows_in[name] / total, 4),
                                        "selected_share": round(chosen[(r, name)] / max(1, sum(
                                            chosen[(r, m)] for m in rows_in)), 4)}
                                 for name in rows_in}} for r in ratios]
    print(json.dumps({"window": window, "examples": len(examples), "rows": dict(rows_in), "layers": layers,
                      "selection": selection}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
