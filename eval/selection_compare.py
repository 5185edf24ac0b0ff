"""Compare token-selection strategies at equal recompute ratios on one dataset.

Each example is ingested once and computed with full prefill once; then reuse and blend
with every (ratio, selection) pair run on the same engine, so all variants see the same
cached chunks and the same reference. Prints per-example KL to full and the means of KL
and F1. Used for the table in docs/EVAL.md:

    python -m eval.selection_compare --dataset eval/data/synthetic_qa.json --limit 8
"""

from __future__ import annotations

import argparse
import json
import statistics

from blend.config import SELECTIONS
from blend.engine import BlendEngine
from eval.loaders import load_examples
from eval.metrics import kl_divergence, qa_f1
from eval.prompts import load_prompts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--dataset", default="eval/data/synthetic_qa.json")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--passages", type=int, default=6)
    p.add_argument("--ratios", default="0.05,0.15,0.3")
    p.add_argument("--selections", default=",".join(SELECTIONS))
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--chunk-context", default="none", choices=["none", "system"],
                   help="compute chunks standalone (none) or after the fixed system part")
    args = p.parse_args(argv)
    prompts = load_prompts()["qa"]
    store = {"namespace": "selection_compare", "tiers": [{"kind": "cpu", "budget": "2GiB"}]}
    engine = BlendEngine.from_config(args.config, store=store, system_prompt=prompts.system,
                                     query_template=prompts.query, chunk_context=args.chunk_context)
    variants = [("reuse", 0.0, "-")] + [("blend", float(r), s) for r in args.ratios.split(",")
                                        for s in args.selections.split(",")]
    name = {v: v[0] if v[0] == "reuse" else f"blend@{v[1]}:{v[2]}" for v in variants}
    kl: dict[str, list[float]] = {name[v]: [] for v in variants}
    f1: dict[str, list[float]] = {"full": []} | {name[v]: [] for v in variants}
    with engine:
        for ex in load_examples(args.dataset, limit=args.limit, passages=args.passages):
            docs = list(ex.passages)
            engine.ingest(docs)
            full = engine.generate(ex.question, docs, mode="full", max_new_tokens=args.max_new_tokens)
            f1["full"].append(qa_f1(full.text, ex.answers) or 0.0)
            for v in variants:
                mode, ratio, selection = v
                if mode == "blend":
                    engine.config = engine.config.with_overrides(selection=selection)
                res = engine.generate(ex.question, docs, mode=mode, recompute_ratio=ratio,
                                      max_new_tokens=args.max_new_tokens)
                kl[name[v]].append(kl_divergence(full.first_token_logprobs, res.first_token_logprobs))
                f1[name[v]].append(qa_f1(res.text, ex.answers) or 0.0)
            print(ex.id, {k: round(x[-1], 4) for k, x in kl.items()}, flush=True)
    summary = {"mean_kl": {k: round(statistics.mean(x), 4) for k, x in kl.items()},
               "mean_f1": {k: round(statistics.mean(x), 3) for k, x in f1.items()}, "n": len(f1["full"])}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
