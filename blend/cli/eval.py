"""`kvblend eval`: answer quality and fidelity to full prefill over an evaluation set, for
each mode, recompute ratio and token selection.

    kvblend eval --config configs/default.yaml --dataset eval/data/synthetic_qa.json \
        --limit 8 --passages 6 --modes full,reuse,prefix,blend --ratios 0.05,0.15,0.3 --json --out out/eval

Argument errors (unknown mode, ratio outside [0, 1], --limit 0, a bad --field-map) are
reported before the model is loaded. With --out the run is resumable (results.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
from typing import Any

from blend.cli.common import (
    EVAL_EXTRA,
    arg_type,
    config_arg,
    emit_json,
    human,
    json_arg,
    open_engine,
    positive_int,
    require_eval_extra,
)
from blend.cli.common import check_out_dir as check_out_dir_of
from blend.modes import MODES
from storage.dtypes import DTYPE_NAMES

log = logging.getLogger(__name__)


def parse_field_map(text: str) -> dict[str, str]:
    """"question=query,answers=gold" -> {"question": "query", "answers": "gold"} (our field = source field)."""
    mapping = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        ours, sep, theirs = item.partition("=")
        if not sep or not ours.strip() or not theirs.strip():
            raise ValueError(f"--field-map item {item!r} is not ours=theirs; e.g. question=query,answers=gold")
        mapping[ours.strip()] = theirs.strip()
    if not mapping:
        raise ValueError("--field-map is empty; e.g. question=query,answers=gold")
    return mapping


def _lazy(name: str) -> Any:
    """An argparse type calling eval.entries.<name>, imported when an argument is parsed (not
    when the parser is built)."""

    def parse(text: str) -> Any:
        from eval import entries

        return getattr(entries, name)(text)

    parse.__name__ = name
    return arg_type(parse)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to the `kvblend` subparsers."""
    p = subparsers.add_parser(
        "eval", help="quality and fidelity to full prefill per mode and recompute ratio over a dataset",
        description="Evaluate every example in every mode (full prefill first, as the reference) and print the "
                    "mean metrics per mode; blend runs once per recompute ratio.")
    config_arg(p)
    p.add_argument("--dataset", required=True, metavar="PATH_OR_NAME",
                   help="a local JSON/JSONL/Parquet/CSV file or a Hugging Face dataset name")
    p.add_argument("--split", default=None, help="dataset split (of a hub dataset or a JSON {split: [...]})")
    p.add_argument("--limit", type=arg_type(positive_int), default=None, help="first N usable examples")
    p.add_argument("--passages", type=arg_type(positive_int), default=None, metavar="K",
                   help="keep the first K passages of each example (each is one document)")
    p.add_argument("--field-map", type=arg_type(parse_field_map), default=None, metavar="OURS=THEIRS,...",
                   help="rename source fields, e.g. question=query,answers=gold")
    p.add_argument("--prompts", default=None, metavar="FILE", help="YAML file replacing the built-in prompt templates per task (qa, summarization)")
    p.add_argument("--modes", type=_lazy("parse_modes"), default=MODES, metavar="M,...",
                   help=f"modes to compare, from {','.join(MODES)} (full always runs: it is the reference)")
    p.add_argument("--ratios", type=_lazy("parse_ratios"), default=None, metavar="R,...",
                   help="recompute ratios for blend, each in [0, 1] (default: the config's recompute_ratio)")
    p.add_argument("--selections", type=_lazy("parse_selections"), default=None, metavar="S,...",
                   help="token selections to compare for blend (query, deviation, hybrid, attention; "
                        "default: the config's selection)")
    p.add_argument("--max-new-tokens", type=arg_type(positive_int), default=None, metavar="T",
                   help="greedy answer length (default: the config's max_new_tokens)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write results.jsonl (resumable), summary.json, summary.md and PNG plots here")
    p.add_argument("--reference-dtype", default=None, choices=DTYPE_NAMES, metavar="DTYPE",
                   help="compare every entry, full prefill included, to full prefill in this compute dtype (a second "
                        "copy of the model; float32, bfloat16, float16): what the config's dtype costs in fidelity")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    json_arg(p, "print the summary as one JSON object on the last line (tables go to stderr)")
    p.set_defaults(func=cmd_eval)
    return p


def check_out_dir(text: str | None) -> None:
    """--out of eval (blend.cli.common.check_out_dir, with the files eval writes there)."""
    from eval.results import FILENAME, REPORT_FILES

    check_out_dir_of(text, (FILENAME, *REPORT_FILES))


def cmd_eval(args: argparse.Namespace) -> int:
    check_out_dir(args.out)
    from blend.config import load_config
    from eval.entries import plan_entries
    from eval.loaders import load_examples
    from eval.prompts import load_prompts
    from eval.report import summary_table, write_reports
    from eval.runner import run_eval

    require_eval_extra(*EVAL_EXTRA)
    config = load_config(args.config)  # validates the file before anything is loaded
    entries = plan_entries(args.modes, args.ratios or (config.engine.blend.recompute_ratio,), args.selections)
    prompts = load_prompts(args.prompts)
    examples = load_examples(args.dataset, split=args.split, limit=args.limit, passages=args.passages,
                             field_map=args.field_map)
    if not examples:
        raise ValueError(f"{args.dataset}: no usable examples (each lacked passage text or, for qa, a question); check the file, --split and --field-map")
    first = prompts[examples[0].task]  # the engine's own templates: those of the first example's task
    # an evaluation reproduces whatever else runs: batch-invariant steps, whatever the config says
    config = config.with_overrides(system_prompt=first.render_system(), query_template=first.query,
                                   batch_invariant=True)
    reference = None
    if args.reference_dtype is not None:
        from blend.model.loading import resolve_device, resolve_dtype
        from storage.config import CpuTierConfig

        if resolve_dtype(args.reference_dtype) == resolve_dtype(config.dtype, resolve_device(config.device)):
            raise ValueError(f"--reference-dtype {args.reference_dtype} is the config's own compute dtype: leave it "
                             "out (full prefill is then the reference), or give another dtype")
    engine = open_engine(args.config, config)
    run_settings = {"split": args.split, "passages": args.passages, "field_map": args.field_map}
    with contextlib.ExitStack() as stack:
        stack.enter_context(engine)
        if args.reference_dtype is not None:
            # full prefill only, which touches no store: one CPU-memory tier, never the config's disk or Redis
            only_memory = dataclasses.replace(config.store, tiers=(CpuTierConfig(),))
            reference = stack.enter_context(open_engine(args.config, config.with_overrides(
                dtype=args.reference_dtype, store=only_memory)))
        run = run_eval(engine, examples, entries=entries, dataset=str(args.dataset), max_new_tokens=args.max_new_tokens,
                       prompts=prompts, out_dir=args.out, run_settings=run_settings, progress=not args.no_progress,
                       reference=reference)
    if not run.records:
        raise ValueError(f"{args.dataset}: every example was skipped ({len(run.skipped)}: prompt plus answer longer "
                         "than the model's positions); keep fewer passages (--passages) or a smaller --max-new-tokens")
    say = human(args)
    say(f"{args.dataset}: {len(run.records)} example(s)"
        + (f", {len(run.skipped)} skipped (prompt too long)" if run.skipped else ""))
    say(summary_table(run.summary), end="")
    if args.out is not None:
        paths = write_reports(run, args.out)
        say(f"wrote {run.results_path} and {', '.join(str(p) for p in paths.values())}")
    if args.json:
        emit_json(run.to_json())
    return 0
