"""Attention strategies for query rows at explicit positions: each one equals the rows of a
full causal pass, the log-sum-exp merge is exact, and the tuner picks among exact
strategies only, once per shape bucket (a fake timer stands in for CUDA events)."""

from __future__ import annotations

import pytest
import torch

from blend.model.attention import (
    FORCEABLE,
    AttentionTuner,
    attention_lse,
    build_plan,
    candidates,
    is_tail,
    merge_into,
    parse_strategy,
    run_plan,
    shape_bucket,
)
from blend.model.runner import Runner
from tests.models import tiny_model

CPU = torch.device("cpu")
SCALE = 0.3


def qkv(heads: int, kv_heads: int, n: int, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, n, d, generator=g), torch.randn(kv_heads, n, d, generator=g),
            torch.randn(kv_heads, n, d, generator=g))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every row of a causal pass by explicit float64 math: (T, H*D)."""
    g = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    n = q.shape[1]
    scores = (q.double() @ k.transpose(1, 2)) * SCALE  # (H, T, T)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1).float()


N = 203  # merge/7 from position 3: 7 bands of 29 keys from key 0
SELECTIONS = {
    "scattered": torch.sort(torch.randperm(N, generator=torch.Generator().manual_seed(5))[:41]).values,
    "contiguous": torch.arange(60, 121),
    "single": torch.tensor([87]),
    "first_only": torch.tensor([0]),
    "all": torch.arange(N),
    "tail": torch.arange(N - 9, N),
    "band_edges": torch.tensor([3, 28, 29, 30, 57, 58, 86, 87, 115, 116, 144, 145, 173, 174, 201, 202]),
    "ends": torch.tensor([0, 1, N - 1]),
}
STRATEGIES = ["groups", "groups/1", "groups/5", "groups/fold2", "pad", "merge", "merge/1", "merge/3", "merge/7",
              "merge/16", "merge/64", "tail"]


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_every_strategy_equals_the_rows_of_a_full_causal_pass(heads, selection):
    q, k, v = qkv(*heads, N)
    full = reference(q, k, v)
    rows = SELECTIONS[selection]
    with torch.inference_mode():
        for name in STRATEGIES:
            if "fold" in name and heads[0] == heads[1]:
                continue
            if name == "tail" and not is_tail(rows, N):
                with pytest.raises(ValueError, match="contiguous rows ending at key 202"):
                    build_plan(name, rows, N, 1, CPU)
                continue
            plan = build_plan(name, rows, N, 1, CPU)
            assert plan.strategy == name  # the name round-trips (the tuner stores names)
            out = run_plan(plan, q[:, rows], k, v, SCALE)
            diff = (out - full[rows]).abs()
            assert diff.max() < 1e-5, f"{name}: max {diff.max():.2e} mean {diff.mean():.2e}"


def test_merge_plan_covers_every_row_once_with_prefixes_before_its_band():
    rows = SELECTIONS["band_edges"]
    plan = build_plan("merge/7", rows, N, 1, CPU)
    start, width, count = plan.band
    assert (start, width) == (0, 29) and start + count * width <= N
    band, offset = plan.band_index
    assert torch.equal(start + band * width + offset, rows)  # each query at its position in the block
    covered = [r for a, b, _ in plan.prefixes for r in range(a, b)]
    assert covered == list(range(covered[0], rows.numel()))  # a suffix of the rows, in order
    assert all(int(band[a]) * width + start == keys for a, _, keys in plan.prefixes)  # keys = before the band
    assert all(int(rows[r]) >= width for r in covered) and int(rows[0]) < width  # only band 0 lacks a prefix


def test_merge_into_equals_attention_over_both_key_sets():
    q, k, v = qkv(3, 3, 50, seed=2)
    split = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    a, b = split[:17], split[17:]  # disjoint, not contiguous

    def part(idx):
        s = (q @ k[:, idx].transpose(1, 2)) * SCALE  # (H, T, K)
        return (s.softmax(-1) @ v[:, idx]).transpose(0, 1).contiguous(), s.logsumexp(-1).transpose(0, 1)

    out, lse = part(a)
    other, other_lse = part(b)
    merge_into(out, lse, other, other_lse)
    whole, _ = part(torch.arange(50))
    assert (out - whole).abs().max() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_attention_lse_returns_each_rows_log_sum_exp(causal):
    q, k, v = qkv(4, 2, 30, seed=3)
    out, lse = attention_lse(q[None], k[None], v[None], causal=causal, scale=SCALE)
    s = (q @ k.repeat_interleave(2, 0).transpose(1, 2)) * SCALE
    if causal:
        s = s.masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), float("-inf"))
    assert out.shape == (1, 4, 30, 16) and lse.shape == (1, 4, 30)
    assert (lse[0] - s.logsumexp(-1)).abs().max() < 1e-5
    assert (out[0] - s.softmax(-1) @ v.repeat_interleave(2, 0)).abs().max() < 1e-5


def test_strategy_names_parse_and_bad_ones_say_what_exists():
    assert parse_strategy("merge/8") == ("merge", 8, None)
    assert parse_strategy("groups/1/fold4") == ("groups", 1, 4)
    assert parse_strategy("pad") == ("pad", 0, None)
    for bad in ("flash", "causal", "merge/x", "groups/fold0", "merge/-2", "tails"):
        with pytest.raises(ValueError, match="groups, pad, merge"):
            parse_strategy(bad)


# ---------------------------------------------------------------------- tuner
class FakeTimer:
    """Seconds per candidate name from a table; counts the calls."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.calls = seconds, []

    def __call__(self, name, fn):
        fn()
        self.calls.append(name)
        return self.seconds.get(name, 1.0)


