"""How close do the quantized products come to the dequantized float32 model? (`python -m
eval.quantized_fidelity --config configs/default.yaml --dataset ../shared/data/musique_dev.json
--limit 20`)

Four engines over the same GGUF model, each with its own memory-only store:

- `float32`: dtype float32, `weights: dequantized` (the reference: the GGUF dequantized once);
- `bfloat16`: dtype bfloat16, `weights: dequantized` (the dense path kvblend ran before blocks);
- `quantized`: dtype float32, `weights: quantized` (every product, prefill too, from the blocks,
  the rest as the reference: its first-token KL is the quantized products' own error);
- `auto`: dtype bfloat16, `weights: auto` (what a default deployment runs: decode rows and
  prefill chunks of at most 3 rows from the blocks, longer chunks dense).

Per question and mode (full prefill, blend at `--ratio`): the first-token KL(float32 || path)
and the greedy answer (`--max-new-tokens`); an answer's `kept` is the length of its common prefix
with the float32 answer (all of it: unchanged). The summary gives per path and mode the mean and
largest KL, how many answers changed, and the questions whose answer a path keeps fewer of the
float32 answer's tokens than the bfloat16 path does (the criterion: none). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass

PATHS = {"float32": ("float32", "dequantized"), "bfloat16": ("bfloat16", "dequantized"),
         "quantized": ("float32", "quantized"), "auto": ("bfloat16", "auto")}  # name: (dtype, weights)


@dataclass(frozen=True)
class Answer:
    """One path's answer to one question in one mode, against the float32 path's."""

    kl: float  # first-token KL(float32 || this path)
    tokens: int  # generated tokens
    kept: int  # tokens in common with the float32 answer before the first difference
    changed: bool  # the token ids differ from the float32 answer's


def _kept(ref: list[int], got: list[int]) -> int:
    n = 0
    for a, b in zip(ref, got, strict=False):
        if a != b:
            break
        n += 1
    return n


def summarize(answers: dict[tuple[str, str], list[Answer]], modes: list[str]) -> dict[str, object]:
    """Per path and mode: mean / max KL, answers changed, and the questions (indices) where the
    path's answer keeps fewer float32 tokens than the bfloat16 path's."""
    out: dict[str, object] = {}
    for mode in modes:
        base = answers[("bfloat16", mode)]
        for path in PATHS:
            if path == "float32":
                continue
            got = answers[(path, mode)]
            out[f"{path}/{mode}"] = {
                "kl_mean": statistics.fmean(a.kl for a in got), "kl_max": max(a.kl for a in got),
                "answers_changed": sum(a.changed for a in got),
                "worse_than_bfloat16": [i for i, (a, b) in enumerate(zip(got, base, strict=True)) if a.kept < b.kept],
            }
    return out


def main(argv: list[str] | None = None) -> int:
    from blend.config import load_config
    from blend.engine.engine import BlendEngine
    from blend.model.loading import load_model
    from eval.loaders import load_examples
    from eval.metrics import kl_divergence

    parser = argparse.ArgumentParser(prog="python -m eval.quantized_fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    examples = load_examples(args.dataset, limit=args.limit, passages=args.passages)
    store = dataclasses.replace(config.store, tiers=(config.store.tiers[0],))  # memory only
    engines = {}
    for name, (dtype, weights) in PATHS.items():
        lm = load_model(config.model, device="cpu", dtype=dtype, weights=weights)
        engines[name] = BlendEngine(config.with_overrides(store=store, dtype=dtype, weights=weights), model=lm)
    modes = ["full", f"blend@{args.ratio}"]
    answers: dict[tuple[str, str], list[Answer]] = {(p, m): [] for p in PATHS for m in modes}
    try:
        for engine in engines.values():
            engine.warmup()
        for n, ex in enumerate(examples):
            passages = list(ex.passages)
            for mode in modes:
                options = ({"mode": "full"} if mode == "full" else {"mode": "blend", "recompute_ratio": args.ratio})
                results = {}
                for name, engine in engines.items():
                    if mode != "full":
                        engine.store.clear()
                        engine.ingest(passages)  # each path's entries computed by its own products
                        engine.store.flush()
                    results[name] = engine.generate(ex.question, passages, max_new_tokens=args.max_new_tokens,
                                                    temperature=0.0, **options)
                ref = results["float32"]
                for name, got in results.items():
                    answers[(name, mode)].append(Answer(
                        kl_divergence(ref.first_token_logprobs, got.first_token_logprobs), len(got.token_ids),
                        _kept(ref.token_ids, got.token_ids), got.token_ids != ref.token_ids))
                print(f"{n + 1}/{len(examples)} {mode}: " + "  ".join(
                    f"{p} kl {answers[(p, mode)][-1].kl:.2e} kept {answers[(p, mode)][-1].kept}/"
                    f"{answers[(p, mode)][-1].tokens}" for p in PATHS if p != "float32"), file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    summary = {"model": config.model, "examples": len(examples), "passages": args.passages,
               "max_new_tokens": args.max_new_tokens, **summarize(answers, modes)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
