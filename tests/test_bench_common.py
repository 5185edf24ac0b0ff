"""Benchmark hygiene: when a measurement is flagged as contended."""

import pytest

import eval.bench.common as common
from eval.bench.common import LoadWatch


@pytest.mark.parametrize(("start", "end", "own", "contended"), [
    (0.3, 2.05, 2, False),  # a 2-thread benchmark alone on 2 cores ends near 2
    (2.6, 2.05, 2, True),   # the machine was busy before it started
    (0.3, 3.4, 2, True),    # another process ran beside it
    (0.3, 1.4, 1, False),
    (0.3, 2.6, 1, True),
])
def test_contended_counts_other_work_not_the_benchmark_itself(monkeypatch, start, end, own, contended):
    monkeypatch.setattr(common, "load_average", lambda: end)
    fields = LoadWatch(start, 2).finish(own_threads=own)
    assert fields == {"load_average_start": start, "load_average_end": end, "cpu_cores": 2, "contended": contended}
