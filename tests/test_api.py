"""The Python API at its edge: documents and their one rendering, typed ingest results,
deletion by id, streaming and stop strings, conversations and chat with documents,
warm-up, and a clean TypeError/ValueError for every bad argument."""

from __future__ import annotations

import math

import pytest
import torch

from blend.config import EngineConfig
from blend.decode.result import GenerationResult, TextDelta
from blend.decode.text import TextAssembler
from blend.engine.engine import BlendEngine
from blend.prompt.document import Document, document_id, render_document
from tests.models import smollm2_tokenizer, tiny_model

DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 2,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels.",
]
QUESTION = "Who built the lighthouse at Carrow Point?"
MARKER = "\x00KVBLEND-DOCUMENTS\x00"


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", tokenizer=smollm2_tokenizer())


def make_engine(lm, tmp_path=None, **overrides) -> BlendEngine:
    tiers = [{"kind": "cpu", "budget": "64MiB"}]
    overrides.setdefault("split", "off")  # a tiny model may compute faster than it loads (see test_split.py)
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": tiers}, chunk_tokens=16,
                                        max_new_tokens=8, **overrides)
    if tmp_path is not None:
        cfg = cfg.with_overrides(sessions_dir=str(tmp_path / "sessions"))
    return BlendEngine(cfg, model=lm)


# ------------------------------------------------------------------ documents
def test_render_document_is_one_deterministic_function(lm):
    titled = Document("  The bridge was finished in 1888.\n", id="bridge", title="Harrow\n  bridge ")
    assert render_document(titled) == "Harrow bridge\nThe bridge was finished in 1888."
    assert render_document(Document("x", id="a")) == render_document("x") == render_document(Document("x"))
    assert document_id(Document("x", id="a")) == "a"
    assert document_id("x") == document_id(Document("x")) == document_id("  x  ") != document_id("y")
    assert document_id("x").startswith("sha256:")
    with make_engine(lm) as engine:
        plain = engine.build_prompt(QUESTION, ["Harrow bridge\nThe bridge was finished in 1888."])
        as_doc = engine.build_prompt(QUESTION, [titled])
        untitled = engine.build_prompt(QUESTION, [Document(titled.text, id="bridge")])
    assert plain.token_ids == as_doc.token_ids  # a title is the first line of the passage
    assert untitled.token_ids != as_doc.token_ids


def test_ingest_returns_typed_results_and_delete_removes_the_chunks(lm):
    with make_engine(lm) as engine:
        docs = [Document(DOCS[0], id="carrow"), DOCS[1], "   "]
        first = engine.ingest(docs)
        assert [d.id for d in first] == ["carrow", document_id(DOCS[1]), document_id("   ")]
        # the empty document is skipped: no blocks, so neither cached nor stored
        assert [d.cached for d in first] == [False, False, False] and first[2].keys == ()
        assert [d.stored for d in first] == [True, True, False]
        prompt = engine.build_prompt("ingest", docs)
        expected = [key for seg in prompt.documents for key in engine.document_kv.keys(seg, prompt)]
        assert list(first[0].keys) + list(first[1].keys) == expected
        assert len(first[0].keys) > 1  # the first document spans several blocks
        again = engine.ingest(docs)
        assert [d.cached for d in again] == [True, True, False] and again[0].keys == first[0].keys
        reuse = engine.generate(QUESTION, docs, mode="reuse", max_new_tokens=2)
        assert reuse.stats.documents.misses == 0

        deleted = engine.delete_document("carrow")
        assert set(deleted) == set(first[0].keys)
        assert all(engine.store.contains(k) is None for k in deleted)
        assert all(engine.store.contains(k) is not None for k in first[1].keys)
        with pytest.raises(KeyError):
            engine.delete_document("carrow")
        after = engine.generate(QUESTION, docs, mode="reuse", max_new_tokens=2)
        assert after.stats.documents.misses == 1  # the deleted document (all its blocks) is computed again

        # a block shared by two known documents survives the deletion of one of them
        engine.ingest([Document(DOCS[1], id="copy")])
        assert engine.delete_document("copy") == ()
        assert all(engine.store.contains(k) is not None for k in first[1].keys)


