"""`kvblend bench workload`: the request stream (seeded, Zipf, per question), arrivals, the gate, and
whole runs on a tiny model and a tiny corpus: counters add up, the cold start shows, seeded runs
repeat, codecs change what a budget holds."""

from __future__ import annotations

import json
import threading
import time

import pytest

from blend.config import EngineConfig
from blend.model.loading import load_model
from eval.bench.workload import (
    EngineGate,
    WorkloadSettings,
    corpus,
    percentile,
    poisson_arrivals,
    request_stream,
    run_workload,
    write_report,
)
from eval.loaders import Example

TOPICS = ["harbour", "mill", "bridge", "lighthouse", "market", "abbey", "canal", "foundry", "orchard", "theatre"]


def examples(n: int = 8, passages: int = 3) -> list[Example]:
    out = []
    for i in range(n):
        texts = tuple(f"The {TOPICS[(i + j) % len(TOPICS)]} of town {i}-{j} was built in {1800 + 7 * i + j} by the "
                      f"mason {TOPICS[j]}son, who also carved its {TOPICS[(i * j) % len(TOPICS)]} stones." for j in
                      range(passages))
        out.append(Example(id=f"q{i}", passages=texts, question=f"Who built the {TOPICS[i % len(TOPICS)]}?",
                           answers=("a mason",)))
    return out


