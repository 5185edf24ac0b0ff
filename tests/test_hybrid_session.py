"""Chat sessions on a hybrid model (tiny Gemma 3: sliding layers of 16 tokens around one global
layer): offload stores the global layers' blocks and only the last window of the sliding
layers, resume loads exactly those (blocks ending mid-window included) and gives what a
full prefill gives; device-resident sessions decode through rings."""

from __future__ import annotations

import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.kv.windowed import FULL_SUFFIX, WINDOW_SUFFIX
from blend.prompt.conversation import chat_ids
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_session import MESSAGES

BLOCK = 16
MAX_NEW = 6
TOL = 1e-4


def make_engine(tmp_path, tiers=("cpu",)) -> BlendEngine:
    specs = {"cpu": {"kind": "cpu", "budget": "64MiB"},
             # lossless: a resume is compared with a full prefill to 1e-4
             "disk": {"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", "codec": "none"}}
    cfg = EngineConfig().with_overrides(
        store={"kv_dtype": "float32", "tiers": [specs[t] for t in tiers]}, chunk_tokens=BLOCK,
        sessions_dir=str(tmp_path / "sessions"), max_new_tokens=MAX_NEW, split="off")
    return BlendEngine(cfg, model=tiny_model("gemma3_text", tokenizer=smollm2_tokenizer()))


