"""Config models: key-path errors (one line each), byte sizes, the tier union, frozen
dataclasses that `dataclasses.replace` re-validates, the packaged default, relative paths,
KVBLEND_* overrides, the secret kept out of reprs and JSON, and the tier registry."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from blend.config import (
    ENGINE_GROUPS,
    GROUP_OF,
    BlendConfig,
    BlendSettings,
    CheckLayerSelection,
    EngineConfig,
    GenerationSettings,
    QuerySelection,
    SchedulerSettings,
    SessionSettings,
    apply_env,
    kvblend_home,
    load_config,
)
from storage.config import (
    TIER_CONFIGS,
    CpuTierConfig,
    DiskTierConfig,
    RedisClusterTierConfig,
    RedisTierConfig,
    StoreConfig,
    load_yaml,
    tier_config_class,
)
from tests.models import home_sharing

ROOT = Path(__file__).resolve().parents[1]
ENV = ("KVBLEND_CONFIG", "KVBLEND_HOME", "XDG_CACHE_HOME", "KVBLEND_MODEL", "KVBLEND_DEVICE", "KVBLEND_DTYPE",
       "KVBLEND_RECOMPUTE_RATIO", "KVBLEND_REDIS_URL", "KVBLEND_STORE_SECRET")
SECRET = "s3cr3t-value-0123456789"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("store:\n  tiers:\n    - {kind: cpu}\n    - {kind: disk, path: d, budget: 0}\n",
     "store.tiers[1].budget: must be > 0, got 0"),
    ("store:\n  tiers:\n    - {kind: cpu, budgte: 1GiB}\n",
     "store.tiers[0]: unknown key 'budgte'; did you mean 'budget'? valid keys are: budget, codec, exact_codec, kind, name"),
    ("store:\n  tiers:\n    - {kind: s3}\n", "store.tiers[0]: unknown kind 's3'; valid kinds are: cpu, disk, redis, redis-cluster"),
    ("store:\n  tiers:\n    - {budget: 1GiB}\n", "store.tiers[0]: missing `kind`; valid kinds are: cpu, disk"),
    ("store:\n  tiers:\n    - {kind: disk}\n", "store.tiers[0]: missing required key 'path'"),
    ("engine: [1, 2]\n", "engine: expected a mapping, got [1, 2]"),
    ("store: 5\n", "store: expected a mapping, got 5"),
    ("device: banana\n", "device: unknown device 'banana'; use auto, cpu, cuda"),
    ("engine:\n  sessions:\n    idle_seconds: -5\n", "engine.sessions.idle_seconds: must be >= 0"),
    ("engine:\n  blend:\n    recompute_ratio: .nan\n", "engine.blend.recompute_ratio: expected a finite number, got nan"),
    ("engine:\n  blend:\n    recompute_ratio: true\n", "engine.blend.recompute_ratio: expected a number, got True"),
    ("engine:\n  blend:\n    chunk_tokens: '512'\n", "engine.blend.chunk_tokens: expected an integer, got '512'"),
    ("engine:\n  blend:\n    selection:\n      check_layers: [1, 1]\n", "engine.blend.selection: check_layers must be increasing"),
    ("engine:\n  check_layers: [1]\n", "engine: unknown key 'check_layers'; it belongs under `blend.selection:`"),
    ("engine:\n  blend:\n    check_layers: [1]\n", "engine.blend: unknown key 'check_layers'; it belongs under `selection:`"),
    ("engine:\n  scheduler: 4\n", "engine.scheduler: expected a mapping, got 4"),
    ("engine:\n  chunk_tokenz: 3\n", "engine: unknown key 'chunk_tokenz'; did you mean 'chunk_tokens' under `blend:`?"),
    ("engine:\n  blend:\n    selection:\n      policy: hybrid\n      query_pool: 2.0\n",
     "engine.blend.selection: unknown key 'query_pool'; valid keys are: check_layers, deviation, filter_schedule, policy"),
    ("engine:\n  blend:\n    selection:\n      policy: nope\n",
     "engine.blend.selection: unknown policy 'nope'; valid policies are: query"),
    ("store:\n  kv_dtype: int8\n", "store.kv_dtype: must be one of 'float32', 'bfloat16' or 'float16', got 'int8'"),
    ("store:\n  namespace: .x\n", "store.namespace: namespace '.x' must be up to 64 characters"),
    ("store:\n  tiers:\n    - {kind: redis, url: 'http://h'}\n", "store.tiers[0].url: 'http://h' is not a Redis URL"),
    ("store:\n  tiers:\n    - {kind: redis, url: 'redis://h:99999'}\n",
     "store.tiers[0].url: 'redis://h:99999': the host or port is not valid (a port is 1..65535)"),
    ("store:\n  tiers:\n    - {kind: redis-cluster, urls: ['redis://:pw@h:abc']}\n",
     "store.tiers[0].urls[0]: 'redis://:***@h:abc': the host or port is not valid"),
    ("store:\n  tiers:\n    - {kind: cpu, budget: 2 lots}\n", "store.tiers[0].budget: cannot parse '2 lots' as a byte size"),
    ("modle: x\n", "unknown key 'modle'; did you mean 'model'? valid keys are: device, dtype, engine, model, store"),
])
def test_errors_name_the_file_and_key_path_on_one_line(tmp_path, text, expected):
    message = error_of(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'c.yaml'}: ") and expected in message
    assert "\n" not in message and "pydantic" not in message


def test_several_problems_give_one_line_each(tmp_path):
    lines = error_of(tmp_path, "device: banana\nengine:\n  blend:\n    chunk_tokens: 0\n  generation:\n    top_p: 2\n"
                     ).splitlines()
    assert len(lines) == 3
    assert all(line.startswith(str(tmp_path / "c.yaml")) for line in lines)
    assert {line.split(": ")[1] for line in lines} == {"device", "engine.blend.chunk_tokens", "engine.generation.top_p"}


def test_yaml_problems_are_one_line_naming_the_file(tmp_path):
    for text, expected in (("a: [\n", "invalid YAML at line 2"), ("- 1\n", "top level of a config must be a mapping"),
                           ("1: 2\n", "key 1 is not a name")):
        with pytest.raises(ValueError, match=expected) as info:
            load_yaml(write(tmp_path, text))
        assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)
    (tmp_path / "latin1.yaml").write_bytes(b"model: caf\xe9\n")
    with pytest.raises(ValueError, match="latin1.yaml: not UTF-8"):
        load_yaml(tmp_path / "latin1.yaml")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_yaml(tmp_path)
    assert load_yaml(write(tmp_path, "# only a comment\n")) == {}
    with pytest.raises(ValueError, match="nested too deeply"):
        load_yaml(write(tmp_path, "model: " + "[" * 20000 + "\n"))


LAUGHS = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))  # 9**9 values from 1 KB


def test_yaml_aliases_are_bounded_once_expanded(tmp_path):
    for text in (LAUGHS, "a: &a [1, *a]\n", "engine: &e {x: [" + ", ".join(["1"] * 10_001) + "]}\n"):
        with pytest.raises(ValueError, match=r"c.yaml: expands to more than 10000 values .*aliases") as info:
            load_yaml(write(tmp_path, text))
        assert "\n" not in str(info.value)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ValueError, match="too large for a config"):
        load_yaml(big)
    # an alias in a normal config is fine: the value is shared
    assert load_yaml(write(tmp_path, "a: &d {kv_dtype: float16}\nb: *d\n")) == {"a": {"kv_dtype": "float16"},
                                                                               "b": {"kv_dtype": "float16"}}


def test_byte_sizes_and_strict_numbers():
    cfg = StoreConfig.from_mapping({"tiers": [{"kind": "cpu", "budget": "1.5GiB"}, {"kind": "disk", "path": "d",
                                                                                      "budget": 4096}]})
    assert cfg.tiers[0].budget == 3 * 2**29 and cfg.tiers[1].budget == 4096
    assert BlendSettings(recompute_ratio=1).recompute_ratio == 1.0  # an int is a number
    for cls, bad in ((BlendSettings, {"recompute_ratio": True}), (BlendSettings, {"recompute_ratio": "0.1"}),
                     (BlendSettings, {"chunk_tokens": 1.0}), (GenerationSettings, {"temperature": float("inf")})):
        with pytest.raises(ValueError, match=f"{cls.__name__}: {next(iter(bad))}: "):
            cls(**bad)


def test_frozen_dataclasses_that_replace_revalidates():
    cfg = StoreConfig()
    assert [f.name for f in dataclasses.fields(cfg)][:3] == ["namespace", "kv_dtype", "tiers"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.write_queue = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg, write_queue=3).write_queue == 3
    with pytest.raises(ValueError, match="StoreConfig: write_queue: must be >= 1, got 0"):
        dataclasses.replace(cfg, write_queue=0)
    with pytest.raises(ValueError, match="kind: must be one of 'cpu'"):
        CpuTierConfig(kind="disk")  # type: ignore[arg-type]


def test_tier_union_and_registry():
    assert list(TIER_CONFIGS) == ["cpu", "disk", "redis", "redis-cluster"]
    assert tier_config_class("redis") is RedisTierConfig
    with pytest.raises(ValueError, match="valid kinds are: cpu, disk, redis, redis-cluster"):
        tier_config_class("s3")
    cfg = StoreConfig.from_mapping({"tiers": [{"kind": "redis-cluster", "urls": ["redis://h:7000"]}]})
    assert isinstance(cfg.tiers[0], RedisClusterTierConfig) and cfg.tiers[0].urls == ("redis://h:7000",)
    from storage.tier import tier_class

    assert [tier_class(k).__name__ for k in TIER_CONFIGS] == ["CpuTier", "DiskTier", "RedisTier", "RedisClusterTier"]


def run_python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_loading_a_config_imports_neither_torch_nor_redis(tmp_path):
    # a selection policy and its knobs are checked without blend.recompute (which imports torch)
    path = write(tmp_path, "engine:\n  blend:\n    chunk_tokens: 64\n    selection: {policy: hybrid, deviation: kv}\n"
                           "store:\n  tiers:\n    - {kind: cpu}\n"
                           "    - {kind: redis-cluster, urls: [redis://h:7000]}\n")
    out = run_python(
        "import sys\n"
        "from blend.config import load_config\n"
        f"load_config({str(path)!r}); load_config()\n"
        "print(sorted(m for m in ('torch', 'redis', 'transformers') if m in sys.modules))\n")
    assert out.strip() == "[]"


def test_a_cpu_and_disk_store_does_not_import_redis(tmp_path):
    out = run_python(
        "import sys\n"
        "from storage.config import StoreConfig, CpuTierConfig, DiskTierConfig\n"
        "from storage.stack import TieredStore\n"
        f"TieredStore.from_config(StoreConfig(tiers=(CpuTierConfig(), DiskTierConfig(path={str(tmp_path / 'd')!r})))).close()\n"
        "print('redis' in sys.modules)\n")
    assert out.strip() == "False"


def test_packaged_default_lives_under_kvblend_home(tmp_path, monkeypatch):
    cfg = load_config()
    assert [t.kind for t in cfg.store.tiers] == ["cpu", "disk"]
    assert cfg.store.tiers[1].path == str(tmp_path / "home" / "disk")
    assert cfg.engine.sessions.sessions_dir == str(tmp_path / "home" / "sessions")
    assert cfg == EngineConfig() and not (tmp_path / "home").exists()  # nothing created
    monkeypatch.delenv("KVBLEND_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kvblend_home() == tmp_path / "xdg" / "kvblend"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kvblend_home() == Path.home() / ".cache" / "kvblend"


def test_relative_paths_resolve_against_the_config_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    path = write(conf, "engine:\n  sessions:\n    sessions_dir: s\nstore:\n  tiers:\n    - {kind: disk, path: ../cache/d}\n"
                       "    - {kind: disk, name: abs, path: /tmp/abs-kv}\n")
    monkeypatch.chdir("/")  # not the config's directory
    cfg = load_config(path)
    assert cfg.engine.sessions.sessions_dir == str(conf / "s")
    assert Path(cfg.store.tiers[0].path).resolve() == tmp_path / "cache" / "d"
    assert cfg.store.tiers[1].path == "/tmp/abs-kv"
    shipped = load_config(ROOT / "configs" / "default.yaml")
    assert Path(shipped.store.tiers[1].path).resolve() == ROOT / ".kvblend-cache" / "disk"


def test_disk_path_that_is_a_file_is_rejected(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"store.tiers\[0\].path: .* exists and is not a directory"):
        load_config(write(tmp_path, f"store:\n  tiers:\n    - {{kind: disk, path: {tmp_path / 'f'}}}\n"))


def test_environment_overrides(tmp_path, monkeypatch):
    path = write(tmp_path, "model: a\ndevice: cpu\nstore:\n  tiers:\n    - {kind: cpu}\n")
    monkeypatch.setenv("KVBLEND_CONFIG", str(path))
    assert load_config().model == "a"
    monkeypatch.setenv("KVBLEND_MODEL", "b")
    monkeypatch.setenv("KVBLEND_DTYPE", "bfloat16")
    monkeypatch.setenv("KVBLEND_RECOMPUTE_RATIO", "0.3")
    monkeypatch.setenv("KVBLEND_REDIS_URL", "redis://cache:6380/1")
    cfg = load_config()
    assert (cfg.model, cfg.device, cfg.dtype, cfg.engine.blend.recompute_ratio) == ("b", "cpu", "bfloat16", 0.3)
    assert [t.kind for t in cfg.store.tiers] == ["cpu", "redis"] and cfg.store.tiers[1].url == "redis://cache:6380/1"
    assert load_config(recompute_ratio=0.5).engine.blend.recompute_ratio == 0.5  # explicit overrides win
    redis_cfg = apply_env(load_config(ROOT / "configs" / "redis.yaml"))
    assert [t.kind for t in redis_cfg.store.tiers] == ["cpu", "disk", "redis"]  # the configured tier is repointed
    assert redis_cfg.store.tiers[2].url == "redis://cache:6380/1"
    for var, value, expected in (("KVBLEND_DEVICE", "banana", "KVBLEND_DEVICE: device: unknown device"),
                                 ("KVBLEND_RECOMPUTE_RATIO", "lots", "KVBLEND_RECOMPUTE_RATIO: expected a number"),
                                 ("KVBLEND_RECOMPUTE_RATIO", "1.5", "KVBLEND_RECOMPUTE_RATIO: recompute_ratio: must be <= 1"),
                                 ("KVBLEND_REDIS_URL", "http://x", "KVBLEND_REDIS_URL: url: 'http://x' is not a Redis URL")):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(ValueError, match=expected):
                load_config()
    monkeypatch.setenv("KVBLEND_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError, match="KVBLEND_CONFIG: config file .* not found"):
        load_config()


def test_secret_is_never_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_STORE_SECRET", SECRET)
    cfg = load_config()
    assert cfg.store.secret == SECRET
    shown = repr(cfg) + str(cfg.store) + json.dumps(cfg.to_dict()) + json.dumps(cfg.store.to_dict())
    assert SECRET not in shown and cfg.to_dict()["store"]["secret"] == "<redacted>"
    from_file = load_config(write(tmp_path, f"store:\n  secret: {SECRET}\n"))
    assert from_file.store.secret == SECRET and SECRET not in repr(from_file)
    monkeypatch.setenv("KVBLEND_STORE_SECRET", "short")
    with pytest.raises(ValueError, match="KVBLEND_STORE_SECRET: secret: must be at least 16 characters") as info:
        load_config()
    assert "short" not in str(info.value)


def test_overrides_reject_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="override: unknown key 'ratio'; valid keys are: .*recompute_ratio"):
        EngineConfig().with_overrides(ratio=0.3)
    with pytest.raises(ValueError, match="override: recompute_ratio: must be <= 1"):
        EngineConfig().with_overrides(recompute_ratio=1.5)
    with pytest.raises(ValueError, match=r"override: store: tiers\[0\]: unknown kind"):
        EngineConfig().with_overrides(store={"tiers": [{"kind": "tape"}]})
    cfg = EngineConfig().with_overrides(check_layers=[1, 2], filter_schedule=[2.0, 1.0], model="m")
    assert cfg.engine.blend.selection.check_layers == (1, 2) and cfg.model == "m"


def test_check_layers_beyond_the_model():
    def engine(selection: QuerySelection) -> BlendConfig:
        return BlendConfig(blend=BlendSettings(selection=selection))

    engine(QuerySelection(check_layers=(1, 3), filter_schedule=(1.5, 1.0))).check_model_layers(4)
    with pytest.raises(ValueError, match=r"engine.blend.selection.check_layers \[99\] is beyond the model's 4 layers"):
        engine(QuerySelection(check_layers=(99,))).check_model_layers(4)


def test_corrupt_model_config_json_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model: .*m/config.json: not a valid model config.json") as info:
        EngineConfig.from_mapping({"model": str(tmp_path / "m")}, where="c.yaml")
    assert "\n" not in str(info.value)


def test_shipped_configs_load(monkeypatch):
    for name in ("default.yaml", "redis.yaml", "redis-cluster.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.store.tiers[0].kind == "cpu" and cfg.engine.blend.chunk_tokens == 512
    assert DiskTierConfig(path="~/kv").path == str(Path.home() / "kv")


def test_a_bare_yaml_off_switches_the_split_off(tmp_path):
    def split(value: str) -> str:
        return load_config(write(tmp_path, f"engine:\n  blend:\n    split: {value}\n")).engine.blend.split

    assert split("off") == "off" and split("on") == "auto" and split("adaptive") == "adaptive"  # YAML: off -> False
    assert "engine.blend.split: must be one of 'auto', 'adaptive' or 'off'" in error_of(
        tmp_path, "engine:\n  blend:\n    split: maybe\n")


# ------------------------------------------------------------- the engine section's groups
# the engine section as it was written before its groups (every key), and the same values grouped
FLAT = """engine:
  chunk_tokens: 64
  max_document_tokens: 1024
  recompute_ratio: 0.3
  selection: {policy: hybrid, check_layers: [1, 2], filter_schedule: [1.5, 1.0], deviation: kv}
  prefetch_depth: 4
  load_stall_s: 2
  chunk_context: none
  split: off
  miss_policy: harvest
  recompute_harvested: false
  max_new_tokens: 7
  temperature: 0.5
  top_p: 0.9
  system_prompt: Be brief.
  query_template: "Q: {question}"
  sessions_dir: s
  idle_seconds: 5
  active_budget: 2MiB
  max_num_seqs: 3
  max_active_kv: 1GiB
  background_share: 0.2
  batch_invariant: false
  step_stretch: 4
