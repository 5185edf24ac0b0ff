"""`kvblend bench decode`: the time of one decode step after a prefill of N tokens, for B
sequences decoding together (`Runner.decode_step`, the step the scheduler repeats).

Method: per context length, one prompt of that many tokens (the shipped sample text,
repeated as needed) is prefilled once; each batch size then decodes from B copies of that
cache (the same work as B different prompts of that length: attention reads every
sequence's own keys), feeding each sequence its own greedy token. `warmup` steps are run
untimed, then `repeats` rounds of `steps` steps; a round's time per step is its mean, and
the reported `ms_per_step` is the median of the rounds (min and max beside it).
`tokens_per_s` = batch / step time; `batch_speedup` is tokens/s against batch 1 at the same
context (when batch 1 is measured). `gb_per_s` prices one step as the bytes it must read
at least (the layers' and the LM head's weights once, every sequence's K/V) over its
time: the memory bandwidth the step achieves.

Weights: `weights_bytes_read_per_token` is what a batch-1 step reads of the weights (the
quantized blocks where the runner reads them, else the dense copies), each row's
`weights_bytes_per_step` what that batch's step reads; `weights_resident_bytes` is what the
process holds in each form at the end (the model's own tensors, the dense copies built, the
blocks). `--peer-llamacpp PATH` runs llama.cpp's `llama-bench` on the same GGUF at each
context as its depth, with the same threads, after ours (`peer_llamacpp`).

Hygiene: the load average at start, peak and end (`contended`), a fixed matrix product's
rate at start and end and the widest spread of one setting's rounds (`unsteady`), as every
bench here (eval/bench/common.py).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eval.bench.common import LoadWatch, Steadiness

DEFAULT_CONTEXTS = (1024, 4096)
DEFAULT_BATCHES = (1, 8)


@dataclass(frozen=True)
class DecodeSettings:
    """What one `bench decode` run measures (validated by `check`)."""

    context_tokens: tuple[int, ...] = DEFAULT_CONTEXTS
    batches: tuple[int, ...] = DEFAULT_BATCHES
    steps: int = 16  # decode steps per timed round
    repeats: int = 3  # timed rounds per setting
    warmup: int = 2  # untimed steps per setting

    def check(self, max_positions: int) -> None:
        """ValueError naming the flag when a setting cannot run on a model of `max_positions`."""
        for name, value in (("--steps", self.steps), ("--repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.context_tokens or not self.batches:
            raise ValueError("give at least one --context-tokens and one --batch")
        longest = max(self.context_tokens) + self.warmup + self.steps * self.repeats
        if longest > max_positions:
            raise ValueError(f"--context-tokens {max(self.context_tokens)} plus {longest - max(self.context_tokens)} "
                             f"decoded tokens needs {longest} positions, more than the model's {max_positions}; "
                             "use a shorter context or fewer --steps / --repeats")


@dataclass(frozen=True)
class DecodeRow:
    """One (context, batch) setting's result; `to_dict` is the JSON row."""

    context_tokens: int
    batch: int
    ms_per_step: float
    ms_per_step_min: float
    ms_per_step_max: float
    tokens_per_s: float
    dtype: str
    kv_bytes_per_step: int
    gb_per_s: float
    batch_speedup: float | None = None
    weights_bytes_per_step: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PeerRow:
    """llama.cpp's `llama-bench` token generation at one depth (its tg: `steps` tokens after a
    context of `context_tokens`, `threads` threads, flash attention, mean of `repeats`)."""

    context_tokens: int
    threads: int
    ms_per_token: float
    tokens_per_s: float
    tokens_per_s_stddev: float
    repack: bool = True  # False: run with `--repack 0` (its AMX / repacked weights died with SIGILL)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PEER_TIMEOUT_S = 1800


def run_llama_bench(binary: str, gguf: Path, contexts: Sequence[int], threads: int, steps: int, repeats: int
                    ) -> list[PeerRow]:
    """`binary -m gguf -t threads -p 0 -n steps -d N -fa 1 -r repeats -o json` for every N of
    `contexts` in one run; ValueError saying what failed (not runnable, no JSON). A build whose
    extra weight layouts die with SIGILL (seen: its AMX kernels on a Xeon with AMX under
    Firecracker, `tileloadd` in an OpenMP worker) runs again with `--repack 0`: its plain CPU
    kernels, the rows marked `repack` False."""
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(steps),
           "-d", ",".join(str(n) for n in contexts), "-fa", "1", "-r", str(repeats), "-o", "json"]
    done = _run_peer(binary, cmd)
    repack = True
    if done.returncode == -signal.SIGILL:
        repack = False
        done = _run_peer(binary, [*cmd, "--repack", "0"])
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"--peer-llamacpp: {binary} exited {done.returncode}: {last}")
    try:
        tests = json.loads(done.stdout)
        return [PeerRow(int(t["n_depth"]), int(t["n_threads"]), round(int(t["avg_ns"]) / int(t["n_gen"]) / 1e6, 3),
                        round(float(t["avg_ts"]), 2), round(float(t["stddev_ts"]), 2), repack) for t in tests]
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        raise ValueError(f"--peer-llamacpp: {binary} did not print llama-bench's JSON ({err})") from None