def check_equals_full_prefill(engine: BlendEngine, session_id: str, result) -> None:
    history = engine.sessions.sessions[session_id].messages[:-1]
    ids = chat_ids(engine.lm.tokenizer, history)
    assert result.stats.context_tokens == len(ids)
    cache = engine.runner.new_cache(len(ids))
    logits = engine.runner.prefill(torch.tensor(ids), cache)[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert float((reference - result.first_token_logprobs).abs().max()) < TOL
    assert engine.runner.decode(logits, cache, MAX_NEW, engine.eos) == result.token_ids


def entries(engine: BlendEngine) -> dict[str, list]:
    """Headers of the stored session entries by kind (.full / .window fingerprints)."""
    tier = engine.store.tiers[0]
    out: dict[str, list] = {"full": [], "window": [], "other": []}
    for key in tier.keys():
        header = tier.peek_header(key)
        kind = ("full" if header.fingerprint.endswith(FULL_SUFFIX) else
                "window" if header.fingerprint.endswith(WINDOW_SUFFIX) else "other")
        out[kind].append(header)
    return out


def test_offload_stores_the_window_and_resume_is_exact(tmp_path):
    with make_engine(tmp_path, tiers=("cpu", "disk")) as engine:
        runner = engine.runner
        assert engine.sessions.windowed is not None
        first = engine.chat("s", MESSAGES[0])
        check_equals_full_prefill(engine, "s", first)
        second = engine.chat("s", MESSAGES[1])  # the device copy (its sliding layers rings) is reused
        check_equals_full_prefill(engine, "s", second)
        assert second.stats.source == "device"
        session = engine.sessions.sessions["s"]
        assert session.cache.is_ring(0) and not session.cache.is_ring(2)
        n = session.cache.length
        assert n > 3 * 16  # the conversation crosses the window several times

        engine.offload("s")
        stored = entries(engine)
        assert stored["other"] == []  # nothing of every layer: blocks of the global layer, windows of the others
        assert all(h.num_layers == 1 for h in stored["full"])
        assert all(h.num_layers == 3 for h in stored["window"])
        last = [h for h in stored["window"] if h.pos_start + h.num_tokens == n]
        assert len(last) == 1 and last[0].num_tokens == 16
        assert any(h.pos_start % BLOCK for h in stored["window"])  # a window that starts inside a block

        third = engine.chat("s", MESSAGES[2])
        check_equals_full_prefill(engine, "s", third)
    stats = third.stats
    # resumed where the next turn's tokens surely agree: the previous prompt's end (the reply,
    # re-rendered through the template, may tokenize otherwise), or further when they do agree
    p = stats.loaded_tokens
    assert stats.source == "store" and p in (second.stats.context_tokens, n)
    per_layer_token = 2 * runner.kv_heads * runner.head_dim * 4  # float32 K and V of one layer and token
    moved = sum(stats.load.bytes_by_tier.values())
    assert moved == (1 * p + 3 * 16) * per_layer_token  # global layer x p, sliding layers x their window
    assert moved < 0.5 * 4 * p * per_layer_token  # against every layer x p


def test_resume_in_a_new_engine_and_a_missing_window_falls_back(tmp_path):
    with make_engine(tmp_path, tiers=("disk",)) as engine:
        engine.chat("r", MESSAGES[0])
        engine.chat("r", MESSAGES[1])
    with make_engine(tmp_path, tiers=("disk",)) as engine:  # a new process: history file + disk tier
        resumed = engine.chat("r", MESSAGES[2])
        check_equals_full_prefill(engine, "r", resumed)
        assert resumed.stats.source == "store" and resumed.stats.loaded_tokens > 0
        for key in list(engine.store.tiers[0].keys()):  # every window gone: no exact resume point left
            if engine.store.tiers[0].peek_header(key).fingerprint.endswith(WINDOW_SUFFIX):
                engine.store.delete(key)
        engine.offload("r")
        engine.sessions.sessions["r"].cache = None
    with make_engine(tmp_path, tiers=("disk",)) as engine:
        again = engine.chat("r", "And who maintains it today?")
        check_equals_full_prefill(engine, "r", again)
        # the last turn's own window was stored after it; the one before it is gone: the resume
        # point is the previous turn's end if present, else the conversation is computed
        assert again.stats.source in ("store", "computed")


def test_store_stats_tell_windows_from_global_blocks(tmp_path, capsys):
    import json

    from blend.cli import main

    with make_engine(tmp_path, tiers=("disk",)) as engine:
        engine.chat("k", MESSAGES[0])
        engine.offload("k")
        engine.ingest(["A document: every layer of every token is stored for blend."])
    (tmp_path / "c.yaml").write_text(f"""
model: random:tiny
store:
  kv_dtype: float32
  tiers:
    - {{kind: disk, path: {tmp_path / "disk"}, budget: 256MiB}}
""")
    assert main(["store", "stats", "--config", str(tmp_path / "c.yaml"), "--by-kind", "--json"]) == 0
    kinds = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["disk"]["bytes_by_kind"]
    assert kinds["window"] > 0 and kinds["global"] > 0 and kinds["all"] > 0
    with make_engine(tmp_path, tiers=("disk",)) as engine:
        tier = engine.store.tiers[0]
        headers = [tier.peek_header(k) for k in tier.keys()]
    assert {h.num_layers for h in headers} == {1, 3, 4}  # global blocks, windows, a document's every layer
    assert sum(h.nbytes for h in headers if h.num_layers == 3) == kinds["window"]


def test_resume_point_inside_a_stored_full_block(tmp_path):
    """The previous prompt's end may lie inside a full block the chain also holds (the reply
    re-rendered the same): the lookup still resumes there, where a window was stored."""
    with make_engine(tmp_path) as engine:
        runner, windowed = engine.runner, engine.sessions.windowed
        ids = torch.randint(0, 5000, (50,), generator=torch.Generator().manual_seed(3)).tolist()
        cache = runner.new_cache(50)
        with torch.inference_mode():
            runner.prefill(torch.tensor(ids[:37]), cache, logit_rows=())
            prompt_window = windowed.window_entry(ids, cache, 37)
            runner.prefill(torch.tensor(ids[37:]), cache, start=37, logit_rows=())
        windowed.store_blocks(ids, cache, also=[(37, prompt_window)])
        engine.store.flush()
        later = ids[:48] + [7, 8, 9, 10]  # agrees with the stored conversation through its third full block
        chain = windowed.lookup(later, len(later) - 1, tail_ends=(37,))
        assert [(pl.start, pl.start + pl.length) for pl in chain] == [(0, 16), (16, 32), (32, 37), (21, 37)]
        assert chain[-1].layers == windowed.sliding_layers
        assert windowed.lookup(later, len(later) - 1) == []  # without the prompt end: no window at 48
