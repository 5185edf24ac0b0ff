"""Tests for the transfer-budget planner (blend/planner.py): arithmetic, verdict and ratio
rules, stage bottlenecks, and the `plan` subcommand run in-process through argparse."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from blend.cli.plan import register as register_plan
from blend.planning import planner
from blend.planning.planner import MIB, PlanInputs, plan, transfer_stages

GIB = 1024**3
# The worked example: L=32, H=8, D=128, fp16, 8192 tokens.
EXAMPLE = dict(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, tokens=8192)
EXAMPLE_FLAGS = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype-bytes", "2", "--tokens", "8192"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvblend")
    sub = p.add_subparsers(dest="command")
    register_plan(sub)
    return p


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(["plan", *argv])
    return args.func(args)


def test_worked_example_iops_bottleneck():
    r = plan(PlanInputs(**EXAMPLE, prefill_tokens_per_s=2000.0, read_mibps=450, read_iops=20000, io_block_bytes=16 * 1024))
    assert r.kv_bytes_per_token == 128 * 1024
    assert r.payload_bytes == GIB
    assert r.path_bytes_per_s == 20000 * 16384
    assert r.path_bytes_per_s / MIB == pytest.approx(312.5)
    assert r.t_load_min_s == pytest.approx(GIB / (312.5 * MIB))
    assert r.t_load_min_s == pytest.approx(3.2768)
    assert r.bottleneck == "storage"
    assert "IOPS" in r.stages[0].limited_by


def test_storage_bandwidth_binds_when_lower_than_iops():
    (stage,) = transfer_stages(read_mibps=200, read_iops=20000, io_block_bytes=16 * 1024)
    assert stage.bytes_per_s == 200 * MIB
    assert "read bandwidth" in stage.limited_by


def test_bottleneck_between_storage_and_link():
    base = dict(EXAMPLE, prefill_tokens_per_s=1000.0)
    slow_link = plan(PlanInputs(**base, read_mibps=4000, link_gibps=2))
    assert slow_link.bottleneck == "link"
    assert slow_link.path_bytes_per_s == 2 * GIB
    assert slow_link.t_load_min_s == pytest.approx(0.5)
    slow_disk = plan(PlanInputs(**base, read_mibps=400, link_gibps=2))
    assert slow_disk.bottleneck == "storage"
    assert slow_disk.path_bytes_per_s == 400 * MIB
    assert [s.name for s in slow_disk.stages] == ["storage", "link"]


def test_verdict_load_ratio_from_rule():
    # t_load = 1 GiB / 2 GiB/s = 0.5 s; t_prefill = 8192 / 4096 = 2 s -> r = 0.25
    r = plan(PlanInputs(**EXAMPLE, prefill_tokens_per_s=4096.0, link_gibps=2))
    assert r.t_prefill_s == pytest.approx(2.0)
    assert r.verdict == "load"
    assert r.recommended_ratio == pytest.approx(0.25)


def test_ratio_floor_is_min_ratio():
    # t_load = 0.5 s, t_prefill = 8192 / 512 = 16 s -> T_load/T_prefill = 1/32 < r_min
    fast = PlanInputs(**EXAMPLE, prefill_tokens_per_s=512.0, link_gibps=2)
    assert plan(fast).recommended_ratio == pytest.approx(0.15)
    assert plan(dataclasses.replace(fast, min_ratio=0.3)).recommended_ratio == pytest.approx(0.3)
    assert plan(dataclasses.replace(fast, min_ratio=0.0)).recommended_ratio == pytest.approx(1 / 32)
    assert plan(fast).verdict == "load"


def test_verdict_recompute_caps_ratio_at_one():
    # t_load = 1 GiB / 100 MiB/s = 10.24 s, t_prefill = 8192 / 8192 = 1 s
    r = plan(PlanInputs(**EXAMPLE, prefill_tokens_per_s=8192.0, read_mibps=100))
    assert r.verdict == "recompute"
    assert r.recommended_ratio == 1.0


def test_equal_times_is_recompute():
    # t_load = 0.5 s == t_prefill = 8192 / 16384 s: the load cannot be hidden below r = 1
    r = plan(PlanInputs(**EXAMPLE, prefill_tokens_per_s=16384.0, link_gibps=2))
    assert r.verdict == "recompute"
    assert r.recommended_ratio == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "--read-mibps"),
        ({"read_iops": 1000}, "--io-block"),
        ({"link_gibps": 0}, "positive"),
    ],
)
def test_invalid_paths_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(PlanInputs(**EXAMPLE, prefill_tokens_per_s=1000.0, **kwargs))


def test_invalid_inputs():
    base = PlanInputs(**EXAMPLE, prefill_tokens_per_s=1000.0, link_gibps=1)
    with pytest.raises(ValueError, match="1, 2 or 4"):
        plan(dataclasses.replace(base, dtype_bytes=3))
    with pytest.raises(ValueError, match="--min-ratio"):
        plan(dataclasses.replace(base, min_ratio=1.5))
    with pytest.raises(ValueError, match="--tokens"):
        plan(dataclasses.replace(base, tokens=0))


def test_result_is_frozen_and_dict_has_contract_fields():
    r = plan(PlanInputs(**EXAMPLE, prefill_tokens_per_s=1000.0, link_gibps=1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.verdict = "load"  # type: ignore[misc]
    d = r.to_dict()
    for key in (
        "kv_bytes_per_token", "payload_bytes", "path_bytes_per_s", "t_load_min_s",
        "t_prefill_s", "recommended_ratio", "verdict",
    ):
        assert key in d
    assert d["stages"] == [{"name": "link", "bytes_per_s": float(GIB), "limited_by": "link 1 GiB/s"}]
    json.dumps(d)


@pytest.mark.parametrize("value, expected", [("16KiB", 16384), ("4096", 4096), ("1MiB", MIB), ("16KB", 16000)])
def test_io_block_parsing(value, expected):
    args = _parser().parse_args(["plan", *EXAMPLE_FLAGS, "--read-iops", "100", "--io-block", value])
    assert args.io_block == expected


@pytest.mark.parametrize("value", ["16 furlongs", "-4KiB", "0", "KiB"])
def test_io_block_bad_values_exit_2(value, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["plan", *EXAMPLE_FLAGS, "--read-iops", "100", f"--io-block={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--io-block" in err and "KiB" in err


@pytest.mark.parametrize("value, expected", [("1", 1), ("2", 2), ("4", 4), ("bfloat16", 2), ("float32", 4)])
def test_dtype_bytes_forms(value, expected):
    args = _parser().parse_args(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "1",
                                 "--dtype-bytes", value, "--tokens", "1"])
    assert args.dtype_bytes == expected


def test_dtype_bytes_bad_value_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["plan", *EXAMPLE_FLAGS[:6], "--dtype-bytes", "3", "--tokens", "8"])
    assert exc.value.code == 2
    assert "1, 2 or 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--prefill-tokens-per-s", "1000"], "--read-mibps"),  # no stage
        (["--prefill-tokens-per-s", "1000", "--read-iops", "100"], "--io-block"),
        (["--link-gibps", "1"], "--prefill-tokens-per-s"),  # no rate and no model to measure
    ],
)
def test_cli_flag_combinations_exit_2(extra, match, capsys):
    with pytest.raises(SystemExit) as exc:
        _run([*EXAMPLE_FLAGS, *extra])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_missing_dims_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        _run(["--layers", "32", "--tokens", "8", "--link-gibps", "1", "--prefill-tokens-per-s", "1"])
    assert exc.value.code == 2
    assert "--kv-heads" in capsys.readouterr().err


def test_cli_json_last_line_worked_example(capsys):
    rc = _run([*EXAMPLE_FLAGS, "--read-mibps", "450", "--read-iops", "20000", "--io-block", "16KiB",
               "--prefill-tokens-per-s", "2000", "--json"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    d = json.loads(last)
    assert d["kv_bytes_per_token"] == 131072
    assert d["payload_bytes"] == GIB
    assert d["path_bytes_per_s"] == pytest.approx(312.5 * MIB)
    assert d["t_load_min_s"] == pytest.approx(3.2768)
    assert d["t_prefill_s"] == pytest.approx(4.096)
    assert d["recommended_ratio"] == pytest.approx(3.2768 / 4.096)
    assert d["verdict"] == "load"
    assert d["bottleneck"] == "storage"
    assert d["prefill_source"] == "given"


def test_cli_human_output(capsys):
    assert _run([*EXAMPLE_FLAGS, "--read-mibps", "100", "--prefill-tokens-per-s", "8192"]) == 0
    out = capsys.readouterr().out
    assert "verdict            : recompute" in out
    assert "128 KiB" in out and "1 GiB" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.strip().splitlines()[-1])


def test_cli_measures_prefill_with_model(monkeypatch, capsys):
    monkeypatch.setattr(planner, "model_kv_shape", lambda name: planner.ModelKVShape(32, 8, 128))
    monkeypatch.setattr(
        planner, "profile_prefill",
        lambda name, tokens: planner.PrefillProfile(tokens_per_s=4096.0, device="cpu", tokens=tokens, seconds=0.125),
    )
    assert _run(["--model", "fake", "--tokens", "8192", "--link-gibps", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["prefill_source"].startswith("measured on cpu")
    assert d["t_prefill_s"] == pytest.approx(2.0)
    assert d["recommended_ratio"] == pytest.approx(0.25)


def test_cli_model_and_dims_conflict(capsys):
    with pytest.raises(SystemExit) as exc:
        _run(["--model", "x", "--layers", "2", "--tokens", "8", "--link-gibps", "1"])
    assert exc.value.code == 2
    assert "not both" in capsys.readouterr().err


def test_model_dims_from_config_smollm2():
    pytest.importorskip("blend.model.loading")
    shape = planner.model_kv_shape("smollm2-135m-instruct")
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (30, 3, 64)
    assert planner.kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, 2) == 23040


@pytest.mark.slow
def test_measure_prefill_smollm2():
    pytest.importorskip("blend.model.loading")
    rate = planner.measure_prefill_tokens_per_s("smollm2-135m-instruct", tokens=64)
    assert rate > 0


@pytest.mark.parametrize("stage, message", [((), "no transfer stage given"),
                                            (("--read-iops", "100"), "--read-iops needs the I/O block size")])
def test_flag_errors_come_before_the_model_loads(stage, message, monkeypatch, capsys):
    def no_loading(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(planner, "model_kv_shape", no_loading)
    monkeypatch.setattr(planner, "profile_prefill", no_loading)
    with pytest.raises(SystemExit) as info:
        _run(["--model", "smollm2-135m-instruct", "--tokens", "100", *stage])
    assert info.value.code == 2 and message in capsys.readouterr().err