def test_a_changed_document_under_a_known_id_is_reported(lm):
    with make_engine(lm) as engine:
        engine.ingest([Document(DOCS[0], id="d", title="Carrow")])
        same = engine.generate(QUESTION, [Document(DOCS[0], id="d", title="Carrow")], max_new_tokens=2)
        changed = engine.generate(QUESTION, [Document(DOCS[0], id="d")], max_new_tokens=2)
    assert same.warnings == () and same.stats.documents.misses == 0
    assert len(changed.warnings) == 1 and "'d'" in changed.warnings[0] and changed.stats.documents.misses > 0


def test_deleting_an_id_removes_the_blocks_of_every_version_ingested_under_it(lm):
    with make_engine(lm) as engine:
        old = engine.ingest([Document(DOCS[0], id="d")])[0].keys
        new = engine.ingest([Document(DOCS[1], id="d")])[0].keys
        assert not set(old) & set(new)
        assert set(engine.delete_document("d")) == set(old) | set(new)
        assert all(engine.store.contains(k) is None for k in (*old, *new))


# ---------------------------------------------------------------- streaming
def test_stream_gives_the_same_tokens_and_text_as_generate(lm):
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        for kwargs in ({"mode": "blend"}, {"mode": "full", "temperature": 0.9, "top_p": 0.8, "seed": 3}):
            result = engine.generate(QUESTION, DOCS, max_new_tokens=12, **kwargs)
            items = list(engine.generate_stream(QUESTION, DOCS, max_new_tokens=12, **kwargs))
            *deltas, final = items
            assert isinstance(final, GenerationResult) and all(isinstance(d, TextDelta) for d in deltas)
            assert final.token_ids == result.token_ids and final.text == result.text
            assert "".join(d.text for d in deltas) == result.text
            assert len(deltas) >= len(result.token_ids) - 1  # one per token: control returns between tokens
            assert torch.equal(final.first_token_logprobs, result.first_token_logprobs)
            expected = engine.lm.tokenizer.decode([t for t in result.token_ids if t not in engine.eos],
                                                  skip_special_tokens=True).strip()
            assert result.text == expected
            assert result.finish_reason == ("stop" if result.token_ids[-1] in engine.eos else "length")
            assert result.prompt_tokens == len(engine.build_prompt(QUESTION, DOCS))


def test_stop_strings_end_the_generation_before_them(lm):
    with make_engine(lm) as engine:
        free = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=16)
        text = free.text
        assert len(text) > 8 and free.finish_reason == "length"
        # a piece of the text that first occurs after its start (the random model repeats itself)
        cut = next(p for p in range(1, len(text) - 3) if text.find(text[p:p + 3]) == p and text[p] != " ")
        stop = text[cut:cut + 3]
        stopped = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=16, stop=["never-seen", stop])
        assert stopped.finish_reason == "stop" and stopped.text == text[:cut].rstrip()
        assert stop not in stopped.text and len(stopped.token_ids) < len(free.token_ids)
        streamed = list(engine.generate_stream(QUESTION, DOCS, mode="full", max_new_tokens=16, stop=stop))
        assert "".join(d.text for d in streamed[:-1]) == stopped.text
        assert streamed[-1].token_ids == stopped.token_ids


class _CharTokenizer:
    """Token i decodes to PIECES[i]; byte tokens make up a multi-byte character."""

    PIECES = ["Hello", " wor", "ld", "\n", "\n", "Q", ":", " x", "\xf0", "\x9f\x98\x80", " end"]

    def decode(self, ids, skip_special_tokens=True):
        raw = "".join(self.PIECES[i] for i in ids).encode("latin-1")
        return raw.decode("utf-8", errors="replace")


