"""The fidelity columns of the eval summary: largest KL and examples worse than reuse."""

from __future__ import annotations

from eval.entries import plan_entries
from eval.report import summary_table
from eval.runner import summarize


def _record(i: int, reuse: float, blend: float) -> dict:
    row = {"kl_to_full": None, "ttft_s": 1.0}
    return {"id": str(i), "entries": {"full": {**row, "kl_to_full": 0.0}, "reuse": {**row, "kl_to_full": reuse},
                                      "blend@0.15": {**row, "kl_to_full": blend}}}


def test_worse_than_reuse_and_kl_max():
    entries = plan_entries(["full", "reuse", "blend"], [0.15])
    summary = summarize([_record(0, 0.5, 0.1), _record(1, 0.2, 0.3), _record(2, 0.4, 0.4)], entries)
    assert summary["blend@0.15"]["worse_than_reuse"] == 1  # a tie is not worse
    assert summary["blend@0.15"]["kl_max"] == 0.4
    assert summary["reuse"]["worse_than_reuse"] is None and summary["reuse"]["kl_max"] == 0.5
    table = summary_table(summary)
    assert "worse than reuse" in table and "| blend@0.15 |" in table