def _run_peer(binary: str, cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as err:
        raise ValueError(f"--peer-llamacpp: {binary} did not run: {err}") from None


def check_peer(binary: str | None) -> None:
    """ValueError naming the flag when `binary` is given but is not an executable file."""
    import os

    if binary is not None and not (Path(binary).is_file() and os.access(binary, os.X_OK)):
        raise ValueError(f"--peer-llamacpp {binary}: not an executable file (build llama-bench as "
                         "../shared/peer/llamacpp.sh does and give its path)")


def resident_bytes(runner: Any) -> dict[str, int]:
    """Bytes of the weights the process holds, by form: the model's own tensors (`model`),
    the dense copies built beside them (`dense_copies`), the quantized blocks as the GGUF stores
    them (`blocks`), their packed copy the kernel reads (`packed_blocks`, AVX-512 VNNI or AVX2), `total`."""
    seen: set[int] = set()
    model = 0
    for p in list(runner.lm.model.parameters()) + list(runner.lm.model.buffers()):
        ptr = p.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            model += p.untyped_storage().nbytes()
    proj = runner.projections
    dense = proj.nbytes() if proj is not None else 0
    blocks = runner.lm.blocks.nbytes if proj is not None and proj.block_layers() and runner.lm.blocks else 0
    packed = proj.packed_nbytes() if proj is not None else 0
    return {"model": model, "dense_copies": dense, "blocks": blocks, "packed_blocks": packed,
            "total": model + dense + blocks + packed}


def step_weight_bytes(runner: Any, batch: int) -> int:
    """Weight bytes one decode step of `batch` rows reads: the runner's products (blocks or
    dense, as they pick for that many rows), else the model's layers and LM head."""
    proj = runner.projections
    return proj.read_bytes(batch) if proj is not None else weight_bytes(runner.lm)


def context_ids(tokenizer: Any, n: int) -> torch.Tensor:
    """(n,) token ids of the shipped sample documents, repeated until there are n."""
    from eval.samples import sample_documents

    text = "\n\n".join(body for _, body in sample_documents())
    ids = tokenizer(text, add_special_tokens=False).input_ids
    reps = -(-n // len(ids))
    return torch.tensor((ids * reps)[:n])


def time_steps(step: Callable[[], None], rounds: int, steps: int, sync: Callable[[], None]) -> list[float]:
    """Seconds per step of each of `rounds` rounds of `steps` calls of `step` (its mean)."""
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        out.append((time.perf_counter() - t0) / steps)
    return out


def weight_bytes(lm: Any) -> int:
    """Bytes of the weights one decode step reads: every layer's and the LM head's (the
    embedding rows it gathers are negligible)."""
    model = lm.model
    head = model.lm_head.weight
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    return layers + head.numel() * head.element_size()


def measure_decode(runner: Any, settings: DecodeSettings, log: Callable[[str], None] = lambda _: None
                   ) -> list[DecodeRow]:
    """Every (context, batch) setting of `settings` on `runner` (see the module doc)."""
    lm = runner.lm
    dtype = str(runner.dtype).removeprefix("torch.")
    settings.check(runner.max_positions)
    device = runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_token_kv = lm.dims.kv_bytes_per_token(torch.empty(0, dtype=runner.dtype).element_size())
    extra = settings.warmup + settings.steps * settings.repeats
    rows: list[DecodeRow] = []
    for n in settings.context_tokens:
        prompt = runner.new_cache(n + extra)
        t0 = time.perf_counter()
        first = int(runner.prefill(context_ids(lm.tokenizer, n), prompt)[0].argmax())
        log(f"context {n}: prefilled in {time.perf_counter() - t0:.2f} s")
        single: float | None = None
        for batch in settings.batches:
            caches = [_copy(runner, prompt, n + extra) for _ in range(batch)]
            tokens = [first] * batch

            def step(caches: Sequence[Any] = caches, tokens: list[int] = tokens) -> None:
                logits = runner.decode_step(tokens, caches)  # (B, vocab)
                tokens[:] = logits.argmax(dim=-1).tolist()

            if settings.warmup:
                time_steps(step, 1, settings.warmup, sync)
            seconds = time_steps(step, settings.repeats, settings.steps, sync)
            mid = statistics.median(seconds)
            tokens_per_s = batch / mid
            mean_context = n + settings.warmup + settings.steps * settings.repeats / 2
            kv = int(per_token_kv * mean_context * batch)
            weights = step_weight_bytes(runner, batch)
            if batch == 1:
                single = tokens_per_s
            row = DecodeRow(n, batch, round(mid * 1e3, 3), round(min(seconds) * 1e3, 3), round(max(seconds) * 1e3, 3),
                            round(tokens_per_s, 2), dtype, kv, round((weights + kv) / mid / 1e9, 2),
                            round(tokens_per_s / single, 2) if single else None, weights)
            rows.append(row)
            log(f"context {n:>6}  batch {batch:>3}  {row.ms_per_step:8.2f} ms/step  {row.tokens_per_s:8.1f} tokens/s"
                + (f"  {row.batch_speedup:.2f}x batch 1" if row.batch_speedup and batch > 1 else "")
                + f"  {row.gb_per_s} GB/s")
            del caches
    return rows


def _copy(runner: Any, cache: Any, capacity: int) -> Any:
    """A new cache of `runner` holding the same K/V as `cache` (filled to its length), room
    for `capacity` positions."""
    n = cache.length
    out = runner.new_cache(capacity)
    for dst, src in zip(out.k + out.v, cache.k + cache.v, strict=True):
        dst[:, :n] = src[:, :n]
    out.length = n
    return out


def run_decode_bench(config: Any, settings: DecodeSettings, log: Callable[[str], None] = lambda _: None,
                     peer: str | None = None) -> dict[str, Any]:
    """Load the config's model and measure every setting; the JSON summary (`results`: one
    row per (context, batch), plus the run's facts and hygiene fields). `peer`: llama.cpp's
    llama-bench, run after ours on the model's GGUF at the same contexts and threads
    (`peer_llamacpp`; ValueError for a model that is not a GGUF)."""
    from blend.model.loading import gguf_path, load_model
    from blend.model.native import decode_kernel_name, qpack_path, quant_kernel_path
    from blend.model.runner import Runner

    check_peer(peer)
    gguf = gguf_path(config.model) if peer is not None else None
    if peer is not None and gguf is None:
        raise ValueError(f"--peer-llamacpp: {config.model} is not a GGUF model; llama.cpp needs one")

    watch = LoadWatch.begin()
    steady = Steadiness.begin()
    lm = load_model(config.model, device=config.device, dtype=config.dtype, weights=config.weights)
    settings.check(lm.dims.max_positions)
    runner = Runner(lm)
    rows = measure_decode(runner, settings, log)
    peers: list[PeerRow] = []
    if peer is not None and gguf is not None:
        log(f"llama.cpp: {peer} on {gguf.name}, {torch.get_num_threads()} threads")
        peers = run_llama_bench(peer, gguf, settings.context_tokens, torch.get_num_threads(), settings.steps,
                                settings.repeats)
        ours = {r.context_tokens: r for r in rows if r.batch == 1}
        for p in peers:
            mine = ours.get(p.context_tokens)
            log(f"context {p.context_tokens:>6}  batch   1  llama.cpp {p.ms_per_token:8.2f} ms/token"
                + ("" if p.repack else " (--repack 0)")
                + (f"  kvblend {mine.ms_per_step:.2f} ms/token ({mine.ms_per_step / p.ms_per_token:.2f}x)"
                   if mine else ""))
    spreads = {f"context {r.context_tokens} batch {r.batch}": (r.ms_per_step, r.ms_per_step_min, r.ms_per_step_max)
               for r in rows}
    return {
        "model": config.model, "random_weights": bool(lm.random_weights), "dtype": str(lm.dtype).removeprefix("torch."),
        "config_dtype": config.dtype, "device": str(lm.device), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "projections": runner.projections.layout if runner.projections is not None else None,
        "weights": runner.projections.weights if runner.projections is not None else "dequantized",
        "quant_kernel": (None if lm.device.type != "cpu" else f"{qpack_path()}, packed"
                         if runner.projections is not None and runner.projections.packed_nbytes()
                         else quant_kernel_path()),
        "weights_bytes_read_per_token": step_weight_bytes(runner, 1),
        "weights_resident_bytes": resident_bytes(runner),
        "peer_llamacpp": [p.to_dict() for p in peers],
        "decode_kernel": decode_kernel_name() if lm.device.type == "cpu" else None,
        "weight_bytes": weight_bytes(lm), "steps": settings.steps, "repeats": settings.repeats,
        "warmup": settings.warmup, "results": [r.to_dict() for r in rows],
        **steady.finish(spreads, "decode benchmark"), **watch.finish("decode benchmark"),
    }
