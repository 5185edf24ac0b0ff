"""`kvblend demo` (`make demo`): the main job on the embedded default — the shipped
SmolLM2 model, the CPU + disk tiers of the config, and the shipped sample documents.

Ingests the documents (computed once, stored; a rerun hits the disk tier), then answers
one question with a full prefill and with CacheBlend and prints both answers, their
time-to-first-token and the speedup, the first-token KL and the mean KL along full
prefill's answer (blend teacher-forced on it, after the TTFT is taken). Where the answers
part, both modes' top tokens at that step show how close a call it was.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from blend.cli.common import RATIO, config_arg, emit_json, json_arg, open_engine

TOP = 3  # candidates shown per mode where the answers part


@dataclass(frozen=True)
class Parting:
    """The step where blend's greedy answer leaves full prefill's: `index` (0-based), and each
    mode's most likely tokens there, (text, probability) best first; blend's are teacher-forced
    on full prefill's answer up to that step, so both see the same tokens before it."""

    index: int
    full_top: tuple[tuple[str, float], ...]
    blend_top: tuple[tuple[str, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "full_top": [list(t) for t in self.full_top],
                "blend_top": [list(t) for t in self.blend_top]}

    def line(self) -> str:
        def show(top: tuple[tuple[str, float], ...]) -> str:
            return ", ".join(f"{text!r} {p:.2f}" for text, p in top)
        return (f"where they part (token {self.index + 1}): full prefill {show(self.full_top)}; "
                f"blend on the same first {self.index} tokens {show(self.blend_top)}")


def top_tokens(logprobs: Any, tokenizer: Any, k: int = TOP) -> tuple[tuple[str, float], ...]:
    """The k most likely tokens of one (vocab,) log-prob row, as (text, probability)."""
    values, ids = logprobs.exp().topk(k)
    return tuple((tokenizer.decode([int(i)]), round(float(v), 4)) for v, i in zip(values, ids, strict=True))


def run_demo(config: str | None, *, question: str | None = None, ratio: float | None = None,
             json_out: bool = False) -> int:
    """Run the demo on the config at `config` (None: the default); with `json_out` the human
    lines go to stderr and the summary is the one stdout line."""
    from blend.config import load_config

    if question is not None and not question.strip():
        raise ValueError("--question is empty; ask something, or leave --question out for the sample question")
    settings = load_config(config)  # a bad config fails before torch and the model load
    from eval.metrics import kl_divergence, matching_prefix, mean_kl
    from eval.samples import sample_documents, sample_questions

    say = (lambda text: print(text, file=sys.stderr)) if json_out else print
    t0 = time.perf_counter()
    engine = open_engine(config, settings)
    load_s = time.perf_counter() - t0
    docs = sample_documents()
    qa = sample_questions()[0]
    question = question or qa["question"]
    texts = [text for _, text in docs]
    with engine:
        t0 = time.perf_counter()
        keys = engine.ingest(texts)
        ingest_s = time.perf_counter() - t0
        engine.generate(question, texts[:1], mode="full", max_new_tokens=1)  # warm-up
        full = engine.generate(question, texts, mode="full", logprobs=True)
        # follow: teacher-forced along full prefill's answer after the TTFT is taken; blend.text is
        # still blend's own greedy answer
        blend = engine.generate(question, texts, mode="blend", recompute_ratio=ratio, follow=full.token_ids)
        tokenizer = engine.lm.tokenizer
    speedup = full.ttft_s / blend.ttft_s
    kl = kl_divergence(full.first_token_logprobs, blend.first_token_logprobs)
    answer_kl = mean_kl(full.token_logprobs, blend.follow_logprobs)  # (T, vocab) each
    shared = matching_prefix(full.token_ids, blend.token_ids)
    agree = full.token_ids == blend.token_ids
    parting = None if agree or shared >= len(full.token_ids) else Parting(
        shared, top_tokens(full.token_logprobs[shared], tokenizer), top_tokens(blend.follow_logprobs[shared], tokenizer))
    summary = {
        "question": question, "gold": qa["answers"] if question == qa["question"] else None,
        "documents": len(docs), "context_tokens": full.stats.context_tokens, "chunks": len(keys),
        "full": {"text": full.text, "ttft_s": round(full.ttft_s, 4)},
        "blend": {"text": blend.text, "ttft_s": round(blend.ttft_s, 4), "recompute_ratio": blend.stats.recompute_ratio,
                  "recomputed_tokens": blend.stats.recomputed_tokens, "hits_by_tier": dict(blend.stats.hits_by_tier),
                  "exposed_load_s": round(blend.stats.exposed_load_s, 4)},
        "answers_agree": agree, "shared_answer_tokens": shared,
        "parting": parting.to_dict() if parting else None,
        "speedup": round(speedup, 2), "first_token_kl_to_full": round(kl, 5),
        "answer_kl_to_full": round(answer_kl, 5), "model_load_s": round(load_s, 2), "ingest_s": round(ingest_s, 2),
    }
    say(f"model loaded in {load_s:.1f} s; {len(docs)} sample documents, "
          f"{full.stats.context_tokens} context tokens (ingest {ingest_s:.1f} s; a rerun hits the cache)")
    say(f"question: {question}")
    if summary["gold"]:
        say(f"gold answer: {' / '.join(summary['gold'])}")
    say(f"full prefill : {full.text!r}  TTFT {full.ttft_s * 1000:.0f} ms")
    say(f"blend r={blend.stats.recompute_ratio:.2f}: {blend.text!r}  TTFT {blend.ttft_s * 1000:.0f} ms "
          f"(recomputed {blend.stats.recomputed_tokens} tokens, document KV from {dict(blend.stats.hits_by_tier)})")
    say(f"speedup: {speedup:.2f}x; KL(full || blend): first token {kl:.4f}, mean along full prefill's answer "
        f"{answer_kl:.4f}")
    say("the answers agree" if agree else
        f"the answers differ from generated token {shared + 1} on (the first {shared} agree)")
    if parting:
        say(parting.line())
    if json_out:
        emit_json(summary)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args.config, question=args.question, ratio=args.ratio, json_out=args.json)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="ingest the sample documents and compare full prefill with blend")
    config_arg(p)
    p.add_argument("--question", default=None, help="default: the first sample question")
    p.add_argument("--ratio", type=RATIO, default=None, help="recompute ratio for blend, in [0, 1] (default: config)")
    json_arg(p)
    p.set_defaults(func=cmd_demo)
