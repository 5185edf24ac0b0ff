"""Chat sessions: exact prefix KV reuse across turns, offload and resume from every tier,
a restart, the idle / budget policies, faults in the stored chain, concurrent turns."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import threading
import time

import pytest
import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.session.manager import SessionBusy
from tests.models import smollm2_tokenizer, tiny_model

BLOCK = 16
MAX_NEW = 6
TOL = 1e-4  # fp32 KV: only batched-vs-incremental rounding separates the paths
MESSAGES = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. Who built it?",
    "Where did Tillery move later, and what did she design there?",
    "How often does the Carrow Point light flash?",
]


def make_engine(tmp_path, *, tiers=("cpu", "disk"), redis_url=None, **overrides) -> BlendEngine:
    specs = {"cpu": {"kind": "cpu", "budget": "64MiB"},
             # lossless: a resume is compared bit for bit with the conversation that was offloaded
             "disk": {"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", "codec": "none"},
             "redis": {"kind": "redis", "url": redis_url, "required": True, "codec": "none"}}
    cfg = EngineConfig().with_overrides(
        store={"kv_dtype": "float32", "tiers": [specs[t] for t in tiers]}, chunk_tokens=BLOCK,
        sessions_dir=str(tmp_path / "sessions"), max_new_tokens=MAX_NEW, **{"split": "off", **overrides})
    return BlendEngine(cfg, model=tiny_model("llama", tokenizer=smollm2_tokenizer()))


def check_equals_full_prefill(engine: BlendEngine, session_id: str, result) -> None:
    """The turn's first-token log-probs and greedy tokens equal a full prefill of its prompt."""
    history = engine.sessions.sessions[session_id].messages[:-1]  # up to this turn's user message
    ids = engine.lm.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert result.stats.context_tokens == len(ids)
    cache = engine.runner.new_cache(len(ids))
    logits = engine.runner.prefill(torch.tensor(ids), cache)[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    diff = (reference - result.first_token_logprobs).abs()
    assert float(diff.max()) < TOL, f"max {float(diff.max()):.2e} mean {float(diff.mean()):.2e}"
    assert engine.runner.decode(logits, cache, MAX_NEW, engine.eos) == result.token_ids


def block_keys(engine: BlendEngine, session_id: str) -> list[str]:
    """Store keys of the full prefix blocks of the session's last conversation."""
    ids = engine.sessions.sessions[session_id].cache_ids
    return [engine.prefix_cache.key(ids, end - BLOCK, end) for end in range(BLOCK, len(ids), BLOCK)]


def test_multi_turn_equals_full_prefill_and_resumes_from_store(tmp_path):
    with make_engine(tmp_path) as engine:
        first = engine.chat("s", MESSAGES[0])
        check_equals_full_prefill(engine, "s", first)
        assert first.stats.source == "computed" and first.stats.stored_blocks > 0

        second = engine.chat("s", MESSAGES[1])  # the device copy is reused
        check_equals_full_prefill(engine, "s", second)
        assert second.stats.source == "device" and second.stats.loaded_tokens > first.stats.context_tokens // 2

        engine.offload("s")
        assert engine.sessions.sessions["s"].cache is None and engine.sessions.resident_bytes() == 0
        third = engine.chat("s", MESSAGES[2])
        check_equals_full_prefill(engine, "s", third)
    stats = third.stats
    assert stats.source == "store" and stats.hits_by_tier == {"cpu": stats.prefix_blocks.hits}
    # the full blocks and the tail block of the previous turn: everything that turn had in its
    # cache (its prompt and all generated tokens but the last) is loaded, not recomputed
    assert stats.loaded_tokens == second.stats.context_tokens + second.stats.new_tokens - 1
    assert stats.loaded_tokens % BLOCK != 0
    assert stats.loaded_tokens + stats.recomputed_tokens == stats.context_tokens
    assert stats.load.bytes_by_tier["cpu"] > 0 and stats.ttft_s > 0


def test_a_turns_prefill_returns_where_its_kv_came_from_and_writes_nothing_into_the_turn(tmp_path):
    """A chat turn's exact prefill (a plan cursor, `SessionManager.prefill_plan`) driven alone:
    what it found (the end of the blocks intact in the store, whether its KV is exact) comes back
    in its result (`Prefilled.exact_kv`), and the `Turn` holds what `begin` laid out, unchanged.
    `finish` stores the new blocks from that end on, as a scheduled turn does."""
    from blend.model.plan import drive

    with make_engine(tmp_path) as engine:
        engine.chat("s", MESSAGES[0])
        engine.offload("s")  # the next turn loads the stored chain
        turn = engine.sessions.begin("s", MESSAGES[1])
        laid_out = dataclasses.replace(turn)
        capacity = len(turn.ids) + turn.max_new_tokens
        pre = engine.run_exclusive(lambda: drive(engine.runner, engine.sessions.prefill_plan(turn, capacity)))
        assert {f.name: getattr(turn, f.name) for f in dataclasses.fields(turn)} == {
            f.name: getattr(laid_out, f.name) for f in dataclasses.fields(laid_out)}
        kv = pre.exact_kv
        assert kv is not None and kv.exact and kv.stored_end == pre.stats.loaded_tokens > 0
        assert pre.stats.source == "store"
        engine.sessions.abort(turn)
        second = engine.chat("s", MESSAGES[1])  # the same turn on the scheduler: the same numbers
    assert second.stats.loaded_tokens == pre.stats.loaded_tokens
    assert (torch.log_softmax(pre.logits.float(), -1) - second.first_token_logprobs).abs().max() < TOL


def test_resume_in_a_new_engine_from_disk(tmp_path):
    with make_engine(tmp_path) as before:
        before.chat("s", MESSAGES[0])
        before.chat("s", MESSAGES[1])
        history = before.sessions.sessions["s"].messages
    with make_engine(tmp_path) as after:  # a restart: empty CPU tier, same disk and sessions_dir
        result = after.chat("s", MESSAGES[2])
        assert after.sessions.sessions["s"].messages[:4] == history
        check_equals_full_prefill(after, "s", result)
    assert result.stats.source == "store" and result.stats.loaded_tokens > 0
    assert set(result.stats.hits_by_tier) == {"disk"}


@pytest.mark.redis
def test_resume_through_redis(tmp_path, redis_url):
    with make_engine(tmp_path, tiers=("redis",), redis_url=redis_url) as engine:
        engine.chat("s", MESSAGES[0])
        engine.offload("s")
        result = engine.chat("s", MESSAGES[1])
        check_equals_full_prefill(engine, "s", result)
    assert result.stats.source == "store" and result.stats.loaded_tokens > 0
    assert set(result.stats.hits_by_tier) == {"redis"}


def test_idle_seconds_offloads(tmp_path):
    with make_engine(tmp_path, idle_seconds=60.0) as engine:
        engine.chat("a", MESSAGES[0])
        engine.chat("b", MESSAGES[1])
        assert engine.sessions.enforce(now=time.monotonic() + 30) == []
        assert sorted(engine.sessions.enforce(now=time.monotonic() + 61)) == ["a", "b"]
        assert engine.sessions.resident_bytes() == 0
        assert engine.chat("a", MESSAGES[2]).stats.source == "store"
    with make_engine(tmp_path / "zero", idle_seconds=0.0) as engine:  # 0: offloaded right after each turn
        engine.chat("a", MESSAGES[0])
        assert engine.sessions.sessions["a"].cache is None
        assert engine.chat("a", MESSAGES[1]).stats.source == "store"


def test_active_budget_offloads_least_recently_used(tmp_path):
    with make_engine(tmp_path) as engine:
        engine.chat("a", MESSAGES[0])
        one = engine.sessions.resident_bytes()
        budget = int(one * 1.5)  # room for one session of one turn
        cfg = engine.sessions.config
        engine.sessions.config = dataclasses.replace(cfg, sessions=dataclasses.replace(cfg.sessions, active_budget=budget))
        sessions = engine.sessions.sessions
        engine.chat("b", MESSAGES[0])
        assert sessions["a"].cache is None and sessions["b"].cache is not None
        engine.chat("c", MESSAGES[0])
        assert sessions["b"].cache is None and sessions["c"].cache is not None
        result = engine.chat("a", MESSAGES[1])
        assert result.stats.source == "store"
        # a alone (two turns) is over the budget: it is offloaded too, after the LRU session c
        assert sessions["a"].cache is None and sessions["c"].cache is None
        assert engine.sessions.resident_bytes() <= budget


def test_drop_and_unknown_session(tmp_path):
    with make_engine(tmp_path) as engine:
        fresh = engine.chat("new-id", MESSAGES[0])  # an id never seen is a new session
        path = tmp_path / "sessions" / "new-id.json"
        assert json.loads(path.read_text())["messages"][0] == {"role": "user", "content": MESSAGES[0]}
        engine.chat("new-id", MESSAGES[1])
        engine.drop("new-id")
        assert not path.exists() and "new-id" not in engine.sessions.sessions
        again = engine.chat("new-id", MESSAGES[0])  # starts over
        assert again.stats.context_tokens == fresh.stats.context_tokens
        assert again.stats.source == "store"  # the blocks of that same first prompt are still stored
        engine.drop("never-seen")  # no-op
        for bad in ("../escape", "", "a/b"):
            with pytest.raises(ValueError, match="bad session id"):
                engine.chat(bad, "hello")
            with pytest.raises(ValueError, match="bad session id"):
                engine.drop(bad)
        for bad in (1, None):
            with pytest.raises(TypeError, match="session id must be a str"):
                engine.chat(bad, "hello")
        with pytest.raises(ValueError, match="full, reuse, prefix, blend"):
            engine.chat("new-id", "hello", mode="")  # not read as "no mode"
        (tmp_path / "sessions" / "garbled.json").write_text("{not json")
        with pytest.raises(ValueError, match="unreadable"):  # never silently overwritten
            engine.chat("garbled", "hello")
        for forged in ('{"messages": [{"role": "user", "content": 5}]}', '{"messages": [{"role": "wizard", "content": "x"}]}',
                       '{"messages": {"role": "user"}}', '{"messages": ["hi"]}'):
            (tmp_path / "sessions" / "forged.json").write_text(forged)
            with pytest.raises(ValueError, match="unreadable.*messages must be a list"):
                engine.chat("forged", "hello")
        for forged, why in (("5", "expected a JSON object"), ('{"session_id": "other", "messages": []}',
                                                             "it holds session 'other'")):
            (tmp_path / "sessions" / "forged.json").write_text(forged)
            with pytest.raises(ValueError, match=f"unreadable \\({why}"):
                engine.chat("forged", "hello")
        engine.drop("garbled")
        assert engine.chat("garbled", "hello").token_ids
        with pytest.raises(ValueError, match="empty message"):
            engine.chat("new-id", "   ")
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.chat("new-id", "hi", max_new_tokens=0)


def test_missing_middle_block_stops_the_chain(tmp_path):
    with make_engine(tmp_path) as engine:
        engine.chat("s", MESSAGES[0])
        keys = block_keys(engine, "s")
        assert len(keys) >= 3
        engine.offload("s")
        engine.store.delete(keys[1])
        result = engine.chat("s", MESSAGES[1])
        check_equals_full_prefill(engine, "s", result)
        assert result.stats.loaded_tokens == BLOCK and result.stats.prefix_blocks.hits == 1
        engine.offload("s")  # the turn stored the missing block again
        healed = engine.chat("s", MESSAGES[2])
        check_equals_full_prefill(engine, "s", healed)
        assert healed.stats.loaded_tokens > result.stats.context_tokens - BLOCK


def test_a_corrupt_middle_block_fails_its_load_and_the_turn_is_computed_exactly(tmp_path):
    """A block whose layer data is corrupt (its header verifies): the turn's load fails at that
    layer (no model work in the loader), the turn is computed in full (exact), the bad entry is
    dropped and the turn's blocks stored again, readable."""
    with make_engine(tmp_path, tiers=("disk",)) as engine:
        first = engine.chat("s", MESSAGES[0])
        keys = block_keys(engine, "s")
        engine.offload("s")
    victim = tmp_path / "disk" / f"{keys[1]}.kv"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in the layer data: the header still verifies
    victim.write_bytes(bytes(data))
    with make_engine(tmp_path, tiers=("disk",)) as engine:
        result = engine.chat("s", MESSAGES[1])
        check_equals_full_prefill(engine, "s", result)
        stats = result.stats
        assert stats.stalled_tiers == ("disk",) and stats.loaded_tokens == 0  # computed without the store
        assert engine.store.stats()["disk"]["corrupt"] == 1
        engine.store.flush()
        ids = engine.sessions.sessions["s"].cache_ids
        expected = engine.prefix_cache.maker.expected(ids[BLOCK : 2 * BLOCK], BLOCK)
        assert engine.store.lookup(keys[1], expected) is not None  # stored again, readable
    assert first.token_ids


def test_concurrent_turns_on_one_session_are_rejected(tmp_path):
    with make_engine(tmp_path) as engine:
        started, release = threading.Event(), threading.Event()
        step = engine.runner.forward

        def slow_step(items):  # a decoding step of the first turn
            if any(it.decodes() for it in items):
                started.set()
                assert release.wait(10)
            return step(items)

        engine.runner.forward = slow_step
        outcome: dict[str, object] = {}

        def run(name: str, message: str) -> None:
            try:
                outcome[name] = engine.chat("s", message)
            except SessionBusy as err:
                outcome[name] = err

        first = threading.Thread(target=run, args=("first", MESSAGES[0]))
        first.start()
        assert started.wait(10)
        second = threading.Thread(target=run, args=("second", MESSAGES[1]))
        second.start()
        second.join(10)
        with pytest.raises(SessionBusy):
            engine.offload("s")
        with pytest.raises(SessionBusy):
            engine.drop("s")
        release.set()
        first.join(10)
        engine.runner.forward = step
        assert isinstance(outcome["second"], SessionBusy) and "already running a turn" in str(outcome["second"])
        messages = engine.sessions.sessions["s"].messages
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == MESSAGES[0]
        assert engine.chat("s", MESSAGES[1]).stats.source == "device"  # the session is usable again

        with open(tmp_path / "sessions" / "s.lock", "a") as other:  # the lock another process would take
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(SessionBusy, match="another process"):
                engine.chat("s", MESSAGES[2])
        assert len(engine.sessions.sessions["s"].messages) == 4


@pytest.mark.slow
def test_cli_chat_one_turn_then_resume_in_a_new_process(tmp_path, capsys):
    from blend.cli import main

    config = tmp_path / "chat.yaml"
    config.write_text(
        "model: smollm2-135m-instruct\ndevice: cpu\n"
        f"engine:\n  blend:\n    chunk_tokens: 16\n  sessions:\n    sessions_dir: {tmp_path / 'sessions'}\n"
        "store:\n  kv_dtype: float32\n  tiers:\n    - kind: cpu\n      budget: 64MiB\n"
        f"    - kind: disk\n      path: {tmp_path / 'disk'}\n      budget: 256MiB\n"
    )
    args = ["chat", "--config", str(config), "--session", "cli", "--max-new-tokens", "3", "--json"]
    assert main(args + ["--message", "What is the capital of France?"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["text"] and first["stats"]["source"] == "computed"
    assert main(args + ["--message", "And of Italy?"]) == 0  # a new engine: history from JSON, KV from disk
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["stats"]["source"] == "store" and second["stats"]["hits_by_tier"].keys() == {"disk"}
    assert second["stats"]["loaded_tokens"] > first["stats"]["context_tokens"] - 16
    history = json.loads((tmp_path / "sessions" / "cli.json").read_text())["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]


def test_bench_history_reaches_the_requested_length():
    from eval.bench.resume import build_history
    from eval.samples import sample_documents

    tokenizer = smollm2_tokenizer()
    for target in (100, 700):
        history = build_history(tokenizer, sample_documents(), target)
        n = len(tokenizer.apply_chat_template(history, tokenize=True, return_dict=False))
        assert target <= n <= target + 3 and history[-1]["role"] == "assistant"


def test_session_files_are_opened_safely_and_a_failed_save_leaves_the_conversation(tmp_path, monkeypatch):
    import os

    import blend.session.manager

    sessions = tmp_path / "sessions"
    sessions.mkdir()
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"messages": [{"role": "user", "content": "planted"}]}))
    with make_engine(tmp_path) as engine:
        os.mkfifo(sessions / "fifo.json")  # would block a plain open for reading
        (sessions / "link.json").symlink_to(outside)
        (sessions / "deep.json").write_text("[" * 5000)
        for sid, why in (("fifo", "not a regular file"), ("link", "symbolic links"), ("deep", "recursion")):
            with pytest.raises(ValueError, match=f"(?i)session '{sid}'.*unreadable.*{why}"):
                engine.chat(sid, "hello")
        monkeypatch.setattr(blend.session.manager, "MAX_HISTORY_BYTES", 8)
        (sessions / "big.json").write_text(json.dumps({"messages": []}))
        with pytest.raises(ValueError, match="over the 8 bytes"):
            engine.chat("big", "hello")
        monkeypatch.undo()
        (sessions / "planted.lock").symlink_to(tmp_path / "created-through-the-lock")
        with pytest.raises(ValueError, match="cannot open its lock file"):
            engine.chat("planted", "hello")
        assert not (tmp_path / "created-through-the-lock").exists()
        for bad in (".", "..", "..."):
            with pytest.raises(ValueError, match="bad session id"):
                engine.chat(bad, "hello")
        # a turn whose history cannot be written raises and is not part of the conversation
        first = engine.chat("kept", MESSAGES[0])
        monkeypatch.setattr(blend.session.manager.secrets, "token_hex", lambda n: "0" * (2 * n))  # a guessed temp name
        blocker = sessions / f"kept.json.tmp-{'0' * 16}"
        blocker.mkdir()  # the temp file cannot be created
        with pytest.raises(ValueError, match="cannot write its history"):
            engine.chat("kept", "My secret word is BANANA.")
        blocker.rmdir()
        victim = tmp_path / "victim.txt"
        victim.write_text("keep me")
        blocker.symlink_to(victim)  # a link planted at the temp name is not written through
        with pytest.raises(ValueError, match="cannot write its history"):
            engine.chat("kept", "My secret word is BANANA.")
        assert victim.read_text() == "keep me" and blocker.is_symlink()
        blocker.unlink()
        monkeypatch.undo()
        engine.chat("kept", MESSAGES[1])
        history = json.loads((sessions / "kept.json").read_text())["messages"]
        assert [m["content"] for m in history if m["role"] == "user"] == [MESSAGES[0], MESSAGES[1]]
        assert history[1]["content"] == first.text
        assert not [p for p in sessions.iterdir() if ".tmp-" in p.name]


def test_a_conversation_over_the_positions_says_what_to_shorten(tmp_path):
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=BLOCK, sessions_dir=str(tmp_path / "sessions"), split="off")
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer(), max_position_embeddings=64)
    with BlendEngine(cfg, model=lm) as engine:
        with pytest.raises(ValueError, match="session 'long'.*conversation is too long: drop the session") as err:
            engine.chat("long", "word " * 80)
        assert "documents" not in str(err.value)
        with pytest.raises(ValueError, match="at most \\d+ new tokens.*conversation is too long.*documents"):
            engine.chat("long", "Hi.", documents=["A short passage."], max_new_tokens=60)
        assert not (tmp_path / "sessions" / "long.json").exists()  # nothing saved


