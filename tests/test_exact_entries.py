"""Exact entries come back exact by default: prefix blocks and chat sessions are stored in the
compute dtype and each tier's `exact_codec` (none by default), documents in its `codec` (int8 on
disk by default); prefix mode and a chat resume from the default config's disk tier give the
first-token log-probs of computing them (float32, within 1e-4)."""

from __future__ import annotations

import pytest
import torch

from blend.config import EngineConfig, load_config
from blend.engine.engine import BlendEngine
from blend.model.projections import projection_layout
from storage.config import DiskTierConfig
from storage.keys import key_kind
from tests.models import smollm2_tokenizer, tiny_model

TOL = 1e-4
DOCS = [f"Passage {i}: the harbour of Vell Corran shipped {7 * i + 3} tons of slate to Ostend in {1800 + i}, and "
        f"the keeper wrote it down in a blue ledger. " * (2 + i) for i in range(3)]
QUESTION = "How many tons did the harbour ship?"
MESSAGES = ["The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. Who built it?",
            "Where did Tillery move later, and what did she design there?"]
_MODELS: dict[str, object] = {}


def model(arch: str):
    if arch not in _MODELS:  # one model per arch: the engines of a test share it, as processes share weights
        _MODELS[arch] = tiny_model(arch, tokenizer=smollm2_tokenizer())
    return _MODELS[arch]


def make_engine(tmp_path, arch: str, **disk) -> BlendEngine:
    """The default config's store (a cpu tier, a disk tier, each with its default codecs; float16
    storage dtype) over a tiny float32 model; a fresh cpu tier each time (a new process)."""
    tiers = [{"kind": "cpu", "budget": "64MiB"},
             {"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", **disk}]
    cfg = EngineConfig().with_overrides(store={"tiers": tiers}, chunk_tokens=16, max_new_tokens=4,
                                        sessions_dir=str(tmp_path / "sessions"))
    assert cfg.store.kv_dtype == "float16" and cfg.store.tiers[1].codec == disk.get("codec", "int8")
    return BlendEngine(cfg, model=model(arch))


def full_prefill(engine: BlendEngine, ids) -> tuple[torch.Tensor, list[int]]:
    cache = engine.runner.new_cache(len(ids) + 8)
    logits = engine.runner.prefill(torch.tensor(list(ids)), cache)[0]
    return torch.log_softmax(logits.float(), dim=-1), engine.runner.decode(logits, cache, 4, engine.eos)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_prefix_mode_and_chat_resume_from_the_default_disk_tier_equal_computing_them(tmp_path, arch):
    with make_engine(tmp_path, arch) as first:
        assert first.runner.dtype == torch.float32
        first.ingest(DOCS)  # documents: int8 on disk
        stored = first.generate(QUESTION, DOCS, mode="prefix")
        turn = first.chat("s", MESSAGES[0])
        assert stored.stats.stored_blocks > 0 and turn.stats.stored_blocks > 0
    with make_engine(tmp_path, arch) as later:  # a new process: the cpu tier is empty, the disk tier holds it all
        disk = later.store.tiers[1]
        kinds = {key_kind(k): disk.peek_header(k) for k in disk.keys()}
        assert kinds["document"].codec.name == "int8"
        assert kinds["prefix"].codec.name == "none" and kinds["prefix"].kv_dtype == "float32"  # the compute dtype

        prefix = later.generate(QUESTION, DOCS, mode="prefix")
        assert prefix.stats.prefix_blocks.hits > 0 and prefix.stats.hits_by_tier == {
            "disk": prefix.stats.prefix_blocks.hits}
        assert prefix.stats.loaded_tokens > prefix.stats.context_tokens // 2
        reference, tokens = full_prefill(later, later.build_prompt(QUESTION, DOCS).token_ids)
        assert float((prefix.first_token_logprobs - reference).abs().max()) < TOL
        assert prefix.token_ids == tokens

        resumed = later.chat("s", MESSAGES[1])
        assert resumed.stats.source == "store" and set(resumed.stats.hits_by_tier) == {"disk"}
        history = later.sessions.sessions["s"].messages[:-1]  # up to this turn's user message
        ids = later.lm.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        assert resumed.stats.context_tokens == len(ids) and resumed.stats.loaded_tokens > len(ids) // 2
        reference, tokens = full_prefill(later, ids)
        assert float((resumed.first_token_logprobs - reference).abs().max()) < TOL
        assert resumed.token_ids == tokens


