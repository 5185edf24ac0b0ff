"""What handing kvblend's KV to transformers costs, with and without blend's stale-key bias
(`python -m eval.handoff_study --dataset ../shared/data/musique_dev.json --limit 20`).

Per example the passages are ingested and the prompt is prefilled in full (the reference) and,
per ratio, blended; for each blend, `BlendEngine.prepare` hands the KV of the first T-1
positions to the engine's transformers model twice, with the bias carried (`KVBlendCache`)
and without it (`carry_bias=False`), and the model computes the last position itself. The
first-token distributions are compared with KL(p || q) (natural log) and top-1 agreement:
  handoff_kl          kvblend's own blend -> transformers over the same KV (the hand-off)
  blend_kl            full prefill -> kvblend's blend (what blending costs to begin with)
  handoff_full_kl     full prefill -> transformers over the handed-over KV
The last stdout line is one JSON object: per ratio and per carried / not carried, the mean,
median and max of each, and the top-1 agreements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": float(f"{statistics.fmean(values):.3g}"), "median": float(f"{statistics.median(values):.3g}"),
            "max": float(f"{max(values):.3g}")}


def main(argv: list[str] | None = None) -> int:
    from blend.engine.engine import BlendEngine
    from eval.loaders import load_examples
    from eval.metrics import kl_divergence, top1_agree

    parser = argparse.ArgumentParser(prog="python -m eval.handoff_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="engine config (default: the packaged one)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratios", default="0.05,0.15")
    parser.add_argument("--dtype", default="float32", help="compute dtype (default float32; auto: the config's rule)")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    examples = load_examples(args.dataset, limit=args.limit, passages=args.passages)
    rows: dict[tuple[float, bool], dict[str, list[float]]] = {
        (r, c): {"handoff_kl": [], "blend_kl": [], "handoff_full_kl": [], "handoff_top1": [], "blend_top1": []}
        for r in ratios for c in (True, False)}
    with BlendEngine.from_config(args.config, dtype=args.dtype) as engine:
        model = engine.transformers_model()

        def first_token(prepared) -> torch.Tensor:  # (vocab,) log-probs of transformers' last position
            def run() -> torch.Tensor:
                with torch.no_grad():
                    out = model(prepared.input_ids[:, -1:], cache=prepared.past_key_values)
                return torch.log_softmax(out.logits[0, -1].float(), -1).cpu()

            return engine.run_exclusive(run, "handoff study")

        for n, ex in enumerate(examples):
            passages = list(ex.passages)
            engine.ingest(passages)
            full = torch.log_softmax(engine.prepare(ex.question, passages, mode="full").logits.float(), -1).cpu()
            for ratio in ratios:
                for carry in (True, False):
                    prepared = engine.prepare(ex.question, passages, mode="blend", recompute_ratio=ratio,
                                              carry_bias=carry)
                    own = torch.log_softmax(prepared.logits.float(), -1).cpu()
                    got = first_token(prepared)
                    row = rows[(ratio, carry)]
                    row["handoff_kl"].append(kl_divergence(own, got))
                    row["blend_kl"].append(kl_divergence(full, own))
                    row["handoff_full_kl"].append(kl_divergence(full, got))
                    row["handoff_top1"].append(float(top1_agree(own, got)))
                    row["blend_top1"].append(float(top1_agree(full, own)))
            print(f"example {n + 1}/{len(examples)}", file=sys.stderr)
        dtype = str(engine.runner.dtype).removeprefix("torch.")
    results = [{"ratio": r, "bias_carried": c,
                **{k: _summary(v) for k, v in row.items() if k.endswith("_kl")},
                **{k: round(statistics.fmean(v), 4) for k, v in row.items() if k.endswith("_top1")}}
               for (r, c), row in rows.items()]
    print(json.dumps({"dataset": args.dataset, "examples": len(examples), "passages": args.passages,
                      "dtype": dtype, "model": engine.config.model, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