def test_text_assembler_holds_back_stop_prefixes_whitespace_and_partial_characters():
    tok = _CharTokenizer()
    asm = TextAssembler(tok, eos_ids=(), stop=["\n\nQ:"])
    deltas = [asm.push(i) for i in range(7)]
    assert deltas == ["Hello", " wor", "ld", "", "", "", ""] and asm.stopped and asm.out == "Hello world"
    asm = TextAssembler(tok, eos_ids=(), stop=["never"])
    out = [asm.push(i) for i in (0, 8, 9, 10)] + [asm.finish()]
    assert "\ufffd" not in "".join(out) and "".join(out) == asm.out == "Hello\U0001F600 end"
    assert out[1] == ""  # the first byte of the emoji alone is not emitted


# ----------------------------------------------------------- conversations
def test_a_conversation_puts_the_documents_before_it(lm):
    with make_engine(lm) as engine:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
        conversation = engine.build_prompt(messages, DOCS)
        engine_qa = make_engine(lm, system_prompt="Be brief.", query_template="{question}")
        question = engine_qa.build_prompt(QUESTION, DOCS)
        engine_qa.close()
        # a single turn with documents lays out exactly like a question with that system prompt
        assert conversation.token_ids == question.token_ids
        assert [s.kind for s in conversation.segments].count("document") == len(question.documents)
        engine.ingest(DOCS)
        # documents are cached after the system part (chunk_context: system): another system
        # message computes them again, once; then they hit
        result = engine.generate(messages, DOCS, max_new_tokens=3)
        assert result.stats.documents.misses == len(conversation.documents)
        result = engine.generate(messages, DOCS, max_new_tokens=3)
        assert result.stats.documents.hits == len(conversation.documents) and result.stats.documents.misses == 0
    with make_engine(lm, chunk_context="none") as engine:  # standalone documents hit under any system part
        engine.ingest(DOCS)
        result = engine.generate(messages, DOCS, max_new_tokens=3)
        assert result.stats.documents.hits == len(conversation.documents) and result.stats.documents.misses == 0
        default = engine.build_prompt([{"role": "user", "content": QUESTION}], DOCS)  # the configured system prompt
        text = engine.lm.tokenizer.decode(default.prefix.token_ids)
        assert engine.config.engine.prompt.system_prompt in text


def test_chat_with_documents_blends_and_reuses_the_device_kv(lm, tmp_path):
    # standalone documents: the ingested KV hits under the chat's own system message
    with make_engine(lm, tmp_path, chunk_context="none") as engine:
        engine.ingest(DOCS)
        first = engine.chat("rag", QUESTION, documents=DOCS, system="Answer briefly.", max_new_tokens=4)
        assert first.stats.mode == "blend" and first.stats.documents.hits > 0 and first.stats.documents.misses == 0
        assert first.stats.stored_blocks == 0  # blended KV is never stored as exact prefix blocks
        second = engine.chat("rag", "And where did she move?", documents=DOCS, system="Answer briefly.",
                             max_new_tokens=4)
        assert second.stats.source == "device" and second.stats.stored_blocks == 0
        assert second.stats.loaded_tokens >= first.stats.context_tokens
        messages = engine.sessions.sessions["rag"].messages
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]

        # exact modes: equal to a full prefill of the same prompt, and stored as blocks
        exact = engine.chat("exact", QUESTION, documents=DOCS, mode="prefix", max_new_tokens=4)
        prompt = engine.build_prompt([{"role": "user", "content": QUESTION}], DOCS)
        full = engine.prefill(prompt, mode="full")
        reference = torch.log_softmax(full.logits.float(), dim=-1)
        assert float((reference - exact.first_token_logprobs).abs().max()) < 1e-4
        assert exact.stats.stored_blocks > 0


# --------------------------------------------------------------------- misc
def test_warmup_touches_no_cache(lm):
    with make_engine(lm) as engine:
        seconds = engine.warmup()
        assert seconds > 0 and list(engine.store.keys()) == []