def test_exact_codec_is_a_tier_setting_the_writer_applies_to_prefix_blocks_only(tmp_path):
    """`exact_codec: int8` (asked for: fewer bytes) stores prefix blocks in int8; documents keep
    `codec`; a value that is not a codec is refused like `codec`'s."""
    with make_engine(tmp_path, "llama", codec="none", exact_codec="int8") as engine:
        engine.ingest(DOCS[:1])
        engine.generate(QUESTION, DOCS[:1], mode="prefix")
        engine.store.flush()
        disk = engine.store.tiers[1]
        codecs = {(key_kind(k), disk.peek_header(k).codec.name) for k in disk.keys()}
        assert codecs == {("document", "none"), ("prefix", "int8")}
        assert engine.store.stats()["disk"]["exact_codec"] == "int8"
    assert DiskTierConfig(path=str(tmp_path)).exact_codec == "none"
    config = tmp_path / "c.yaml"
    config.write_text(f"store:\n  tiers:\n    - kind: disk\n      path: {tmp_path}\n      exact_codec: int9\n")
    with pytest.raises(ValueError, match=r"store\.tiers\[0\]\.exact_codec: must be one of 'none', 'int8' or 'int4'"):
        load_config(config)


@pytest.mark.slow
@pytest.mark.skipif(projection_layout(torch.device("cpu"), torch.bfloat16) != "packed",
                    reason="this CPU or torch build has no oneDNN bfloat16 kernels")
def test_prefix_mode_gives_the_same_numbers_whether_its_blocks_were_found_or_computed():
    """In bfloat16 one pass over more rows changes the numbers (SmolLM2: first-token log-probs
    0.2-0.4 apart between one prefill and the same tokens in two passes): a prefix request computes
    the blocks a later one will load in a pass of their own, so the tail is computed alike and the
    answer does not depend on what the store held (it did by 0.4 under load, issue 42)."""
    cfg = EngineConfig(dtype="bfloat16").with_overrides(store={"tiers": [{"kind": "cpu", "budget": "256MiB"}]},
                                                        max_new_tokens=4, split="off")
    docs = [d * 2 for d in DOCS]  # 775 tokens: one 512-token block, then the tail
    with BlendEngine(cfg, model=smollm2_bfloat16()) as engine:
        assert engine.runner.dtype == torch.bfloat16 and len(engine.build_prompt(QUESTION, docs)) == 775
        computed = engine.generate(QUESTION, docs, mode="prefix")  # all computed, the block stored
        engine.store.flush()
        loaded = engine.generate(QUESTION, docs, mode="prefix")  # the block loaded (0.39 apart before)
    assert computed.stats.loaded_tokens == 0 and loaded.stats.loaded_tokens > loaded.stats.context_tokens // 2
    assert torch.equal(computed.first_token_logprobs, loaded.first_token_logprobs), float(
        (computed.first_token_logprobs - loaded.first_token_logprobs).abs().max())
    assert computed.token_ids == loaded.token_ids


def smollm2_bfloat16():
    from blend.model.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16")


def test_prefix_mode_computes_its_missing_exact_segments_as_steps_of_its_plan():
    """Prefix mode loads the system part and the first document where they are stored exact; where
    they miss, their pass is the plan's first want (model work as items of the scheduler's steps,
    beside other sequences' decode rows), never computed inside its planning. The answer is full
    prefill's, and what it computed is stored for the next request."""
    from blend.engine.prefill import PromptWork
    from blend.model.plan import PAUSE, Done
    from blend.model.runner import Rows, RowsCursor
    from tests.test_engine import make_engine

    with make_engine() as engine:
        prompt = engine.build_prompt(QUESTION, DOCS)
        work = PromptWork(prompt, None, "prefix", 0.0, None, len(prompt))
        runner = engine.runner

        def by_hand():  # the plan driven as the scheduler drives it, each want recorded
            plan, wants, output = engine.prefiller.plan(work), [], None
            want = plan.take()
            while not isinstance(want, Done):
                output = None
                if want is not PAUSE:
                    wants.append(want)
                    cursor = RowsCursor(want, runner.chunk_tokens) if isinstance(want, (Rows, list)) else want
                    while not cursor.done:
                        cursor.take(runner.forward(cursor.want()))
                    output = cursor.value() if isinstance(cursor, RowsCursor) else None
                want = plan.take(output)
            return wants, want.value

        wants, pre = engine.run_exclusive(by_hand)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=1)
        engine.store.flush()
        again = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=1)
    first_doc = prompt.segments[1]
    assert first_doc.kind == "document"
    passes = [w for w in wants if isinstance(w, list)]  # the system part's pass, the first document's
    assert len(passes) == 2 and wants[:2] == passes  # before any row of the prompt
    assert [int(t) for r in passes[-1] for t in r.token_ids] == list(first_doc.token_ids)
    rows = wants[2:]  # the rest of the prompt, computed after them (where a later request's blocks end, cut)
    assert rows and all(isinstance(r, Rows) for r in rows) and rows[0].start == first_doc.end
    assert pre.stats.loaded_tokens == first_doc.end
    assert float((torch.log_softmax(pre.logits.float(), -1) - full.first_token_logprobs).abs().max()) < TOL
    assert again.stats.loaded_tokens >= first_doc.end and again.token_ids == full.token_ids  # what it stored, loaded
