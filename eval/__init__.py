"""Evaluation of kvblend: answer quality and fidelity of blended KV caches versus full prefill.

Modules:
    loaders/   read evaluation sets (CacheBlend JSON, LongBench, HotpotQA, SAMSum, MultiNews,
               Hugging Face datasets, our synthetic set) into one `Example` record.
    synthetic  generate a deterministic multi-document QA set with single- and two-hop questions.
    metrics    QA F1 / exact match / Rouge-L against gold answers, and KL divergence / top-1
               agreement between the next-token distributions of full prefill and blending.
    prompts    the prompt templates per task (built in: blend.prompt.TEMPLATES; a YAML file may replace them)
    runner     run every example in every mode / recompute ratio (full prefill first, the reference),
               score quality and fidelity per example, average them per mode (`run_eval`).
    results    the resumable results.jsonl: a settings header, then one line per finished example.
    report     summary.md table and the quality / KL versus TTFT plots.
    samples    the shipped sample documents and questions (the demo's corpus, the benches' text).
    bench/     `kvblend bench load | ttft | resume` and what they share (common).
    data/      shipped evaluation data: synthetic sets and the sample documents for demos.
The `kvblend eval` command itself is in blend/cli/eval.py (the command root).
"""
