"""The evaluation runner: every example answered in every mode and recompute ratio, scored for
quality against the gold answers and for fidelity against full prefill.

Per example: its passages are ingested once (one document each), then the entries run
interleaved in a fixed order, full prefill first (the reference of the fidelity metrics),
so drift of the machine during a long run hits all modes alike. With a `reference` engine
(`kvblend eval --reference-dtype`: the same model in another compute dtype) that engine's
full prefill is the reference instead, and every entry, full included, is compared to it:
what a compute dtype costs in fidelity, for full prefill and blend alike. Entries are named after
their mode, blend entries after their ratio too: full, reuse, prefix, blend@0.15.

Per example and entry (a row):
    f1, em        QA token F1 / exact match (LongBench normalisation); None for summarization
    rouge_l       Rouge-L for summarization; None for QA
    kl_to_full    KL(full || entry) of the first generated token's distribution (nats)
    answer_kl     KL(full || entry) at every token of full prefill's greedy answer, the entry
                  teacher-forced along that answer, averaged over its tokens (nats): how far
                  the whole answer's distributions move, not only the first token's
    top1_agree    both distributions rank the same first token highest
    greedy_match  the greedy answer text equals full prefill's
    answer_nll    mean NLL of the first gold answer, teacher-forced after the prompt
    ttft_s        time to first token; recomputed_fraction: share of the context computed
Quality metrics and answer_nll are None for an example without gold answers. Every request
of a run brings its task's template and asks for no load-or-compute split (`split="off"`, per
request: the engine itself is not changed), so every mode computes what it says.
The summary is the mean of every metric per entry (None values ignored).
The summary also gives the largest KL to full and, for blend entries, how many examples
ended worse than reuse (larger KL).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval import metrics
from eval.bench.common import LoadWatch
from eval.entries import Entry, entry_name, parse_modes, parse_ratios, parse_selections, plan_entries
from eval.loaders import Example
from eval.prompts import PromptTemplate, load_prompts
from eval.results import METRICS, ResultsLog, jsonable

log = logging.getLogger(__name__)
__all__ = ["Entry", "entry_name", "parse_modes", "parse_ratios", "parse_selections", "plan_entries", "run_eval"]

# A template without {question} (summarization) still needs a non-empty question for the
# prompt builder; it only shows where the template uses {question} and an example has none.
NO_QUESTION = "Summarize the documents."


@dataclass
class EvalRun:
    """What `run_eval` returns: per-example records (in dataset order) and the summary."""

    dataset: str
    entries: tuple[Entry, ...]
    settings: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, dict[str, Any]]
    skipped: list[str] = field(default_factory=list)
    results_path: Path | None = None
    hygiene: dict[str, Any] = field(default_factory=dict)  # load average at start/end, cores, contended

    def to_json(self) -> dict[str, Any]:
        """The object printed as the last line of `kvblend eval --json`."""
        return jsonable({"dataset": self.dataset, "n": len(self.records), "summary": self.summary,
                         "skipped": len(self.skipped), **self.hygiene,
                         "results": str(self.results_path) if self.results_path else None})


def run_eval(
    engine: Any,
    examples: Sequence[Example],
    *,
    entries: Sequence[Entry],
    dataset: str,
    max_new_tokens: int | None = None,
    prompts: Mapping[str, PromptTemplate] | None = None,
    out_dir: str | Path | None = None,
    run_settings: Mapping[str, Any] | None = None,
    progress: bool = True,
    reference: Any = None,
) -> EvalRun:
    """Evaluate `examples` in every entry with `engine` (a BlendEngine).

    prompts: templates per task (default: blend.prompt.TEMPLATES); each example is prompted
        with its task's template. The engine's own prompt builder is restored afterwards.
    out_dir: append each finished example to out_dir/results.jsonl and skip the examples
        already there (the file must have been written with the same settings).
    run_settings: extra settings that identify the run (dataset split, passages, ...); they
        join the engine and prompt settings in the results header.
    reference: another BlendEngine (the same model in another compute dtype) whose full
        prefill is the fidelity reference of every entry, full included; its dtype joins
        the settings. None: the first entry, full prefill in `engine`, is the reference.

    Side effects: ingests the passages into the engine's store; writes results.jsonl.
    Progress goes to stderr.
    """
    entries = tuple(entries)
    if not entries or entries[0].mode != "full":
        raise ValueError("entries must start with full prefill (the fidelity reference); build them with plan_entries")
    if not examples:
        raise ValueError("no examples to evaluate; check --dataset, --split and --limit")
    max_new = int(max_new_tokens if max_new_tokens is not None else engine.config.engine.generation.max_new_tokens)
    if max_new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new}")
    templates = dict(prompts) if prompts is not None else load_prompts()
    examples = _unique_ids(examples)
    tasks = sorted({ex.task for ex in examples})
    missing = [t for t in tasks if t not in templates]
    if missing:
        raise ValueError(f"no prompt template for task(s) {', '.join(missing)}; the prompts file has {', '.join(templates)}")
    settings = {
        "dataset": dataset, **dict(run_settings or {}), "entries": [e.name for e in entries],
        "max_new_tokens": max_new, **engine_settings(engine),
        "prompts": {t: {"system": templates[t].system, "query": templates[t].query} for t in tasks},
    }
    if reference is not None:
        if reference.fingerprint == engine.fingerprint:
            raise ValueError("the reference engine computes exactly as the evaluated one (same model and dtype); "
                             "leave the reference out")
        settings["reference"] = {"model": reference.fingerprint,
                                 "dtype": str(reference.lm.dtype).removeprefix("torch.")}
    results = ResultsLog.open(out_dir, settings) if out_dir is not None else None
    done = results.done if results is not None else {}
    changed = [ex.id for ex in examples if ex.id in done and done[ex.id].get("digest", ex.digest) != ex.digest]
    if changed:
        assert results is not None
        results.close()
        raise ValueError(f"{results.path}: {len(changed)} example(s) changed since their results were written (e.g. "
                         f"{changed[0]!r}: other question, answers or passages); use another --out, or delete the "
                         "file to start over")
    todo = [ex for ex in examples if ex.id not in done]
    if results is not None and len(todo) < len(examples):
        log.warning("%s: %d of %d example(s) already done; evaluating the other %d",
                    results.path, len(examples) - len(todo), len(examples), len(todo))
    skipped: list[str] = []
    watch = LoadWatch.begin()
    try:
        if todo:
            for warm in (engine, reference):
                if warm is not None:
                    _warm_up(warm, todo[0], templates[todo[0].task])
        for ex in _progress(todo, progress and bool(todo)):
            record = evaluate_example(engine, ex, entries, max_new_tokens=max_new, reference=reference,
                                      template=templates[ex.task])
            if record is None:
                skipped.append(ex.id)
                continue
            if results is not None:
                results.append(record)  # also adds it to `done`
            else:
                done[ex.id] = jsonable(record)
    finally:
        if results is not None:
            results.close()
    records = [done[ex.id] for ex in examples if ex.id in done]
    repeated = sum(bool(r["entries"].get(e.name, {}).get("repeated_prompt")) for r in records for e in entries
                   if e.mode == "prefix")
    if repeated:
        log.warning("prefix mode reused prefix blocks of the very same prompt, stored by an earlier run, in %d "
                    "example(s): its TTFT there is that of a repeated prompt, not of a first-seen one. For a "
                    "first-seen baseline use a fresh store.namespace in the config", repeated)
    return EvalRun(dataset, entries, settings, records, summarize(records, entries), skipped,
                   results.path if results is not None else None, watch.finish("evaluation"))


def engine_settings(engine: Any) -> dict[str, Any]:
    """The engine facts that change results: model, dtypes, device, selection settings."""
    cfg = engine.config
    return {
        "model": engine.fingerprint, "model_source": getattr(engine.lm, "source", None),
        "dtype": str(engine.lm.dtype).removeprefix("torch."), "device": str(engine.runner.device),
        "kv_dtype": engine.kv_dtype,
        "engine": {k: getattr(cfg.engine.blend, k) for k in ("chunk_tokens", "chunk_context", "max_document_tokens")}
        | {"selection": dataclasses.asdict(cfg.engine.blend.selection)},
    }


def evaluate_example(engine: Any, ex: Example, entries: Sequence[Entry], *, max_new_tokens: int,
                     reference: Any = None, template: PromptTemplate | None = None) -> dict[str, Any] | None:
    """Run one example in every entry (entries[0] must be full); its record, or None when
    the prompt does not fit the model (skipped with a warning). `reference`: an engine whose
    full prefill (greedy, with its step log-probs) every entry is compared to; default: the
    first entry's. `template`: the prompt of every request (None: the engine's configured
    one); every request of `engine` asks for no load-or-compute split (`split="off"`), so
    each mode computes what it says.

    Side effects: ingests the passages (after the template's fixed part).
    """
    passages = list(ex.passages)
    question = ex.question or NO_QUESTION
    gold = ex.answers[0] if ex.answers else None
    prompt = engine.build_prompt(question, passages, template=template)
    prompt_tokens = len(prompt)
    answer_tokens = len(engine.lm.tokenizer(gold, add_special_tokens=False).input_ids) if gold else 0
    needed = prompt_tokens + max(max_new_tokens, answer_tokens)
    if needed > engine.runner.max_positions:
        log.warning("example %s: prompt of %d tokens plus %d new ones exceeds the model's %d positions; skipped "
                    "(keep fewer passages with --passages, or a smaller --max-new-tokens)", ex.id, prompt_tokens,
                    needed - prompt_tokens, engine.runner.max_positions)
        return None
    t0 = time.perf_counter()
    engine.ingest(passages, template=template)
    ingest_s = time.perf_counter() - t0
    rows: dict[str, dict[str, Any]] = {}
    if reference is not None:  # full prefill in the reference engine
        reference = reference.generate(question, passages, mode="full", max_new_tokens=max_new_tokens,
                                       temperature=0.0, logprobs=True, template=template)
    for entry in entries:
        first = reference is None  # full prefill: the reference of every later entry
        result = engine.generate(question, passages, mode=entry.mode, recompute_ratio=entry.ratio,
                                 max_new_tokens=max_new_tokens, temperature=0.0, answer=gold,
                                 selection=entry.selection, logprobs=first,
                                 follow=None if first else reference.token_ids, template=template, split="off")
        if reference is None:
            reference = result
        # the metrics' torch work on the engine's thread (see BlendEngine.run_exclusive): a pool of
        # this thread's own would slow every later request's TTFT
        rows[entry.name] = engine.run_exclusive(lambda e=entry, r=result, f=reference: _row(ex, e, r, f))
        if entry.mode == "prefix":
            rows[entry.name]["repeated_prompt"] = _prefix_hit_beyond_first_seen(engine, prompt, result.stats)
    return {"id": ex.id, "digest": ex.digest, "task": ex.task, "question": ex.question, "answers": list(ex.answers),
            "passages": len(passages), "prompt_tokens": prompt_tokens, "ingest_s": ingest_s, "entries": rows}


def _prefix_hit_beyond_first_seen(engine: Any, prompt: Any, stats: Any) -> bool:
    """Whether prefix caching loaded more than it can for a prompt seen for the first time
    (the system part, plus the first chunk when chunks are computed after it): prefix
    blocks of this very prompt were stored by an earlier run into a persistent tier."""
    exact = prompt.prefix.end
    if engine.config.engine.blend.chunk_context == "system" and len(prompt.segments) > 2:
        exact = prompt.segments[1].end
    return stats.loaded_tokens > exact


def _row(ex: Example, entry: Entry, result: Any, reference: Any) -> dict[str, Any]:
    stats = result.stats  # blend.stats.RequestStats
    text = result.text
    qa = ex.task == "qa"
    context = stats.context_tokens
    docs = stats.documents
    nll = stats.answer_nll
    return {
        "mode": entry.mode, "ratio": entry.ratio, "selection": entry.selection, "text": text,
        "f1": metrics.qa_f1(text, ex.answers) if qa else None,
        "em": metrics.exact_match(text, ex.answers) if qa else None,
        "rouge_l": None if qa else metrics.rouge_l(text, ex.answers),
        "kl_to_full": metrics.kl_divergence(reference.first_token_logprobs, result.first_token_logprobs),
        "answer_kl": _answer_kl(reference, result),
        "top1_agree": float(metrics.top1_agree(reference.first_token_logprobs, result.first_token_logprobs)),
        "greedy_match": float(text == reference.text),
        "answer_nll": nll if nll is not None and math.isfinite(nll) else None,
        "ttft_s": result.ttft_s,
        "recomputed_fraction": stats.recomputed_tokens / context if context else 0.0,
        "context_tokens": context, "query_tokens": stats.query_tokens, "recomputed_tokens": stats.recomputed_tokens,
        "chunk_hits": docs.hits, "chunk_misses": docs.misses, "chunk_hit_rate": docs.hit_rate,
        "hits_by_tier": dict(stats.hits_by_tier), "load_s": stats.load_s,
        "exposed_load_s": stats.exposed_load_s, "new_tokens": stats.new_tokens,
        "selection_s": stats.selection.selection_s,
    }


def _answer_kl(reference: Any, result: Any) -> float | None:
    """Mean KL(full || entry) along full prefill's answer (0 for full itself)."""
    if result is reference:
        return 0.0
    full, entry = reference.token_logprobs, result.follow_logprobs
    if full is None or entry is None or full.shape[0] == 0:
        return None
    return metrics.mean_kl(full, entry)


def summarize(records: Sequence[Mapping[str, Any]], entries: Sequence[Entry]) -> dict[str, dict[str, Any]]:
    """Per entry: the mean of each metric over the records (None ignored), plus n, mode,
    ratio, the median TTFT, the chunk hit rate, and `speedup`: the median over examples of
    full's TTFT / this entry's TTFT (paired per example, so load drift cancels)."""
    summary: dict[str, dict[str, Any]] = {}
    for entry in entries:
        rows = [r["entries"][entry.name] for r in records if entry.name in r.get("entries", {})]
        means = metrics.aggregate({k: row.get(k) for k in METRICS} for row in rows)
        ttfts = [row["ttft_s"] for row in rows if row.get("ttft_s") is not None]
        summary[entry.name] = {
            **{k: means.get(k) for k in METRICS},
            "n": len(rows), "mode": entry.mode, "ratio": entry.ratio,
            "ttft_s_median": statistics.median(ttfts) if ttfts else None,
            "ttft_s_min": min(ttfts) if ttfts else None, "ttft_s_max": max(ttfts) if ttfts else None,
            "chunk_hit_rate": metrics.mean(row.get("chunk_hit_rate") for row in rows),
            "exposed_load_s": metrics.mean(row.get("exposed_load_s") for row in rows),
            "selection_s": metrics.mean(row.get("selection_s") for row in rows),
            "speedup": _median_speedup(records, entry.name),
            "kl_max": max((row["kl_to_full"] for row in rows if row.get("kl_to_full") is not None), default=None),
            "worse_than_reuse": _worse_than_reuse(records, entry.name) if entry.mode == "blend" else None,
        }
    return summary


def _worse_than_reuse(records: Sequence[Mapping[str, Any]], name: str) -> int | None:
    """Examples whose KL to full in entry `name` exceeds reuse's (None without a reuse entry)."""
    pairs = [(r["entries"].get("reuse", {}).get("kl_to_full"), r["entries"].get(name, {}).get("kl_to_full"))
             for r in records]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(b > a for a, b in pairs) if pairs else None


def _median_speedup(records: Sequence[Mapping[str, Any]], name: str) -> float | None:
    ratios = []
    for record in records:
        rows = record.get("entries", {})
        full, row = rows.get("full", {}).get("ttft_s"), rows.get(name, {}).get("ttft_s")
        if full and row:
            ratios.append(full / row)
    return statistics.median(ratios) if ratios else None


WARMUP_CHARS = 400  # of the first example's question and first passage, for the untimed warm-up


def _unique_ids(examples: Sequence[Example]) -> list[Example]:
    """Examples with distinct ids (the resume key): a repeated id gets a #2, #3 suffix,
    skipping any name another example already has (`a`, `a`, `a#2` -> `a`, `a#3`, `a#2`)."""
    from dataclasses import replace

    taken = {ex.id for ex in examples}
    seen: dict[str, int] = {}
    out, repeated = [], set()
    for ex in examples:
        count = seen.get(ex.id, 0) + 1
        if count == 1:
            seen[ex.id] = 1
            out.append(ex)
            continue
        repeated.add(ex.id)
        while f"{ex.id}#{count}" in taken:
            count += 1
        seen[ex.id] = count
        taken.add(f"{ex.id}#{count}")
        out.append(replace(ex, id=f"{ex.id}#{count}"))
    if repeated:
        log.warning("%d example id(s) repeat in the dataset; repeats are named <id>#2, <id>#3, ... (a name "
                    "already in use is skipped)", len(repeated))
    return out


def _warm_up(engine: Any, ex: Example, template: PromptTemplate) -> None:
    """One short untimed request (the start of the first passage, one token) so that lazy
    initialisation does not land in the first example's TTFT. Short, so that an example too
    long for the model is skipped by `evaluate_example` like any other, not failed here."""
    engine.generate((ex.question or NO_QUESTION)[:WARMUP_CHARS], [p[:WARMUP_CHARS] for p in ex.passages[:1]],
                    mode="full", max_new_tokens=1, temperature=0.0, template=template)


def _progress(items: Sequence[Example], enabled: bool) -> Iterable[Example]:
    """A tqdm bar on stderr (examples/s, ETA). `disable` is passed explicitly: tqdm reads
    TQDM_DISABLE=0 as true; here only a true-looking value (1, true, yes) turns it off."""
    if not enabled or os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes"):
        return items
    from tqdm import tqdm

    return tqdm(items, desc="eval", unit="example", file=sys.stderr, dynamic_ncols=True, disable=False)