def test_any_character_sequence_is_data(lm):
    with make_engine(lm) as engine:
        tricky = f"Who {MARKER} built it? \ud800 {{question}}"
        result = engine.generate(tricky, [f"doc {MARKER} with \udcff a lone surrogate", DOCS[1]], max_new_tokens=2)
        assert result.token_ids
        prompt = engine.build_prompt(tricky, [MARKER])
        assert "KVBLEND-DOCUMENTS" in engine.lm.tokenizer.decode(prompt.query.token_ids)
        assert len(prompt.documents) == 1 and "KVBLEND" in engine.lm.tokenizer.decode(prompt.documents[0].token_ids)
        chat = engine.generate([{"role": "user", "content": f"{MARKER}hi \ud83d"}], [MARKER], max_new_tokens=2)
        assert chat.token_ids
        assert render_document("a\ud800b") == "a\ufffdb"


BAD_GENERATE = [
    (dict(documents="one document as a str"), TypeError, "wrap it in a list"),
    (dict(documents=b"bytes"), TypeError, "list of documents"),
    (dict(documents=[None, 5]), TypeError, r"documents\[0\]"),
    (dict(documents=["ok", 5]), TypeError, r"documents\[1\]"),
    (dict(documents=5), TypeError, "list of str or Document"),
    (dict(documents={"text": "x"}), TypeError, "list of str or Document"),
    (dict(recompute_ratio=True), TypeError, "recompute_ratio"),
    (dict(recompute_ratio=1.5), ValueError, r"within \[0, 1\]"),
    (dict(recompute_ratio=-0.1), ValueError, r"within \[0, 1\]"),
    (dict(recompute_ratio=math.nan), ValueError, "finite"),
    (dict(recompute_ratio="0.2"), TypeError, "recompute_ratio"),
    (dict(max_new_tokens=2.9), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(temperature=math.nan), ValueError, "temperature must be finite"),
    (dict(temperature=math.inf), ValueError, "temperature must be finite"),
    (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
    (dict(temperature="0"), TypeError, "temperature"),
    (dict(temperature=False), TypeError, "temperature"),
    (dict(top_p=0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(seed=True), TypeError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(stop=[""]), ValueError, "empty"),
    (dict(stop=5), TypeError, "stop"),
    (dict(stop=["a", 5]), TypeError, r"stop\[1\]"),
    (dict(stop=[f"s{i}" for i in range(17)]), ValueError, "at most 16 distinct stop strings .*got 17"),
    (dict(mode="fast"), ValueError, "valid modes"),
    (dict(mode=None), TypeError, "mode"),
    (dict(selection="best"), ValueError, "valid selections"),
]


@pytest.fixture(scope="module")
def idle_engine(lm):
    """An engine that only ever receives bad requests: its store stays empty."""
    with make_engine(lm) as engine:
        yield engine


@pytest.mark.parametrize("kwargs,error,match", BAD_GENERATE)
def test_bad_arguments_are_clean_errors(idle_engine, kwargs, error, match):
    kwargs = {"documents": DOCS} | kwargs
    documents = kwargs.pop("documents")
    with pytest.raises(error, match=match):
        idle_engine.generate(QUESTION, documents, **kwargs)
    with pytest.raises(error, match=match):
        idle_engine.generate_stream(QUESTION, documents, **kwargs)  # checked at the call, before any work
    assert list(idle_engine.store.keys()) == []  # nothing was computed


def test_bad_queries_ingests_and_messages(lm, tmp_path):
    with make_engine(lm, tmp_path) as engine:
        with pytest.raises(TypeError, match="wrap it in a list"):
            engine.ingest("one document")
        with pytest.raises(TypeError, match=r"documents\[0\]"):
            engine.ingest([None, 5])
        with pytest.raises(TypeError):
            engine.generate(b"bytes", DOCS)
        with pytest.raises(ValueError, match="empty query"):
            engine.generate("   ", DOCS)
        with pytest.raises(ValueError, match="at least one user message"):
            engine.generate([{"role": "system", "content": "x"}], DOCS)
        with pytest.raises(ValueError, match="role 'tool'"):
            engine.generate([{"role": "tool", "content": "x"}], DOCS)
        with pytest.raises(TypeError, match=r"messages\[0\]"):
            engine.generate([{"role": "user", "content": 5}], DOCS)
        with pytest.raises(TypeError, match="Document.text"):
            Document(5)
        with pytest.raises(ValueError, match="Document.id"):
            Document("x", id=" ")
        with pytest.raises(TypeError, match="message must be a str"):
            engine.chat("s", ["hi"])
        with pytest.raises(TypeError, match="wrap it in a list"):
            engine.chat("s", "hi", documents="doc")
        with pytest.raises(TypeError, match="max_new_tokens"):
            engine.chat("s", "hi", max_new_tokens=2.5)
        with pytest.raises(TypeError, match="system"):
            engine.chat("s", "hi", system=5)
        with pytest.raises(TypeError, match="document id"):
            engine.delete_document(5)
        with pytest.raises(KeyError, match="unknown to this engine"):
            engine.delete_document("never-ingested")
        with pytest.raises(TypeError, match="sync must be a bool"):
            engine.ingest(DOCS, sync="no")
        with pytest.raises(TypeError, match="config path"):
            BlendEngine.from_config(5)
        assert list(engine.store.keys()) == []


@pytest.mark.parametrize("bad", [".", "..", "a/b", "/", "line\nbreak", "tab\there", "nul\x00", "del\x7f",
                                 "c1\x85", "\ud800", "x" * 257, " ", ""])
def test_a_document_id_that_cannot_round_trip_through_a_url_path_is_refused_naming_the_rule(bad):
    with pytest.raises(ValueError, match=r"Document\.id .*a document id is 1 to 256 characters, not all whitespace, "
                                         r"without '/', control characters or unpaired surrogates, and is not "
                                         r"'\.' or '\.\.'"):
        Document("text", id=bad)


@pytest.mark.parametrize("blank", [" ", "   ", "\u2003", "\u00a0 "])
def test_a_blank_id_is_refused_by_the_rule_it_breaks_not_called_empty(blank):
    """The rule states what the check refuses: an id of spaces is 1 character or more, so it is
    refused as all whitespace (a rule of its own), not as 'empty'."""
    from blend.prompt.document import ID_RULE

    with pytest.raises(ValueError) as refused:
        Document("text", id=blank)
    assert "is all whitespace" in str(refused.value) and "is empty" not in str(refused.value)
    assert "not all whitespace" in ID_RULE


def test_document_ids_within_the_rule_are_taken_as_they_are():
    for good in ["doc-7", "a b", "sha256:0f", "?#%&=+", "Ünïcödé ✓", "...", ".a", "x" * 256, "\U0001f600"]:
        assert Document("text", id=good).id == good


def test_a_closed_engine_says_so_before_any_work(lm):
    engine = make_engine(lm)
    early = engine.generate_stream(QUESTION, DOCS)  # created before close, started after it
    engine.close()
    calls = [lambda: engine.ingest(DOCS), lambda: engine.generate(QUESTION, DOCS),
             lambda: list(engine.generate_stream(QUESTION, DOCS)), lambda: engine.chat("s", "hi"),
             lambda: engine.delete_document("x"), lambda: engine.offload("s"), lambda: engine.drop("s"),
             lambda: next(early)]
    for call in calls:
        with pytest.raises(ValueError, match="this BlendEngine is closed"):
            call()
    engine.close()  # closing twice is harmless


def test_a_set_of_documents_is_refused_for_its_order(lm):
    with make_engine(lm) as engine, pytest.raises(TypeError, match="got set .*a set has no order"):
        engine.generate(QUESTION, set(DOCS))


def test_repeated_stop_strings_count_once():
    from blend.engine.request import check_stop

    assert check_stop(["a"] * 20 + ["b", "a"]) == ("a", "b")
