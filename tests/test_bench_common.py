"""Benchmark hygiene: when a measurement is flagged as contended."""

import time

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
    assert fields == {"load_average_start": start, "load_average_end": end, "load_average_peak": end, "cpu_cores": 2,
                      "contended": contended}


def wait_for_samples(watch: LoadWatch, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(watch.samples) < count:
        assert time.monotonic() < deadline, "the load sampler took no samples"
        time.sleep(0.001)


def test_other_work_in_the_middle_of_a_run_is_contended(monkeypatch, capsys):
    """Quiet at both ends, busy in between (e.g. a test suite that ran for a while): the
    sampled peak flags it, and the warning names the peak."""
    readings = iter([0.3, 2.0, 4.2, 3.9, 2.1])  # begin, three samples, finish
    last = {"value": 0.3}

    def reading():
        last["value"] = next(readings, 2.05)  # then the run's own 2 threads
        return last["value"]

    monkeypatch.setattr(common, "load_average", reading)
    watch = LoadWatch.begin(every_s=0.001)
    wait_for_samples(watch, 3)  # the sampler has read the busy stretch
    fields = watch.finish(own_threads=2)
    assert fields["load_average_start"] == 0.3 and fields["load_average_peak"] == 4.2
    assert fields["contended"] is True
    assert "4.2 at its peak" in capsys.readouterr().err
    assert watch._thread is not None and not watch._thread.is_alive()  # stopped by finish


def test_a_quiet_run_stays_uncontended_with_its_samples(monkeypatch):
    monkeypatch.setattr(common, "load_average", lambda: 1.9)  # its own 2 threads, nothing else
    watch = LoadWatch.begin(every_s=0.001)
    wait_for_samples(watch, 2)
    fields = watch.finish(own_threads=2)
    assert fields["contended"] is False and fields["load_average_peak"] == 1.9


def test_an_abandoned_watch_stops_its_sampler(monkeypatch):
    """A run that fails before finish() drops its watch: the sampler thread ends too."""
    import gc

    monkeypatch.setattr(common, "load_average", lambda: 1.0)
    watch = LoadWatch.begin(every_s=0.001)
    thread = watch._thread
    wait_for_samples(watch, 1)
    del watch
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_probe_gflops_times_a_real_matrix_product():
    rate = common.probe_gflops(seconds=0.02)
    assert isinstance(rate, float) and rate > 0


@pytest.mark.parametrize(("spreads", "probes", "unsteady", "named"), [
    ({"full prefill": (8.0, 7.9, 8.3), "cpu r=0.15": (2.0, 1.95, 2.1)}, (80.0, 82.0), False, None),
    ({"full prefill": (8.0, 7.9, 8.3), "cpu r=0.15": (4.8, 3.5, 5.0)}, (80.0, 82.0), True, "cpu r=0.15"),
    ({"full prefill": (8.0, 7.9, 8.3)}, (150.0, 84.0), True, "150.0 GFLOP/s at the start and 84.0 at the end"),
    ({"one repeat": (8.0, 8.0, 8.0)}, (80.0, 80.0), False, None),
])
def test_unsteady_names_the_setting_or_the_probe(monkeypatch, capsys, spreads, probes, unsteady, named):
    """A host that slows the VM down shows in no load average: the spread of one setting's
    repeats or a probe that moved between start and end flags the run."""
    readings = iter(probes)
    monkeypatch.setattr(common, "probe_gflops", lambda seconds=common.PROBE_S: next(readings))
    fields = common.Steadiness.begin().finish(spreads, "ttft benchmark")
    err = capsys.readouterr().err
    assert fields["unsteady"] is unsteady
    assert (fields["probe_gflops_start"], fields["probe_gflops_end"]) == probes
    if unsteady:
        assert err.startswith("warning: this ttft benchmark's machine changed speed") and named in err
    else:
        assert err == ""
    widest = max((high - low) / mid for mid, low, high in spreads.values())
    assert fields["widest_spread"] == round(widest, 3)