"""
GROUPED = """engine:
  blend:
    chunk_tokens: 64
    max_document_tokens: 1024
    recompute_ratio: 0.3
    selection: {policy: hybrid, check_layers: [1, 2], filter_schedule: [1.5, 1.0], deviation: kv}
    prefetch_depth: 4
    load_stall_s: 2
    chunk_context: none
    split: off
    miss_policy: harvest
    recompute_harvested: false
  generation:
    max_new_tokens: 7
    temperature: 0.5
    top_p: 0.9
  prompt:
    system_prompt: Be brief.
    query_template: "Q: {question}"
  sessions:
    sessions_dir: s
    idle_seconds: 5
    active_budget: 2MiB
  scheduler:
    max_num_seqs: 3
    max_active_kv: 1GiB
    background_share: 0.2
    batch_invariant: false
    step_stretch: 4
    prefill_chunk_tokens: 128
"""


def test_every_engine_key_lives_in_one_group():
    assert list(ENGINE_GROUPS) == [f.name for f in dataclasses.fields(BlendConfig)]
    leaves = [f.name for cls in ENGINE_GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(leaves) == len(set(leaves)) == len(GROUP_OF)  # a flat name says where it lives


def test_the_grouped_layout_reads_typed_sections(tmp_path):
    cfg = load_config(write(tmp_path, GROUPED)).engine
    assert cfg.scheduler == SchedulerSettings(max_num_seqs=3, max_active_kv=1 << 30, background_share=0.2,
                                              batch_invariant=False, prefill_chunk_tokens=128, step_stretch=4.0)
    assert cfg.sessions == SessionSettings(sessions_dir=str(tmp_path / "s"), idle_seconds=5.0, active_budget=2 << 20)
    assert cfg.generation == GenerationSettings(max_new_tokens=7, temperature=0.5, top_p=0.9)
    assert (cfg.prompt.system_prompt, cfg.prompt.query_template) == ("Be brief.", "Q: {question}")
    assert cfg.blend.selection == CheckLayerSelection(policy="hybrid", check_layers=(1, 2), filter_schedule=(1.5, 1.0),
                                                      deviation="kv")
    assert (cfg.blend.chunk_tokens, cfg.blend.split, cfg.blend.miss_policy, cfg.blend.recompute_harvested) == (
        64, "off", "harvest", False)


def test_the_grouped_layout_round_trips(tmp_path):
    """to_dict() written back as YAML reads as the same config, for the shipped configs too."""
    yaml = pytest.importorskip("yaml")
    for source in (write(tmp_path, GROUPED), *(ROOT / "configs").glob("*.yaml")):
        cfg = load_config(source)
        data = cfg.to_dict()
        assert set(data["engine"]) == set(ENGINE_GROUPS)
        again = load_config(write(tmp_path, yaml.safe_dump(data), name="again.yaml"))
        assert again == cfg, source


def test_flat_engine_keys_are_read_with_one_deprecation_line_each(tmp_path, caplog):
    path = write(tmp_path, FLAT + "  prefill_chunk_tokens: 128\n", name="flat.yaml")
    with caplog.at_level("WARNING", logger="blend.config"):
        flat = load_config(path)
    assert flat == load_config(write(tmp_path, GROUPED))  # every key: the same value, in its group
    lines = [r.getMessage() for r in caplog.records]
    keys = [k for k in GROUP_OF if k not in ("prefill_chunk_tokens", "prefills_between_decodes")]  # (retired)
    assert len(lines) == len(keys)  # one each; engine.prefill_chunk_tokens (the name) without one
    for key in keys:
        assert f"{path}: engine.{key} is deprecated: write engine.{GROUP_OF[key]}.{key}" in lines
    assert "engine.scheduler.max_num_seqs" in " ".join(lines) and "\n" not in "".join(lines)
    assert "engine.max_num_seqs is deprecated: write engine.scheduler.max_num_seqs" in " ".join(lines)


def test_flat_and_grouped_keys_mix(tmp_path, caplog):
    text = "engine:\n  max_num_seqs: 2\n  scheduler:\n    max_active_kv: 4096\n  prefill_chunk_tokens: 64\n"
    with caplog.at_level("WARNING", logger="blend.config"):
        cfg = load_config(write(tmp_path, text)).engine.scheduler
    assert (cfg.max_num_seqs, cfg.max_active_kv, cfg.prefill_chunk_tokens) == (2, 4096, 64)
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "engine.max_num_seqs is deprecated: write engine.scheduler.max_num_seqs"]


@pytest.mark.parametrize("text, flat, grouped", [
    ("engine:\n  max_num_seqs: 2\n  scheduler:\n    max_num_seqs: 4\n", "engine.max_num_seqs",
     "engine.scheduler.max_num_seqs"),
    ("engine:\n  selection: deviation\n  blend:\n    selection: query\n", "engine.selection", "engine.blend.selection"),
    ("engine:\n  prefill_chunk_tokens: 8\n  scheduler:\n    prefill_chunk_tokens: 8\n",
     "engine.prefill_chunk_tokens", "engine.scheduler.prefill_chunk_tokens"),
])
def test_a_key_given_both_ways_is_a_one_line_error(tmp_path, text, flat, grouped):
    message = error_of(tmp_path, text)
    assert message == f"{tmp_path / 'c.yaml'}: {flat} and {grouped} are both given; keep only {grouped}"


def test_overrides_and_environment_set_keys_in_their_group(monkeypatch):
    cfg = EngineConfig().with_overrides(max_num_seqs=4, idle_seconds=1.0, max_new_tokens=5, system_prompt="S",
                                        chunk_tokens=32, prefill_chunk_tokens=16, sink_tokens=2)
    engine = cfg.engine
    assert (engine.scheduler.max_num_seqs, engine.scheduler.prefill_chunk_tokens) == (4, 16)
    assert (engine.sessions.idle_seconds, engine.generation.max_new_tokens, engine.prompt.system_prompt) == (1.0, 5, "S")
    assert (engine.blend.chunk_tokens, engine.blend.selection.sink_tokens) == (32, 2)
    with pytest.raises(ValueError, match="override: max_num_seqs: must be a whole number >= 1 or auto"):
        EngineConfig().with_overrides(max_num_seqs=0)
    monkeypatch.setenv("KVBLEND_MAX_NUM_SEQS", "6")
    monkeypatch.setenv("KVBLEND_PREFILL_CHUNK_TOKENS", "32")
    env = load_config().engine.scheduler
    assert (env.max_num_seqs, env.prefill_chunk_tokens) == (6, 32)


def test_a_flat_key_through_the_command_line_is_one_warning_line(tmp_path):
    path = write(tmp_path, "engine:\n  chunk_tokens: 16\n  scheduler:\n    max_num_seqs: 2\n"
                           "store:\n  tiers:\n    - {kind: cpu, budget: 64MiB}\n")
    out = subprocess.run([sys.executable, "-m", "blend.cli", "store", "stats", "--config", str(path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                              "KVBLEND_HOME": str(home_sharing(tmp_path / "h"))})
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        f"WARNING blend.config: {path}: engine.chunk_tokens is deprecated: write engine.blend.chunk_tokens"]