def test_a_zipf_stream_is_seeded_draws_distinct_passages_and_favours_the_popular_ones():
    exs = examples(20)
    a = request_stream(exs, 200, zipf=1.2, docs_per_request=3, seed=7)
    assert a == request_stream(exs, 200, zipf=1.2, docs_per_request=3, seed=7)
    assert a != request_stream(exs, 200, zipf=1.2, docs_per_request=3, seed=8)
    assert all(len(set(r.passages)) == 3 for r in a)
    counts: dict[str, int] = {}
    for r in a:
        for p in r.passages:
            counts[p] = counts.get(p, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 5 * ranked[len(ranked) // 2]  # a few passages take most of the draws
    assert set(counts) <= set(corpus(exs))


def test_a_per_question_stream_cycles_the_examples_in_a_seeded_order():
    exs = examples(5, passages=4)
    stream = request_stream(exs, 12, passages=2, seed=1)
    assert [r.index for r in stream] == list(range(12))
    firsts = [r.passages for r in stream[:5]]
    assert sorted(firsts) == sorted(ex.passages[:2] for ex in exs)  # each question once per cycle
    assert [r.passages for r in stream[5:10]] == firsts
    with pytest.raises(ValueError, match="--passages K"):
        request_stream(exs, 3)
    with pytest.raises(ValueError, match="--docs-per-request"):
        request_stream(exs, 3, zipf=1.0)
    with pytest.raises(ValueError, match="more than the 20 passages"):
        request_stream(exs, 3, zipf=1.0, docs_per_request=21)


def test_poisson_arrivals_are_seeded_increasing_and_at_about_the_rate():
    stream = request_stream(examples(), 400, passages=1)
    timed = poisson_arrivals(stream, 20.0, seed=3)
    times = [r.arrival_s for r in timed]
    assert times == sorted(times) and times == [r.arrival_s for r in poisson_arrivals(stream, 20.0, seed=3)]
    assert 15 < len(times) / times[-1] < 25


def test_the_gate_lets_requests_in_one_at_a_time_in_ticket_order():
    gate = EngineGate(serialize=True)
    order: list[int] = []
    inside = []

    def request(ticket: int) -> None:
        gate.arrive()
        gate.enter(ticket)
        inside.append(1)
        assert len(inside) == 1  # alone in the engine
        order.append(ticket)
        time.sleep(0.002)
        inside.pop()
        gate.leave()

    threads = [threading.Thread(target=request, args=(t,)) for t in (3, 1, 4, 0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == [0, 1, 2, 3, 4] and gate.waiting == 0


def test_percentiles_are_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile(list(range(1, 101)), 0.99) == 99


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", device="cpu")


def _config(tmp_path, budget: str = "64MiB", recompute_harvested: bool = False) -> EngineConfig:
    """(Harvested documents kept as they are unless asked: their recompute in idle moments would make
    the counters depend on the timing between requests.)"""
    return EngineConfig(model="random:tiny").with_overrides(
        store={"kv_dtype": "float16", "tiers": [{"kind": "cpu", "budget": budget},
                                                {"kind": "disk", "path": str(tmp_path / "disk"), "budget": "64MiB"}]},
        chunk_tokens=16, split="off", sessions_dir=str(tmp_path / "sessions"), recompute_harvested=recompute_harvested)


def _dataset(tmp_path) -> str:
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps([{"question": ex.question, "answers": list(ex.answers),
                                 "ctxs": [{"title": "", "text": p} for p in ex.passages]} for ex in examples(8)]))
    return str(path)


def _settings(tmp_path, **changes) -> WorkloadSettings:
    base = dict(dataset=_dataset(tmp_path), requests=14, modes=("full", "blend"), codecs=("none", "int4"),
                zipf=1.1, docs_per_request=2, clients=2, seed=5, fidelity_every=5, max_new_tokens=2)
    return WorkloadSettings(**(base | changes))


def test_a_workload_run_adds_up_shows_its_cold_start_and_repeats_for_a_seed(tmp_path, tiny):
    settings = _settings(tmp_path, clients=1)  # one client: the order of the requests, and so every counter, repeats
    first = run_workload(settings, _config(tmp_path), lm=tiny, log_line=lambda _: None)
    rows = {(r["mode"], r["codec"]): r for r in first["results"]}
    assert 0 < first["distinct_documents"] < first["stream_documents"] == 14 * 2  # repeats: some lookups can hit
    assert set(rows) == {("full", "none"), ("blend", "none"), ("full", "int4"), ("blend", "int4")}
    # the machine's speed at both ends (the modes run one after the other: their ratio needs one speed)
    assert first["probe_gflops_start"] > 0 and first["probe_gflops_end"] > 0 and isinstance(first["unsteady"], bool)
    for row in rows.values():
        assert row["completed"] == row["requests"] == 14 and not row["errors"]
        assert row["hits"] + row["misses"] == row["lookups"]
        assert row["kv_block_tokens"] == 16 and row["io_block_bytes"] > 0
        assert len(row["ttft_samples_s"]) == 14 and row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["e2e_p50_s"] >= row["ttft_p50_s"] > 0 and row["requests_per_s"] > 0
        # one client: its requests follow each other, so a cycle (TTFT, then the rest of the answer) fits the wall
        assert row["probe_gflops"] > 0  # the machine's speed as this pass began
        assert 0 <= row["after_first_token_mean_s"] and row["ttft_mean_s"] + row["after_first_token_mean_s"] <= 1 / row["requests_per_s"]
        assert row["queue_depth_series"]
    for codec in ("none", "int4"):
        full, blend = rows[("full", codec)], rows[("blend", codec)]
        assert full["lookups"] == 0 and all(v == 0 for v in full["bytes_written"].values())  # full: no store
        assert blend["lookups"] > 0 and blend["misses_computed"] == blend["misses"] > 0
        series = blend["hit_rate_series"]
        assert series[0] == 0.0 and max(x for x in series if x is not None) > 0  # an empty cache to start with
        assert blend["kl_samples"] == 3 and blend["kl_mean"] is not None and full["kl_mean"] is None
        for name, tier in blend["tiers"].items():  # no evictions here: everything written is still held
            assert tier["evictions"] == 0 and tier["entries"] == tier["puts"] > 0  # (a lookup waits for a queued put)
            if name == "cpu":
                assert tier["bytes_written"] == tier["bytes_used"]  # entries stored x their sizes
            assert tier["codec"] == codec
    # (a tiny model's small heads and blocks carry relatively more scales than a real one's 3.5x)
    assert rows[("blend", "int4")]["bytes_written"]["cpu"] * 2.5 < rows[("blend", "none")]["bytes_written"]["cpu"]
    second = run_workload(settings, _config(tmp_path), lm=tiny, log_line=lambda _: None)
    for a, b in zip(first["results"], second["results"], strict=True):  # the same stream, the same counters
        for key in ("hits", "misses", "lookups", "evictions", "bytes_written", "hit_rate_series"):
            assert a[key] == b[key], key


def test_a_small_cache_evicts_and_int4_holds_more_of_the_corpus(tmp_path, tiny):
    settings = _settings(tmp_path, requests=24, modes=("blend",), cache_fraction=0.2, clients=1, fidelity_every=0)
    summary = run_workload(settings, _config(tmp_path), lm=tiny, log_line=lambda _: None)
    rows = {r["codec"]: r for r in summary["results"]}
    budget = summary["tier_budget"]
    assert budget == int(0.2 * summary["corpus_kv_bytes"])
    none, int4 = rows["none"]["tiers"]["cpu"], rows["int4"]["tiers"]["cpu"]
    assert none["budget"] == int4["budget"] == budget and none["evictions"] > 0
    assert int4["entries"] > 2 * none["entries"]
    assert rows["int4"]["hit_rate"] >= rows["none"]["hit_rate"]


def test_concurrent_clients_repeat_the_stream_and_their_counters_add_up(tmp_path, tiny):
    """Two clients: the engine interleaves them, so which request finds what the other stored varies; the
    requests, their lookups and the counters' sums do not."""
    settings = _settings(tmp_path, modes=("blend",), codecs=("int8",), fidelity_every=0)
    runs = [run_workload(settings, _config(tmp_path), lm=tiny, log_line=lambda _: None)["results"][0] for _ in range(2)]
    for row in runs:
        assert row["completed"] == 14 and row["hits"] + row["misses"] == row["lookups"]
        assert row["tiers"]["cpu"]["lookup_hits"] + row["tiers"]["cpu"]["lookup_misses"] > 0
    assert runs[0]["lookups"] == runs[1]["lookups"]


def test_an_open_loop_run_queues_requests_that_arrive_faster_than_they_are_served(tmp_path, tiny):
    settings = _settings(tmp_path, requests=8, modes=("full",), codecs=None, clients=None, rate=2000.0,
                         fidelity_every=0)
    # one sequence at a time: the later arrivals wait in the scheduler's queue (with 8 admitted at once
    # they were all under way within a step, and the depth seen at an arrival was 1 in some runs)
    config = _config(tmp_path).with_overrides(max_num_seqs=1)
    summary = run_workload(settings, config, lm=tiny, log_line=lambda _: None)
    (row,) = summary["results"]
    assert summary["arrivals"] == "open" and row["completed"] == 8
    assert row["queue_depth_max"] >= 2 and row["queue_wait_mean_s"] > 0
    assert row["codec"] == "none+int8"  # the tiers as configured


@pytest.mark.parametrize("args, message", [
    (["--passages", "2", "--zipf", "1.0", "--docs-per-request", "2"], "give either --passages K"),
    (["--zipf", "1.0"], "--zipf and --docs-per-request go together"),
    (["--passages", "2", "--clients", "2", "--rate", "3"], "either --clients N (closed loop) or --rate R"),
    (["--passages", "2", "--codecs", "int3"], "unknown codec 'int3'"),
    (["--passages", "2", "--modes", "fast"], "unknown mode 'fast'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    from blend.cli import main

    assert main(["bench", "workload", "--dataset", _dataset(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_second_pass_on_the_same_store_hits_more_and_reports_how_misses_were_paid(tmp_path, tiny):
    settings = _settings(tmp_path, codecs=("none",), clients=1, passes=2, fidelity_every=0)
    summary = run_workload(settings, _config(tmp_path, recompute_harvested=True), lm=tiny, log_line=lambda _: None)
    rows = {(r["mode"], r["pass"]): r for r in summary["results"]}
    assert set(rows) == {("full", 1), ("full", 2), ("blend", 1), ("blend", 2)}  # full prefill's row per pass too
    cold, warm = rows[("blend", 1)], rows[("blend", 2)]
    assert warm["hit_rate"] > cold["hit_rate"] and warm["misses"] < cold["misses"]
    for row in (cold, warm):
        for key in ("miss_compute_s", "harvested", "deduplicated", "background_s", "write_s", "bytes_written",
                    "miss_plans"):
            assert key in row, key
        assert row["background_s"] >= 0.0 and row["background_steps"] >= 0 and row["completed"] == 14
        assert 0 <= row["harvested_left"] <= row["harvested"] or row["pass"] > 1
    assert sum(cold["miss_plans"].values()) > 0 and cold["miss_compute_s"] > 0  # every plan spends some
    assert sum(cold["write_s"].values()) > 0 and cold["bytes_written"]["cpu"] > 0
    # the second pass's store counters are its own: it writes only what it missed
    assert warm["bytes_written"]["cpu"] < cold["bytes_written"]["cpu"]
    assert warm["tiers"]["cpu"]["puts"] < cold["tiers"]["cpu"]["puts"]
    out = tmp_path / "report"
    write_report(summary, out)
    assert "| 2 | blend |" in (out / "workload.md").read_text()