def test_a_history_too_long_for_the_positions_is_refused_before_tokenizing(tmp_path, monkeypatch):
    """A stored history (or a turn's documents) with more characters than the positions can
    hold at the longest token's length is refused at once: tokenizing megabytes takes minutes."""
    import blend.session.manager

    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=BLOCK, sessions_dir=str(tmp_path / "sessions"), split="off")
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer(), max_position_embeddings=64)
    with BlendEngine(cfg, model=lm) as engine:
        limit = 64 * engine.prompts.max_token_chars
        (tmp_path / "sessions").mkdir()
        history = [{"role": "user", "content": "x" * limit}, {"role": "assistant", "content": "Ok."}]
        (tmp_path / "sessions" / "huge.json").write_text(json.dumps({"session_id": "huge", "messages": history}))

        def tokenized(*args, **kwargs):
            raise AssertionError("tokenized a history that cannot fit")

        monkeypatch.setattr(blend.session.manager, "chat_ids", tokenized)
        with pytest.raises(ValueError, match="session 'huge'.*cannot fit the model's 64 positions.*"
                                             "conversation is too long: drop the session"):
            engine.chat("huge", "Hi.")
        # the documents alone fit (the engine checks them with the message); with the history they do not
        half = [{"role": "user", "content": "x" * (limit // 2)}, {"role": "assistant", "content": "Ok."}]
        (tmp_path / "sessions" / "half.json").write_text(json.dumps({"session_id": "half", "messages": half}))
        with pytest.raises(ValueError, match="session 'half'.*64 positions.*or use fewer or shorter documents"):
            engine.chat("half", "Hi.", documents=["y" * (limit // 2)])
        assert json.loads((tmp_path / "sessions" / "half.json").read_text())["messages"] == half  # nothing saved


def test_a_lock_file_dropped_between_open_and_flock_is_opened_again(tmp_path, monkeypatch):
    """Another process's `drop` unlinks `<id>.lock` after our open but before our flock: the
    flock we got guards nothing, so the turn locks the new file instead."""
    import os

    import blend.session.manager

    real_flock = fcntl.flock
    calls: list[int] = []

    def racing_flock(fd, op):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "sessions" / "raced.lock")):
            calls.append(fd)
            if len(calls) == 1:
                (tmp_path / "sessions" / "raced.lock").unlink()  # the concurrent drop
        return real_flock(fd, op)

    with make_engine(tmp_path) as engine:
        monkeypatch.setattr(blend.session.manager.fcntl, "flock", racing_flock)
        assert engine.chat("raced", "hello").token_ids
        assert len(calls) == 2 and (tmp_path / "sessions" / "raced.lock").exists()


def test_a_message_with_undecodable_bytes_is_replaced_text_not_a_tokenizer_error(tmp_path):
    # argv decodes bytes that are not UTF-8 as lone surrogates (surrogateescape)
    raw = b"caf\xe9 au lait?".decode("utf-8", "surrogateescape")
    with make_engine(tmp_path) as engine:
        result = engine.chat("s", raw, max_new_tokens=2, system="be brief \udcff")
        assert result.token_ids
        saved = json.loads((tmp_path / "sessions" / "s.json").read_text(encoding="utf-8"))["messages"]
        assert saved[0]["content"] == "caf\ufffd au lait?"
