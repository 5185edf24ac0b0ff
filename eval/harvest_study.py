"""Do harvested document entries blend as well as standalone ones? (`python -m eval.harvest_study
--config configs/default.yaml --dataset ../shared/data/musique_dev.json --limit 20`)

A document that misses can be stored two ways (blend.planning.misses): computed on its own after
the system part (`standalone`, what ingest stores), or cut out of a full prefill of the request
that missed it (`harvest`): its K/V then carry the documents that came before it in *that*
request. Per example, the passages' first-token KL to full prefill is measured for blend at each
ratio, once over standalone entries and once over entries harvested from a request with the same
passages in reverse order (every passage computed after other documents than it will be blended
with; the first one after all of the others). Each run starts from an empty store.

The last stdout line is one JSON object: per ratio the mean KL of each and of their difference,
with a bootstrap 95% interval, and the examples where harvested entries were worse.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys


def bootstrap(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean by resampling (seeded)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def main(argv: list[str] | None = None) -> int:
    from blend.config import load_config
    from blend.engine.engine import BlendEngine
    from blend.model.loading import load_model
    from eval.loaders import load_examples
    from eval.metrics import kl_divergence

    parser = argparse.ArgumentParser(prog="python -m eval.harvest_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratios", default="0.05,0.15")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    config = load_config(args.config)
    examples = load_examples(args.dataset, limit=args.limit, passages=args.passages)
    lm = load_model(config.model, device=config.device, dtype=config.dtype)
    store = dataclasses.replace(config.store, tiers=(config.store.tiers[0],))  # memory only: no scratch on disk
    # (harvested entries kept as they are: the engine would otherwise recompute them on their own when idle)
    engines = {policy: BlendEngine(config.with_overrides(store=store, miss_policy=policy, recompute_harvested=False),
                                   model=lm)
               for policy in ("standalone", "harvest")}
    kl: dict[tuple[str, float], list[float]] = {(p, r): [] for p in engines for r in ratios}
    try:
        for engine in engines.values():
            engine.warmup()
        for n, ex in enumerate(examples):
            passages = list(ex.passages)
            full = engines["standalone"].generate(ex.question, passages, mode="full", max_new_tokens=1)
            for policy, engine in engines.items():
                engine.store.clear()
                if policy == "standalone":
                    engine.ingest(passages)
                else:  # harvested from a request with the passages in reverse order
                    cold = engine.generate(ex.question, passages[::-1], mode="blend", max_new_tokens=1)
                    assert cold.stats.miss.plan == "harvest", cold.stats.miss
                engine.store.flush()
                for r in ratios:
                    got = engine.generate(ex.question, passages, mode="blend", recompute_ratio=r, max_new_tokens=1)
                    assert got.stats.documents.misses == 0
                    kl[(policy, r)].append(kl_divergence(full.first_token_logprobs, got.first_token_logprobs))
            print(f"{n + 1}/{len(examples)} " + "  ".join(
                f"@{r}: standalone {kl[('standalone', r)][-1]:.4f} harvest {kl[('harvest', r)][-1]:.4f}"
                for r in ratios), file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    summary: dict[str, object] = {"examples": len(examples), "passages": args.passages, "dtype": str(lm.dtype)}
    for r in ratios:
        a, b = kl[("standalone", r)], kl[("harvest", r)]
        diff = [y - x for x, y in zip(a, b, strict=True)]
        low, high = bootstrap(diff)
        summary[str(r)] = {"standalone_kl": statistics.fmean(a), "harvest_kl": statistics.fmean(b),
                           "difference": statistics.fmean(diff), "difference_95": [low, high],
                           "harvest_worse_on": sum(d > 0 for d in diff), "max_difference": max(diff)}
        print(f"blend@{r}: standalone {statistics.fmean(a):.4f}  harvested {statistics.fmean(b):.4f}  "
              f"difference {statistics.fmean(diff):+.4f} (95% {low:+.4f}..{high:+.4f}), harvested worse on "
              f"{sum(d > 0 for d in diff)}/{len(diff)}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