def test_tuner_keeps_the_fastest_exact_candidate_per_bucket():
    ref = torch.randn(5, 8)
    timer = FakeTimer({"ref": 3.0, "slow": 5.0, "fast": 1.0, "wrong": 0.1, "broken": 0.01})

    def broken():
        raise RuntimeError("no kernel for this shape\nmore")

    runs = {"ref": lambda: ref.clone(), "slow": lambda: ref + 1e-7, "fast": lambda: ref - 1e-7,
            "wrong": lambda: ref + 0.5, "broken": broken}
    tuner = AttentionTuner(timer, repeats=2)
    assert tuner.winner((1, 2)) is None
    name, out = tuner.choose((1, 2), runs)
    assert name == "fast" and torch.equal(out, ref - 1e-7)
    tuning = tuner.tunings[(1, 2)]
    assert set(tuning.seconds) == {"ref", "slow", "fast"}  # only exact ones are timed
    assert tuning.rejected["wrong"].startswith("inexact") and "no kernel" in tuning.rejected["broken"]
    assert set(tuning.cold_seconds) == {"ref", "slow", "fast"}
    assert sorted(timer.calls) == sorted(["ref", "slow", "fast"] * 3 + ["wrong"])  # cold call + 2 repeats
    assert tuner.winner((1, 2)) == "fast" and tuner.winner((1, 3)) is None


def test_tuner_raises_when_nothing_runs():
    def broken():
        raise RuntimeError("unsupported")

    with pytest.raises(RuntimeError, match="unsupported"):
        AttentionTuner(FakeTimer({})).choose((0, 0), {"a": broken})


def test_shape_buckets_are_half_octaves():
    assert shape_bucket(1846, 12196) == shape_bucket(1900, 12000)
    assert shape_bucket(1846, 12196) != shape_bucket(1846, 3100)
    assert shape_bucket(1846, 12196) != shape_bucket(3700, 12196)


def test_candidates_are_exact_strategies_with_the_reference_first():
    cuda = torch.device("cuda")
    bf16 = candidates(cuda, torch.bfloat16, 4)
    assert bf16[0] == "groups/fold4" and "pad" in bf16 and "merge/8" in bf16
    assert not any(n.startswith("merge") for n in candidates(cuda, torch.float32, 4))  # flash: half only
    assert "tail" not in bf16 and "tail" in candidates(cuda, torch.bfloat16, 4, tail=True)
    assert candidates(CPU, torch.float32, 4)[0] == "groups"
    for name in bf16 + candidates(CPU, torch.float32, 1):
        assert parse_strategy(name)[0] in FORCEABLE  # exact for any rows


def test_runner_tunes_once_per_bucket_and_then_runs_the_winner():
    runner = Runner(tiny_model("llama"))  # 4 heads over 2 KV heads
    runner.autotune = True  # what CUDA does; measured here with a fake timer
    runner.native_blend = False  # (a CPU's native kernel would take these rows)
    timer = FakeTimer({"merge/8": 0.5, "pad": 0.7})
    runner.tuner = AttentionTuner(timer, repeats=1)
    n = 300
    q, k, v = qkv(runner.num_heads, runner.kv_heads, n, d=runner.head_dim, seed=4)
    full = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                           scale=runner.scaling, enable_gqa=True)[0]
    full = full.transpose(0, 1).reshape(n, -1)
    rows = torch.arange(0, n, 7)
    with torch.inference_mode():
        assert runner.plan_attention(rows, n).kind == "tune"
        out = runner.attend(q[:, rows], rows, k, v)
        assert (out - full[rows]).abs().max() < 1e-5
        assert runner._plan[1].strategy == "merge/8"  # the cached plan is now the winner's
        measured = len(timer.calls)
        assert measured == 2 * len(candidates(runner.device, runner.dtype, 2))  # cold call + 1 repeat
        again = runner.attend(q[:, rows], rows, k, v)
        assert torch.equal(again, out) and len(timer.calls) == measured
        # a new row set in the same bucket: the winner is built directly, nothing measured
        other = torch.arange(1, n, 7)
        assert runner.plan_attention(other, n).strategy == "merge/8"
        out = runner.attend(q[:, other], other, k, v)
        assert (out - full[other]).abs().max() < 1e-5 and len(timer.calls) == measured
        # another bucket is measured again
        few = torch.arange(0, n, 40)
        runner.attend(q[:, few], few, k, v)
        assert len(timer.calls) == 2 * measured
    assert runner.strategies["merge/8"] == 4  # the fake timer prefers it in both buckets


def test_cpu_default_is_the_fixed_rule_and_never_measures():
    runner = Runner(tiny_model("llama"))
    assert not runner.autotune
    rows = torch.arange(0, 300, 7)
    assert runner.plan_attention(rows, 300).strategy == "groups"
    assert runner.plan_attention(torch.arange(10, 300), 300).strategy == "pad"
    assert runner.plan_attention(torch.arange(300), 300).kind == "causal"
    assert runner.plan_attention(rows, 300, strategy="merge/4").strategy == "merge/4"
