"""Reports of an evaluation run: the markdown summary table and the quality-latency plots
(quality or KL to full prefill against TTFT per mode and recompute ratio, as in the
figures of the CacheBlend paper), written next to results.jsonl.

Plots use matplotlib's Agg canvas on a standalone Figure: no pyplot state, no display.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eval.results import KL_PLOT, QUALITY_PLOT, SUMMARY_JSON, SUMMARY_MD, jsonable, save_figure, write_file

COLUMNS = (  # (summary key, header, format)
    ("n", "n", "{:d}"),
    ("f1", "F1", "{:.3f}"),
    ("em", "EM", "{:.3f}"),
    ("rouge_l", "Rouge-L", "{:.3f}"),
    ("kl_to_full", "KL to full", "{:.4f}"),
    ("kl_max", "KL max", "{:.3f}"),
    ("answer_kl", "answer KL", "{:.4f}"),
    ("worse_than_reuse", "worse than reuse", "{:d}"),
    ("top1_agree", "top-1 agree", "{:.2f}"),
    ("greedy_match", "greedy match", "{:.2f}"),
    ("answer_nll", "answer NLL", "{:.3f}"),
    ("ttft_s", "TTFT (s)", "{:.3f}"),
    ("speedup", "speedup (median)", "{:.2f}x"),
    ("recomputed_fraction", "recomputed", "{:.3f}"),
)
STYLES = {"full": ("k", "*"), "reuse": ("tab:red", "X"), "prefix": ("tab:green", "s"), "blend": ("tab:blue", "o")}


def summary_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table, one row per entry, with columns that have at least one value;
    below it, for each blend entry, how much of reuse's KL to full it removes."""
    columns = [c for c in COLUMNS if any(s.get(c[0]) is not None for s in summary.values())]
    lines = ["| entry | " + " | ".join(h for _, h, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, s in summary.items():
        cells = [_cell(s.get(key), fmt) for key, _, fmt in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    reuse_kl = summary.get("reuse", {}).get("kl_to_full")
    notes = []
    for name, s in summary.items():
        if s.get("mode") == "blend" and reuse_kl and s.get("kl_to_full") is not None:
            notes.append(f"{name} removes {1 - s['kl_to_full'] / reuse_kl:.1%} of reuse's KL to full prefill")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    return fmt.format(int(value)) if fmt == "{:d}" else fmt.format(float(value))


def quality_key(summary: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The quality metric to plot: f1 when any entry has it, else rouge_l, else None."""
    for key in ("f1", "rouge_l"):
        if any(s.get(key) is not None for s in summary.values()):
            return key
    return None


def plot_tradeoff(summary: Mapping[str, Mapping[str, Any]], metric: str, path: Path, *, title: str) -> Path:
    """Scatter of `metric` against mean TTFT per entry; blend entries joined in ratio order
    (one line per selection policy) and labelled with their ratio. Side effect: writes a PNG
    at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lines: dict[str, list[tuple[float, Mapping[str, Any]]]] = {}  # one line per selection policy
    for name, s in summary.items():
        if s.get("mode") == "blend" and s.get(metric) is not None and s.get("ttft_s") is not None:
            policy = s.get("selection") or (name.split(":", 1)[1] if ":" in name else "")
            lines.setdefault(policy, []).append((s["ratio"], s))
    base_color, marker = STYLES["blend"]
    markers = ("o", "s", "^", "v", "P", "X")
    for i, (policy, points) in enumerate(sorted(lines.items())):
        points.sort(key=lambda p: p[0])
        color = base_color if len(lines) == 1 else f"C{i}"
        label = "blend (recompute ratio)" + (f", {policy}" if policy and len(lines) > 1 else "")
        ax.plot([s["ttft_s"] for _, s in points], [s[metric] for _, s in points], color=color,
                marker=marker if len(lines) == 1 else markers[i % len(markers)], label=label, zorder=2)
        for ratio, s in points:
            ax.annotate(f"{ratio:g}", (s["ttft_s"], s[metric]), textcoords="offset points", xytext=(5, 5),
                        fontsize=8, color=color)
    for name, s in summary.items():
        if s.get("mode") == "blend" or s.get(metric) is None or s.get("ttft_s") is None:
            continue
        color, marker = STYLES.get(s.get("mode", name), ("tab:gray", "D"))
        ax.scatter([s["ttft_s"]], [s[metric]], color=color, marker=marker, s=90 if marker == "*" else 55,
                   label=name, zorder=3)
    if metric == "kl_to_full":
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(bottom=0)
    else:  # scores in [0, 1]: from 0, with room above the best
        top = max((s[metric] for s in summary.values() if s.get(metric) is not None), default=0.0)
        ax.set_ylim(0, min(1.05, max(0.1, 1.2 * top)))
    ax.set_xlabel("time to first token (s, mean)")
    ax.set_ylabel({"f1": "QA F1", "rouge_l": "Rouge-L", "kl_to_full": "KL(full || mode), first token"}.get(metric, metric))
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    save_figure(fig, path)
    return path


def write_reports(run: Any, out_dir: str | Path) -> dict[str, Path]:
    """Write summary.json, summary.md and the PNG plots of an EvalRun into `out_dir`
    (results.jsonl is written by the runner). Returns the paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    doc = {**run.to_json(), "settings": run.settings}
    paths[SUMMARY_JSON] = out / SUMMARY_JSON
    write_file(paths[SUMMARY_JSON], json.dumps(jsonable(doc), indent=2) + "\n")
    paths[SUMMARY_MD] = out / SUMMARY_MD
    head = f"# kvblend eval: {run.dataset}\n\n{len(run.records)} example(s)"
    if run.skipped:
        head += f", {len(run.skipped)} skipped (prompt too long)"
    write_file(paths[SUMMARY_MD], f"{head}\n\n{summary_table(run.summary)}")
    subtitle = f"{run.dataset} (n={len(run.records)})"
    metric = quality_key(run.summary)
    if metric is not None:
        label = {"f1": "F1", "rouge_l": "Rouge-L"}[metric]
        paths[QUALITY_PLOT] = plot_tradeoff(run.summary, metric, out / QUALITY_PLOT,
                                            title=f"{label} vs TTFT — {subtitle}")
    paths[KL_PLOT] = plot_tradeoff(run.summary, "kl_to_full", out / KL_PLOT,
                                   title=f"KL to full prefill vs TTFT — {subtitle}")
    return paths
