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


def test_report_files_are_replaced_whole_or_left_as_they_were(tmp_path):
    """A report write that fails halfway (a killed run, a full disk) leaves the previous file
    and no temp file; a finished one replaces it."""
    import pytest

    from eval.results import save_figure, write_file

    path = tmp_path / "summary.json"
    write_file(path, '{"old": true}\n')

    class Breaks:
        def savefig(self, buffer, **kwargs):
            buffer.write(b"\x89PNG half")
            raise OSError(28, "No space left on device")

    class Draws:
        def savefig(self, buffer, **kwargs):
            assert kwargs == {"format": "png", "dpi": 120}
            buffer.write(b"\x89PNG whole")

    with pytest.raises(OSError):
        save_figure(Breaks(), tmp_path / "plot.png", dpi=120)
    with pytest.raises(TypeError):
        write_file(path, None)  # fails once its temp file exists: the temp file is removed
    assert path.read_text() == '{"old": true}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    save_figure(Draws(), tmp_path / "plot.png", dpi=120)
    write_file(path, "{}\n")
    assert path.read_text() == "{}\n" and (tmp_path / "plot.png").read_bytes() == b"\x89PNG whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "summary.json"]
