"""The request layout stage (blend.engine.layout) and the ingest bookkeeping (blend.kv.ingest):
a request's own template and split, carried per request (eval's way: no engine attribute
changes), laid out as an engine configured with them would."""

from __future__ import annotations

import pytest

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.engine.layout import MAX_TEMPLATES
from blend.engine.request import GenerationRequest
from blend.prompt.builder import QA, PromptTemplate
from blend.prompt.document import Document
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_engine import DOCS, QUESTION

TERSE = PromptTemplate(system="Answer from the passages, in one word.", query="Q: {question}\nA:")


def _engine(lm, **overrides) -> BlendEngine:
    overrides.setdefault("split", "off")
    store = {"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]}
    return BlendEngine(EngineConfig().with_overrides(store=store, chunk_tokens=24, **overrides), model=lm)


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", tokenizer=smollm2_tokenizer())


def test_a_request_s_template_lays_out_and_answers_as_an_engine_configured_with_it(lm):
    with _engine(lm) as engine, _engine(lm, system_prompt=TERSE.render_system(),
                                        query_template=TERSE.query) as configured:
        ours = engine.build_prompt(QUESTION, DOCS, template=TERSE)
        assert ours == configured.build_prompt(QUESTION, DOCS)
        assert ours.token_ids != engine.build_prompt(QUESTION, DOCS).token_ids
        engine.ingest(DOCS, template=TERSE)
        configured.ingest(DOCS)
        for mode in ("full", "blend"):
            got = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4, template=TERSE)
            want = configured.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4)
            assert got.token_ids == want.token_ids, mode
            assert (got.first_token_logprobs - want.first_token_logprobs).abs().max() < 1e-5
            assert got.stats.context_tokens == want.stats.context_tokens
        # documents computed after the template's system part (chunk_context: system) were found
        assert got.stats.documents.misses == 0 and got.stats.documents.hits > 0
        # the engine's own layout is untouched: a request without a template uses the configured one
        assert engine.prompts.system_prompt == QA.render_system()
        plain = engine.generate(QUESTION, DOCS, max_new_tokens=1)
        assert plain.stats.context_tokens == engine.build_prompt(QUESTION, DOCS).query.start


def test_an_ingest_under_another_template_is_not_what_a_request_loads(lm):
    """The ingest's template matters: its documents are computed after that template's system part."""
    with _engine(lm) as engine:
        engine.ingest(DOCS)  # the configured template
        got = engine.generate(QUESTION, DOCS, max_new_tokens=1, template=TERSE)
        assert got.stats.documents.misses > 0
        again = engine.generate(QUESTION, DOCS, max_new_tokens=1, template=TERSE)  # the misses were stored
        assert again.stats.documents.misses == 0


def test_request_options_are_checked_and_generate_many_takes_them(lm):
    with _engine(lm) as engine:
        with pytest.raises(TypeError, match="template must be a blend.prompt.builder.PromptTemplate"):
            engine.request(QUESTION, DOCS, template={"system": "s", "query": "q"})
        with pytest.raises(ValueError, match="unknown split 'never'; valid splits are: auto, adaptive, off"):
            engine.request(QUESTION, DOCS, split="never")
        with pytest.raises(TypeError, match="split must be a str"):
            engine.request(QUESTION, DOCS, split=False)
        with pytest.raises(TypeError, match="template must be"):
            engine.build_prompt(QUESTION, DOCS, template="Q: {question}")
        with pytest.raises(TypeError, match="template must be"):
            engine.ingest(DOCS, template="Q: {question}")
        req = engine.request(QUESTION, DOCS, template=TERSE, split="off")
        assert isinstance(req, GenerationRequest) and req.template is TERSE and req.split == "off"
        with pytest.raises(ValueError, match=r"requests\[0\]: unknown request key\(s\) colour; valid keys are: .*split"):
            engine.generate_many([{"query": QUESTION, "colour": "red"}])
        many = engine.generate_many([{"query": QUESTION, "documents": DOCS, "max_new_tokens": 2, "template": TERSE},
                                     {"query": QUESTION, "documents": DOCS, "max_new_tokens": 2}])
        alone = engine.generate(QUESTION, DOCS, max_new_tokens=2, template=TERSE)
        assert many[0].token_ids == alone.token_ids
        assert many[0].stats.context_tokens != many[1].stats.context_tokens


def test_the_layout_keeps_one_builder_per_template_and_the_engine_s_own_for_the_configured_one(lm):
    with _engine(lm) as engine:
        layout = engine.layout
        assert layout.builder(None) is engine.prompts is layout.builder(QA)  # QA is the configured template
        terse = layout.builder(TERSE)
        assert terse is layout.builder(PromptTemplate(TERSE.system, TERSE.query)) and terse is not engine.prompts
        for i in range(MAX_TEMPLATES + 3):
            layout.builder(PromptTemplate(system=f"System {i}.", query="{question}"))
        assert len(layout._builders) == MAX_TEMPLATES


def test_the_ingestor_records_ids_of_served_documents_and_deletes_them(lm):
    with _engine(lm) as engine:
        doc = Document(DOCS[0], id="lighthouse")
        first = engine.generate(QUESTION, [doc], max_new_tokens=1)
        assert "lighthouse" in engine.ingestor.index and first.warnings == ()
        changed = engine.generate(QUESTION, [Document(DOCS[1], id="lighthouse"), ""], max_new_tokens=1)
        assert changed.warnings[0].startswith("skipped 1 empty document(s)")
        assert "differs from the version seen before" in changed.warnings[1]
        keys = engine.delete_document("lighthouse")
        assert keys and "lighthouse" not in engine.ingestor.index
        assert not any(engine.store.contains(k) for k in keys)
        with pytest.raises(KeyError, match="unknown to this engine"):
            engine.delete_document("lighthouse")
