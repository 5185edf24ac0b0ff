"""`kvblend bench resume`: time-to-first-token of resuming an offloaded conversation from
one tier, against re-prefilling its whole history.

For every requested history length a conversation is built from the shipped sample
documents (user turns carrying passages, short assistant acknowledgements) until its
chat-templated tokens reach the length. Its KV is computed once and stored as prefix
blocks in one engine per tier, each over a TieredStore holding only that tier and all
sharing one loaded model. A resume is a new user message in a fresh session carrying
that history and no device copy, so the prefix chain is loaded from exactly that tier
and only the tail is prefilled; a re-prefill is a full prefill of the same token ids.
Each message differs per repeat, so no block past the history is reused.

A model with sliding-window layers (Gemma 3) stores a conversation as its global layers'
blocks and its sliding layers' last window (blend.kv.windowed), which only a chat turn
writes: there the history's last turn is run once as a real turn (its reply replaces
the acknowledgement), so the resume point is that turn's prompt end. Each row then
also gives the bytes a resume moved against the uniform accounting of the same tokens
(`moved_bytes`, `uniform_bytes`, `moved_share`).

Hygiene: a warm-up per tier first (not recorded), then `--repeats` rounds interleaving
tiers, lengths and the two variants (alternating which goes first); medians are
reported with min and max, and the load average at start and end (`contended: true`
and a warning line when it exceeded the core count), and `unsteady: true` (a warning line) when
one setting's repeats spread by more than 25% or the CPU probe moved by as much
(`eval.bench.common.Steadiness`). Disk entries are evicted from the OS page cache before each disk resume
(fsync + POSIX_FADV_DONTNEED) unless `--warm-disk`, so the disk row measures a disk.
The last stdout line is one JSON object: {"results": [{tier, history_tokens,
resume_ttft_s, reprefill_ttft_s, speedup, ...}, ...]}; a tier that cannot be used
(e.g. Redis unreachable) gives rows with an `error` instead.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval.bench.common import LoadWatch, Steadiness, drop_page_cache, one_tier_store, spread

TIER_KINDS = ("cpu", "disk", "redis")
MAX_NEW_TOKENS = 1  # a resume is timed to its first token


# ------------------------------------------------------------------ history
def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    """Token ids of a conversation: the chat template's, or kvblend's plain rendering for a
    tokenizer without one (blend.prompt.conversation.chat_ids, which always ends with the
    assistant's prompt)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                  return_dict=False))
    from blend.prompt.conversation import chat_ids

    return chat_ids(tokenizer, messages)


def build_history(tokenizer: Any, documents: Sequence[tuple[str, str]], target: int) -> list[dict[str, str]]:
    """Prior turns (a user passage, an assistant acknowledgement) whose chat-templated
    tokens just reach `target`: the last passage is cut to the shortest that does.
    Documents are reused in order if they run out."""

    def length(messages: list[dict[str, str]]) -> int:
        return len(render(tokenizer, messages))

    def turn(name: str, text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Here is the passage {name}:\n\n{text}"},
                {"role": "assistant", "content": "Noted."}]

    messages: list[dict[str, str]] = []
    for i in range(10_000):
        name, text = documents[i % len(documents)]
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if length(messages + turn(name, text)) < target:
            messages += turn(name, text)
            continue
        lo, hi = 0, len(ids)  # smallest cut whose history reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            if length(messages + turn(name, tokenizer.decode(ids[:mid]))) >= target:
                hi = mid
            else:
                lo = mid + 1
        return messages + turn(name, tokenizer.decode(ids[:lo]))
    raise ValueError(f"cannot build a history of {target} tokens from the sample documents")


# -------------------------------------------------------------------- tiers
# -------------------------------------------------------------------- bench
def run_resume_bench(config_path: str, lengths: Sequence[int], tiers: Sequence[str], *, repeats: int = 3,
                     redis_url: str | None = None, disk_path: str | None = None, cold_disk: bool = True,
                     log: Any = print) -> dict[str, Any]:
    """Measure resume vs re-prefill TTFT for every (tier, history length); see the module doc."""
    import torch

    from blend.config import load_config
    from blend.engine.engine import BlendEngine
    from blend.model.loading import load_model
    from eval.samples import sample_documents
    from storage.tier import StoreUnavailable

    watch = LoadWatch.begin()
    steady = Steadiness.begin()
    config = load_config(config_path)
    t0 = time.perf_counter()
    lm = load_model(config.model, device=config.device, dtype=config.dtype)
    log(f"model {config.model} on {lm.device} loaded in {time.perf_counter() - t0:.1f} s; "
        f"chunk_tokens {config.engine.blend.chunk_tokens}, kv_dtype {config.store.kv_dtype}")
    tokenizer = lm.tokenizer
    if max(lengths) + 64 > lm.dims.max_positions:
        raise ValueError(f"--history-tokens {max(lengths)} does not fit the model's {lm.dims.max_positions} "
                         "positions with a new message; use shorter histories")
    docs = sample_documents()
    tag = f"{os.getpid()}-{int(time.time())}"
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-resume-"))
    disk_dir = Path(disk_path) if disk_path else _default_disk_dir(config, tag, work)

    histories = {n: build_history(tokenizer, docs, n) for n in lengths}
    history_ids = {n: render(tokenizer, h) for n, h in histories.items()}
    hybrid = lm.dims.hybrid

    engines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for kind in tiers:
        try:
            store = one_tier_store(kind, dataclasses.replace(config.store, namespace=""), scratch=disk_dir,
                                   redis_url=redis_url, key_prefix=f"kvblend-bench-{tag}:")
            engines[kind] = BlendEngine(config.with_overrides(store=store, sessions_dir=str(work / "sessions" / kind)),
                                        model=lm)
        except StoreUnavailable as err:
            errors[kind] = str(err)
            log(f"{kind}: unusable ({err})")

    def sync() -> None:
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)

    try:
        # the history's KV, computed once per length and stored in every tier
        runners = [engine.runner for engine in engines.values()][:1]  # one model: any engine's runner
        if hybrid and engines:  # only a turn stores a hybrid model's windows: the history's last turn is run as one
            for n in lengths:
                for engine in engines.values():
                    seed = f"seed-{n}"
                    engine.sessions.set_history(seed, histories[n][:-2])
                    engine.chat(seed, histories[n][-2]["content"], max_new_tokens=4)
                    replied = engine.sessions.sessions[seed].messages
                    engine.drop(seed)
                histories[n] = replied  # greedy: the same reply in every engine
            runners = []
        for runner in runners:
            for ids in history_ids.values():
                cache = runner.new_cache(len(ids))
                runner.prefill(torch.tensor(ids), cache)
                for engine in engines.values():
                    engine.prefix_cache.store_blocks(ids, cache)
        for engine in engines.values():
            engine.store.flush()

        samples: dict[tuple[str, int], dict[str, list[float]]] = {}
        counter = 0

        def measure(kind: str, n: int, resume_first: bool) -> dict[str, Any]:
            """One resume and one re-prefill of history n plus a new message, in the given order."""
            nonlocal counter
            counter += 1
            engine = engines[kind]
            message = f"({counter}) In one sentence, what do the passages above have in common?"
            ids = render(tokenizer, histories[n] + [{"role": "user", "content": message}], generation_prompt=True)
            out: dict[str, Any] = {}
            for variant in (("resume", "reprefill") if resume_first else ("reprefill", "resume")):
                if variant == "resume":
                    sid = f"bench-{kind}-{n}-{counter}"
                    engine.sessions.set_history(sid, histories[n])
                    if kind == "disk" and cold_disk:
                        drop_page_cache(disk_dir)
                    result = engine.chat(sid, message, max_new_tokens=MAX_NEW_TOKENS)
                    engine.drop(sid)
                    if result.stats.context_tokens != len(ids):
                        raise RuntimeError("the resumed prompt differs from the re-prefilled one")
                    moved = sum((result.stats.load.bytes_by_tier if result.stats.load else {}).values())
                    out.update(resume=result.ttft_s, loaded=result.stats.loaded_tokens, moved=moved,
                               computed=result.stats.recomputed_tokens, load_s=result.stats.load_s,
                               exposed=result.stats.exposed_load_s, resume_logprobs=result.first_token_logprobs)
                else:
                    sync()
                    t = time.perf_counter()
                    cache = engine.runner.new_cache(len(ids))
                    logits = engine.runner.prefill(torch.tensor(ids), cache)[0]
                    sync()
                    out["reprefill"] = time.perf_counter() - t
                    out["reprefill_logprobs"] = torch.log_softmax(logits.float(), dim=-1).cpu()
                    del cache
            out["logprob_diff"] = float((out.pop("resume_logprobs") - out.pop("reprefill_logprobs")).abs().max())
            return out

        log("warm-up ...")
        for kind in engines:  # first-call costs (allocator, thread pools, connections) are not measured
            measure(kind, min(lengths), True)
        for r in range(repeats):
            for n in lengths:
                for kind in engines:
                    got = measure(kind, n, resume_first=(r % 2 == 0))
                    bucket = samples.setdefault((kind, n), {})
                    for k, v in got.items():
                        bucket.setdefault(k, []).append(v)
            log(f"round {r + 1}/{repeats} done")

        results = []
        for n in lengths:
            for kind in tiers:
                if kind in errors:
                    results.append({"tier": kind, "history_tokens": n, "error": errors[kind]})
                    continue
                s = samples[(kind, n)]
                resume, reprefill = statistics.median(s["resume"]), statistics.median(s["reprefill"])
                results.append({
                    "tier": kind, "history_tokens": n, "history_tokens_actual": len(history_ids[n]),
                    "loaded_tokens": int(statistics.median(s["loaded"])),
                    "computed_tokens": int(statistics.median(s["computed"])),
                    "resume_ttft_s": round(resume, 5), "reprefill_ttft_s": round(reprefill, 5),
                    "resume_ttft_min_s": spread(s["resume"])["min"], "resume_ttft_max_s": spread(s["resume"])["max"],
                    "reprefill_ttft_min_s": spread(s["reprefill"])["min"],
                    "reprefill_ttft_max_s": spread(s["reprefill"])["max"],
                    "speedup": round(reprefill / resume, 2),
                    "resume_load_s": round(statistics.median(s["load_s"]), 5),
                    "resume_exposed_load_s": round(statistics.median(s["exposed"]), 5),
                    "max_first_token_logprob_diff": max(s["logprob_diff"]),
                    **_moved(lm.dims, config.store.kv_dtype, s),
                })
    finally:
        for engine in engines.values():
            if engine.store.tiers[0].config.kind == "redis":
                engine.store.clear()
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        if not disk_path:
            shutil.rmtree(disk_dir, ignore_errors=True)
    spreads = {f"{r['tier']} {r['history_tokens']} tokens {which}": (r[f"{which}_ttft_s"], r[f"{which}_ttft_min_s"],
                                                                   r[f"{which}_ttft_max_s"])
               for r in results if "error" not in r for which in ("resume", "reprefill")}
    return {
        "model": config.model, "random_weights": bool(getattr(lm, "random_weights", False)), "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."), "kv_dtype": config.store.kv_dtype,
        "chunk_tokens": config.engine.blend.chunk_tokens, "repeats": repeats, "cold_disk": cold_disk, "results": results,
        **watch.finish("resume benchmark"), **steady.finish(spreads, "resume benchmark"),
    }


def _moved(dims: Any, kv_dtype: str, samples: dict[str, list]) -> dict[str, Any]:
    """Bytes a resume read from the tier against the uniform accounting of its loaded tokens
    (every layer x every token), median over the repeats."""
    from storage.dtypes import dtype_bytes

    moved = int(statistics.median(samples["moved"]))
    uniform = dims.kv_bytes_per_token(dtype_bytes(kv_dtype)) * int(statistics.median(samples["loaded"]))
    return {"moved_bytes": moved, "uniform_bytes": uniform,
            "moved_share": round(moved / uniform, 4) if uniform else None}


def _default_disk_dir(config: Any, tag: str, work: Path) -> Path:
    configured = next((t for t in config.store.tiers if t.kind == "disk"), None)
    if configured is not None:
        return Path(configured.path).parent / f"bench-resume-{tag}"  # beside the live cache, not in it
    return work / "disk"
