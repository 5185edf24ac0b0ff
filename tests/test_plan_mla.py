"""MLA (multi-head latent attention) caches in `kvblend plan`: payloads of the DeepSeek / Kimi shape
aliases and of --kv-lora-rank/--rope-head-dim against hand-computed bytes, a local config.json with
kv_lora_rank, the MHA equivalent, --tp per rank and stored, the one-line errors, the loaders'
refusal, and MHA / hybrid plans as they were. Also the MLA rows of docs/STORAGE.md against the codec's
sizes."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from blend.cli.plan import register as register_plan
from blend.planning import planner
from blend.planning.planner import MLAShape, PlanInputs, plan
from storage.codec import CODECS

ROOT = Path(__file__).resolve().parents[1]
PATH = ["--link-gibps", "16", "--prefill-tokens-per-s", "4000"]
NEW_FIELDS = ("attention", "latent_dim", "rope_head_dim", "bytes_per_token", "mha_equivalent_bytes",
              "mha_equivalent_bytes_per_token", "tp", "bytes_per_rank", "stored_bytes_every_rank",
              "stored_bytes_single_copy")


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvblend")
    register_plan(p.add_subparsers(dest="command"))
    args = p.parse_args(["plan", *argv])
    return args.func(args)


def _json(argv: list[str], capsys) -> dict:
    assert _run([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _error(argv: list[str], capsys) -> str:
    """The one line `kvblend plan ARGV` prints on stderr, exiting 2 (through the command root)."""
    from blend.cli import main

    try:
        code = main(["plan", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# (alias, layers, bytes per token by hand: L * (512 + 64) * 2, MHA formula by hand: L * heads * (128 + 64 + 128) * 2)
ALIASES = [
    ("deepseek-v2-lite", 27, 27 * 576 * 2, 27 * 16 * 320 * 2),  # 31,104 vs 276,480
    ("deepseek-v2", 60, 60 * 576 * 2, 60 * 128 * 320 * 2),  # 69,120 vs 4,915,200
    ("deepseek-v3", 61, 70272, 4997120),  # the figures
    ("kimi-k2", 61, 70272, 61 * 64 * 320 * 2),  # 64 heads: 2,498,560
    ("random:deepseek-v3", 61, 70272, 4997120),
]


@pytest.mark.parametrize("alias, layers, per_token, mha_per_token", ALIASES)
def test_alias_payloads_by_hand(alias, layers, per_token, mha_per_token, capsys):
    d = _json(["--model", alias, "--tokens", "8192", *PATH], capsys)
    assert d["attention"] == "mla" and d["latent_dim"] == 512 and d["rope_head_dim"] == 64
    assert d["kv_bytes_per_token"] == d["bytes_per_token"] == per_token
    assert d["payload_bytes"] == d["uniform_payload_bytes"] == per_token * 8192
    assert d["layers_by_type"] == {"full": layers} and d["window"] is None
    assert d["mha_equivalent_bytes_per_token"] == mha_per_token
    assert d["mha_equivalent_bytes"] == mha_per_token * 8192
    assert d["tp"] == 1 and d["bytes_per_rank"] == d["stored_bytes_every_rank"] == d["stored_bytes_single_copy"] \
        == per_token * 8192
    assert d["t_load_min_s"] == pytest.approx(per_token * 8192 / (16 * 2**30))


def test_deepseek_v3_is_71x_below_the_mha_formula(capsys):
    d = _json(["--model", "deepseek-v3", "--tokens", "1", *PATH], capsys)
    assert (d["payload_bytes"], d["mha_equivalent_bytes"]) == (70272, 4997120)
    assert _run(["--model", "deepseek-v3", "--tokens", "1", *PATH]) == 0
    out = capsys.readouterr().out
    assert "MLA" in out and "71.1x the MLA bytes" in out


def test_mla_flags_by_hand(capsys):
    d = _json(["--layers", "61", "--kv-lora-rank", "512", "--rope-head-dim", "64", "--tokens", "8192", *PATH], capsys)
    assert d["attention"] == "mla" and (d["latent_dim"], d["rope_head_dim"]) == (512, 64)
    assert d["bytes_per_token"] == 61 * (512 + 64) * 2 == 70272
    assert d["payload_bytes"] == 575_668_224  # 61 * 8192 * 576 * 2
    assert d["mha_equivalent_bytes"] is None and d["mha_equivalent_bytes_per_token"] is None  # heads not given
    d = _json(["--layers", "27", "--kv-lora-rank", "256", "--rope-head-dim", "32", "--dtype-bytes", "1",
               "--tokens", "1000", *PATH], capsys)
    assert d["payload_bytes"] == 27 * 1000 * (256 + 32) * 1


def test_tp_8_per_rank_and_in_total(capsys):
    d = _json(["--model", "deepseek-v3", "--tokens", "8192", "--tp", "8", *PATH], capsys)
    payload = 70272 * 8192
    assert d["tp"] == 8 and d["bytes_per_rank"] == payload  # every rank holds the whole latent
    assert d["stored_bytes_every_rank"] == 8 * payload and d["stored_bytes_single_copy"] == payload
    assert d["payload_bytes"] == payload and d["t_load_min_s"] == pytest.approx(payload / (16 * 2**30))
    assert _run(["--model", "deepseek-v3", "--tokens", "8192", "--tp", "8", *PATH]) == 0
    assert "tensor parallel    : 8 ranks, each holds the whole latent" in capsys.readouterr().out
    # MHA / GQA: 8 KV heads split over 8 ranks; over 16 each head is on two ranks; 3 does not split them
    gqa = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "8192", *PATH]
    d = _json([*gqa, "--tp", "8"], capsys)
    assert d["payload_bytes"] == 2**30 and d["bytes_per_rank"] == 2**30 // 8
    assert d["stored_bytes_every_rank"] == d["stored_bytes_single_copy"] == 2**30
    d = _json([*gqa, "--tp", "16"], capsys)
    assert d["bytes_per_rank"] == 2**30 // 8 and d["stored_bytes_every_rank"] == 2 * 2**30
    assert d["stored_bytes_single_copy"] == 2**30
    assert "--tp 3 does not split 8 KV heads" in _error([*gqa, "--tp", "3"], capsys)
    assert "--tp" in _error([*gqa, "--tp", "0"], capsys)


@pytest.mark.parametrize("argv, words", [
    (["--layers", "61", "--kv-lora-rank", "512", "--rope-head-dim", "64", "--kv-heads", "8"],
     ("--kv-lora-rank/--rope-head-dim", "--kv-heads/--head-dim", "not both")),
    (["--layers", "61", "--kv-lora-rank", "512", "--head-dim", "128"], ("--kv-heads/--head-dim", "not both")),
    (["--layers", "61", "--rope-head-dim", "64", "--kv-heads", "8", "--head-dim", "128"], ("not both",)),
    (["--model", "deepseek-v3", "--kv-lora-rank", "512"], ("--model", "not both")),
    (["--kv-lora-rank", "512", "--rope-head-dim", "64"], ("--layers",)),
    (["--layers", "61", "--kv-lora-rank", "512"], ("--rope-head-dim",)),
])
def test_conflicting_and_missing_mla_flags(argv, words, capsys):
    err = _error([*argv, "--tokens", "8", *PATH], capsys)
    assert all(w in err for w in words), err


def test_an_mla_model_without_a_rate_says_it_cannot_run(monkeypatch, capsys):
    def no_loading(*_args, **_kwargs):
        raise AssertionError("tried to load a model that cannot run")

    monkeypatch.setattr(planner, "profile_prefill", no_loading)
    err = _error(["--model", "deepseek-v3", "--tokens", "100", "--link-gibps", "1"], capsys)
    assert "MLA" in err and "cannot be run here" in err and "--prefill-tokens-per-s" in err


KIMI_CONFIG = {  # Kimi-K2's config.json: a model type transformers does not know (remote code)
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61,
    "num_attention_heads": 64, "num_key_value_heads": 64, "hidden_size": 7168, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
}


def _model_dir(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "model-00001-of-000062.safetensors").write_bytes(b"\0" * 64)  # weights nobody must read
    return root


def test_local_config_json_with_kv_lora_rank_is_mla(tmp_path, capsys):
    kimi = _model_dir(tmp_path / "kimi", KIMI_CONFIG)
    d = _json(["--model", str(kimi), "--tokens", "1000", *PATH], capsys)
    assert d["attention"] == "mla" and d["payload_bytes"] == 61 * 1000 * 576 * 2
    assert d["mha_equivalent_bytes_per_token"] == 61 * 64 * 320 * 2
    # a multimodal wrapper: the MLA fields in text_config; an own layer count and no head dims
    wrapped = _model_dir(tmp_path / "wrapped", {"model_type": "kimi_k25", "text_config": {
        "num_hidden_layers": 3, "kv_lora_rank": 128, "qk_rope_head_dim": 32}})
    d = _json(["--model", str(wrapped), "--tokens", "10", *PATH], capsys)
    assert d["payload_bytes"] == 3 * 10 * 160 * 2 and d["mha_equivalent_bytes"] is None
    # a transformers model type (deepseek_v3) read the same way
    v3 = _model_dir(tmp_path / "v3", {**KIMI_CONFIG, "model_type": "deepseek_v3", "num_attention_heads": 128})
    assert planner.model_kv_shape(str(v3)).mla == MLAShape(512, 64, 128, 128, 128)


def test_a_bad_mla_field_is_one_line_naming_it(tmp_path, capsys):
    bad = _model_dir(tmp_path / "bad", {**KIMI_CONFIG, "qk_rope_head_dim": "64"})
    err = _error(["--model", str(bad), "--tokens", "10", *PATH], capsys)
    assert "qk_rope_head_dim" in err and "config.json" in err


@pytest.mark.parametrize("name", ["deepseek-v3", "random:deepseek-v3", "kimi-k2", "random:deepseek-v2-lite"])
def test_shape_aliases_do_not_load(name):
    from blend.model.loading import load_model

    with pytest.raises(ValueError, match=r"MLA \(multi-head latent attention.*does not run.*kvblend plan"):
        load_model(name, device="cpu")


def test_a_local_mla_model_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    from blend.model import loading

    def no_hashing(*_args):
        raise AssertionError("hashed the weights of a model that cannot run")

    monkeypatch.setattr(loading, "_file_digest", no_hashing)
    kimi = _model_dir(tmp_path / "kimi", KIMI_CONFIG)
    with pytest.raises(ValueError, match=r"'kimi_k2' uses MLA"):
        loading.load_model(str(kimi), device="cpu")


def test_ask_on_an_mla_alias_is_one_line(tmp_path, monkeypatch, capsys):
    from blend.cli import main

    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVBLEND_CONFIG", raising=False)
    monkeypatch.setenv("KVBLEND_MODEL", "deepseek-v3")
    (tmp_path / "c.yaml").write_text("store:\n  tiers:\n    - {kind: cpu, budget: 64MiB}\n")
    assert main(["ask", "--config", str(tmp_path / "c.yaml"), "--question", "q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uses MLA" in err[0] and "kvblend plan" in err[0], err


WORKED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "8192", "--read-mibps", "450",
          "--read-iops", "20000", "--io-block", "16KiB", "--prefill-tokens-per-s", "2000"]


def test_mha_plans_are_as_before(capsys):
    """The worked example's human output line for line as before MLA, and its JSON with the new
    fields: attention mha, the MHA equivalent = the payload, one rank."""
    assert _run(WORKED) == 0
    assert capsys.readouterr().out.splitlines() == [
        "KV per token       : 131072 B (128 KiB)",
        "payload            : 1073741824 B (1 GiB) for 8192 tokens",
        "stage storage      : 312.5 MiB/s (limited by 20000 IOPS x 16 KiB)  <- bottleneck",
        "path bandwidth     : 312.5 MiB/s",
        "t_load_min         : 3.277 s",
        "t_prefill          : 4.096 s at 2000 tokens/s (given)",
        "recommended ratio  : 0.8 (r_min 0.15)",
        "verdict            : load",
    ]
    d = _json(WORKED, capsys)
    assert all(k in d for k in NEW_FIELDS)
    assert (d["kv_bytes_per_token"], d["payload_bytes"], d["uniform_payload_bytes"]) == (131072, 2**30, 2**30)
    assert d["attention"] == "mha" and d["latent_dim"] is None and d["rope_head_dim"] is None
    assert d["bytes_per_token"] == d["mha_equivalent_bytes_per_token"] == 131072
    assert d["mha_equivalent_bytes"] == 2**30 and d["bytes_per_rank"] == 2**30


def test_hybrid_plans_say_hybrid(capsys):
    d = _json(["--model", "random:gemma-3-4b", "--tokens", "8192", *PATH], capsys)
    per_layer_token = 2 * 4 * 256 * 2
    assert d["attention"] == "hybrid" and d["layers_by_type"] == {"full": 5, "sliding": 29}
    assert d["payload_bytes"] == per_layer_token * (5 * 8192 + 29 * 1024)  # as before
    assert d["mha_equivalent_bytes"] == d["uniform_payload_bytes"] == 34 * 8192 * per_layer_token
    d = _json(["--model", "random:llama-3-8b", "--tokens", "100", *PATH], capsys)
    assert d["attention"] == "mha" and d["payload_bytes"] == 100 * 131072


def test_plan_inputs_refuse_both_shapes():
    with pytest.raises(ValueError, match="not both"):
        plan(PlanInputs(layers=61, kv_heads=8, head_dim=None, dtype_bytes=2, tokens=8, prefill_tokens_per_s=1.0,
                        link_gibps=1, mla=MLAShape(512, 64)))
    with pytest.raises(ValueError, match="--kv-lora-rank"):
        plan(PlanInputs(layers=61, kv_heads=None, head_dim=None, dtype_bytes=2, tokens=8, prefill_tokens_per_s=1.0,
                        link_gibps=1, mla=MLAShape(0, 64)))


def test_store_stats_gives_no_bytes_for_an_mla_model(tmp_path):
    """Not the K/V bytes of its 128 heads (the codecs cannot hold an MLA cache; the engine never runs one)."""
    from blend.cli.store import bytes_per_token
    from blend.config import EngineConfig

    v3 = _model_dir(tmp_path / "v3", {**KIMI_CONFIG, "model_type": "deepseek_v3", "num_attention_heads": 128})
    for model in (str(v3), "deepseek-v3"):
        config = EngineConfig.from_mapping({"model": model, "store": {"tiers": [{"kind": "cpu"}]}})
        assert set(bytes_per_token(config).values()) == {None}


def test_readme_mla_rows_are_the_codec_sizes():
    """The MLA rows of docs/STORAGE.md ("Sizing a cache"): KiB per token (512-token blocks, float16) per
    codec and the 512-token documents a 20GiB tier holds, computed as the MHA rows are (int8 / int4:
    `mla_layer_nbytes`)."""
    text = (ROOT / "docs" / "STORAGE.md").read_text()
    rows = {"DeepSeek-V2-Lite (MLA, 27 layers)": 27, "DeepSeek-V2 (MLA, 60 layers)": 60,
            "DeepSeek-V3, Kimi-K2 (MLA, 61 layers)": 61}
    for label, layers in rows.items():
        row = re.search(rf"^\| {re.escape(label)} \| (.+) \|$", text, re.M)
        assert row, label
        cells = [c.strip() for c in row.group(1).split("|")]
        block = [CODECS[c].mla_layer_nbytes(512, 512, 64, "float16") * layers for c in ("none", "int8", "int4")]
        assert cells[:3] == [f"{b / 512 / 1024:.1f} KiB" for b in block]
        assert cells[3] == " / ".join(f"{round(20 * 2**30 / b):,}" for b in block)
    assert CODECS["none"].mla_layer_nbytes(512, 512, 64, "float16") == 512 * 576 * 2
    assert CODECS["int8"].mla_layer_nbytes(512, 512, 64, "float16") == 512 * 512 + 512 * 2 + 512 * 64 + 4 * 64 * 4


def test_mla_shapes_are_the_published_models():
    """Built on the meta device (nothing allocated), each shape has its published size: DeepSeek-V2-Lite
    15.7B parameters, V2 236B, V3 671B (without its multi-token-prediction layer), Kimi-K2 1.03T."""
    import torch
    from transformers import AutoModelForCausalLM

    from blend.model.loading import random_config

    for name, billions in (("deepseek-v2-lite", 15.7), ("deepseek-v2", 235.7), ("deepseek-v3", 671.0),
                           ("kimi-k2", 1026.4)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(random_config(name))
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05), name
