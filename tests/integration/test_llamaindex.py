"""The LlamaIndex adapter with a real VectorStoreIndex, the real model and embedder."""

import asyncio
import sys
from pathlib import Path

import nbformat
import pytest
from llama_cpp import llama_chat_format
from llama_index.core import Document, PromptTemplate, VectorStoreIndex
from llama_index.core.llms import ChatMessage, MockLLM
from llama_index.core.postprocessor import SimilarityPostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from nbclient import NotebookClient

from percache_core import MissingDependencyError, PerCacheConfig
from percache_core.inspection import internals
from percache_llamaindex import (
    PerCacheEmbedding,
    PerCacheLlamaCPP,
    PerCacheNodePostprocessor,
    PerCacheQueryEngine,
)
from tests.suite_settings import SHORT_IDLE

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUESTION = "Which room is the launch talk rehearsal in?"
PARAPHRASE = "In which room is the rehearsal for the launch talk?"


@pytest.fixture(scope="module")
def index(embedder, corpus):
    documents = [Document(text=d["text"], doc_id=d["id"]) for d in corpus["documents"]]
    return VectorStoreIndex.from_documents(documents, embed_model=PerCacheEmbedding(embedder))


@pytest.fixture
def llm(engine):
    return PerCacheLlamaCPP(engine=engine, max_new_tokens=24)


def plain_and_cached(index, llm, tmp_path, name, **kwargs):
    """The app's own engine and the swapped one, with the same arguments (the cache's idle
    rounds as short as the suite's other caches': ``SHORT_IDLE``)."""
    plain = index.as_query_engine(llm=llm, similarity_top_k=2, **kwargs)
    config = PerCacheConfig(**SHORT_IDLE)
    cached = PerCacheQueryEngine.from_index(index, cache_dir=tmp_path / name, llm=llm, similarity_top_k=2, config=config, **kwargs)
    return plain, cached


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize"])
def test_answers_equal_the_apps_own_engine_in_every_response_mode(index, llm, tmp_path, mode):
    plain, cached = plain_and_cached(index, llm, tmp_path, mode, response_mode=mode)
    asked = [QUESTION, "When is the presentation rehearsal for the launch talk?", QUESTION]
    responses = [cached.query(q) for q in asked]
    assert [r.response for r in responses] == [plain.query(q).response for q in asked]
    sources = [r.metadata["percache"]["source"] for r in responses]
    # exact mode: the same question only; the second one's calls keep the shared nodes'
    # tokens the context holds (not restored chunks: "full", as each call's answer says)
    assert sources == ["full", "full", "qa_bank"]
    assert responses[1].metadata["percache"]["reused_tokens"] > 0
    stats = cached.percache.stats()  # the labels and the counters say the same thing
    calls = sum(r.metadata["percache"]["llm_calls"] for r in responses[:2])
    assert stats["full"] == calls and stats["chunk_state_hits"] == 0 and stats["qa_bank_hits"] == 1
    assert responses[0].metadata["percache"]["llm_calls"] >= 1
    assert [n.node.node_id for n in responses[2].source_nodes] == [n.node.node_id for n in responses[0].source_nodes]
    cached.close()


def test_postprocessors_and_the_empty_response_are_the_apps(index, llm, tmp_path):
    keep = [SimilarityPostprocessor(similarity_cutoff=0.1)]
    plain, cached = plain_and_cached(index, llm, tmp_path, "kept", node_postprocessors=keep)
    assert cached.query(QUESTION).response == plain.query(QUESTION).response
    nothing = [SimilarityPostprocessor(similarity_cutoff=1.01)]
    plain, cached = plain_and_cached(index, llm, tmp_path, "none", node_postprocessors=nothing)
    expected = plain.query(QUESTION).response
    assert expected == "Empty Response"
    assert [cached.query(QUESTION).response for _ in range(2)] == [expected, expected]
    assert len(internals(cached.percache).qa_bank) == 0  # nothing invented, nothing stored
    cached.close()


def test_an_insert_or_delete_takes_effect_at_the_next_question(embedder, corpus, llm, tmp_path):
    documents = [Document(text=d["text"], doc_id=d["id"]) for d in corpus["documents"]]
    index = VectorStoreIndex.from_documents(documents, embed_model=PerCacheEmbedding(embedder))
    plain, cached = plain_and_cached(index, llm, tmp_path, "insert")
    before = cached.query(QUESTION)
    assert before.response == plain.query(QUESTION).response
    index.insert(Document(text="The launch talk rehearsal is in the Maple room.", doc_id="moved"))
    after = cached.query(QUESTION)  # as an engine built now: LlamaIndex's own keep their node ids
    assert after.metadata["percache"]["source"] == "full"  # other nodes: the stored answer is not bound to them
    rebuilt = index.as_query_engine(llm=llm, similarity_top_k=2)
    assert after.response == rebuilt.query(QUESTION).response
    assert "moved" in {n.node.ref_doc_id for n in after.source_nodes}
    moved = [n.node.node_id for n in after.source_nodes if n.node.ref_doc_id == "moved"]
    states_with_moved = {node.key for node in internals(cached.percache).tree.nodes if node.label == "text"}
    assert states_with_moved and any(set(moved) & set(e.chunk_ids) for e in internals(cached.percache).qa_bank.entries)
    index.delete_ref_doc("moved", delete_from_docstore=True)
    cached.retrieve(QueryBundle(QUESTION))  # the engine sees the deletion: PerCache forgets the node
    assert not set(moved) & {c.doc_id for c in internals(cached.percache).knowledge.chunks}
    assert not any(set(moved) & set(e.chunk_ids) for e in internals(cached.percache).qa_bank.entries)
    assert not states_with_moved & {node.key for node in internals(cached.percache).tree.nodes}
    again = cached.query(QUESTION)
    rebuilt = index.as_query_engine(llm=llm, similarity_top_k=2)
    assert again.response == rebuilt.query(QUESTION).response == before.response
    assert "moved" not in {n.node.ref_doc_id for n in again.source_nodes}
    cached.close()


def test_idle_prediction_is_pre_empted_half_way_then_stores_the_apps_own_answers(index, llm, tmp_path):
    plain, cached = plain_and_cached(index, llm, tmp_path, "warm")
    cached.query(QUESTION)
    activity = internals(cached.percache).parts.activity
    checks = []

    def user_arrives() -> bool:  # true from the first check inside the engine's LLM call
        inside = activity.background_stop() is not None
        checks.append(inside)
        return inside

    entries = len(internals(cached.percache).qa_bank)
    stopped = cached.warm(max_predictions=2, progress=False, should_stop=user_arrives)
    assert stopped.predicted and stopped.preempted and not stopped.out_of_time
    assert True in checks and stopped.answers_stored == 0
    assert len(internals(cached.percache).qa_bank) == entries  # nothing half-answered was stored
    response = cached.query(stopped.predicted[0])
    assert response.metadata["percache"]["source"] != "qa_bank"
    assert response.response == plain.query(stopped.predicted[0]).response

    counted, last_activity = cached.percache.stats()["queries"], internals(cached.percache).last_activity
    report = cached.warm(max_predictions=2, progress=False)  # the next round, not pre-empted
    assert report.predicted and report.answers_stored >= 1
    # idle work is no user's: no history, no usage counts, no activity that delays the next round
    assert list(activity.history) == [QUESTION, stopped.predicted[0]]
    assert cached.percache.stats()["queries"] == counted
    assert internals(cached.percache).last_activity == last_activity
    served = 0
    for question in report.predicted:
        response = cached.query(question)
        assert response.response == plain.query(question).response
        served += response.metadata["percache"]["source"] == "qa_bank"
    assert served >= report.answers_stored  # each stored answer is the engine's own for its question
    cached.close()


def test_prompt_templates_and_llm_settings_are_the_apps(index, engine, tmp_path):
    short = PerCacheLlamaCPP(engine=engine, max_new_tokens=3, stop=["."])
    template = PromptTemplate("Notes:\n{context_str}\nQ: {query_str}\nA (one word):")
    plain, cached = plain_and_cached(index, short, tmp_path, "shared", text_qa_template=template)
    answer = cached.query(QUESTION)
    assert answer.response == plain.query(QUESTION).response
    assert len(engine.tokenize(answer.response)) <= 3 and "." not in answer.response
    default = PerCacheQueryEngine.from_index(index, cache_dir=tmp_path / "shared", llm=short, similarity_top_k=2)
    other = default.query(QUESTION)  # same cache folder, the default template: not served the other's answer
    assert other.metadata["percache"]["source"] == "full"
    assert other.response == index.as_query_engine(llm=short, similarity_top_k=2).query(QUESTION).response
    cached.close()
    default.close()


def test_streaming_and_async_answers_are_the_apps(index, llm, tmp_path):
    plain = index.as_query_engine(llm=llm, similarity_top_k=2)
    expected = plain.query(QUESTION).response
    streaming = PerCacheQueryEngine.from_index(
        index, cache_dir=tmp_path / "s", llm=llm, similarity_top_k=2, streaming=True
    )
    first = streaming.query(QUESTION)
    assert "".join(first.response_gen) == expected
    assert first.metadata["percache"]["llm_calls"] == 1  # known once the stream is consumed
    repeat = streaming.query(QUESTION)  # the streamed answer was stored
    assert repeat.metadata["percache"]["source"] == "qa_bank" and "".join(repeat.response_gen) == expected
    cached = PerCacheQueryEngine.from_index(index, cache_dir=tmp_path / "a", llm=llm, similarity_top_k=2)
    assert asyncio.run(cached.aquery(QUESTION)).response == expected
    streaming.close()
    cached.close()


def test_the_llm_completes_chats_and_streams_like_llama_index_llms(engine):
    llm = PerCacheLlamaCPP(engine=engine, max_new_tokens=12)
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Name a colour.")]
    prompt = llm.chat_prompt(messages)
    # this GGUF has no chat template: laid out as stock create_chat_completion does (llama-2)
    requests = [{"role": m.role.value, "content": m.content} for m in messages]
    assert prompt == llama_chat_format.format_llama2(messages=requests).prompt
    reply = llm.chat(messages)
    assert reply.message.content == llm.complete(prompt, formatted=True).text
    assert "".join(r.delta for r in llm.stream_chat(messages)) == reply.message.content
    assert asyncio.run(llm.achat(messages)).message.content == reply.message.content
    assert asyncio.run(llm.acomplete(prompt, formatted=True)).text == reply.message.content
    gemma = PerCacheLlamaCPP(engine=engine, chat_template="gemma")
    assert gemma.chat_prompt(messages).endswith("<start_of_turn>model\n")
    with pytest.raises(ValueError, match="non-empty"):
        llm.complete("")
    with pytest.raises(ValueError, match="stop"):
        PerCacheLlamaCPP(engine=engine, stop=[""])


def test_other_llms_get_the_qa_bank_only(index, tmp_path):
    engine = PerCacheQueryEngine.from_index(
        index, cache_dir=tmp_path / "mock", llm=MockLLM(max_tokens=8), similarity_top_k=2
    )
    first = engine.query(QUESTION)
    assert first.metadata["percache"]["source"] == "full"
    assert not engine.percache.config.tiers.chunk_states
    assert engine.query(QUESTION).metadata["percache"]["source"] == "qa_bank"
    assert engine.query(PARAPHRASE).metadata["percache"]["source"] == "full"  # exact: same question only
    report = engine.warm(progress=False)  # idle prediction would answer with another model
    assert report.populated == 0 and not internals(engine.percache).parts.runtime.engine_loaded
    semantic = PerCacheQueryEngine.from_index(
        index,
        cache_dir=tmp_path / "mock-semantic",
        llm=MockLLM(max_tokens=8),
        config=PerCacheConfig(qa_mode="semantic", max_error_rate=1.0, similarity_threshold=0.8),
        similarity_top_k=2,
    )
    semantic.query(QUESTION)
    served = semantic.query(PARAPHRASE).metadata["percache"]
    assert served["source"] == "qa_bank" and served["similarity"] >= 0.8
    engine.close()
    semantic.close()


def test_node_postprocessor_records_and_reorders(make_cache):
    pc = make_cache(documents=False, qa_bank=False)
    nodes = [
        NodeWithScore(node=TextNode(id_=f"n{i}", text=t), score=1.0)
        for i, t in enumerate(["The boat show is in March.", "Tickets cost 20 euros."])
    ]
    recorder = PerCacheNodePostprocessor(pc)
    assert recorder.postprocess_nodes(nodes) == nodes
    assert len(internals(pc).knowledge) == 0  # embedded by idle work, not on the answer's path
    assert len(internals(pc).knowledge.add_deferred(16)) == 2  # what the next idle round does first
    assert len(internals(pc).knowledge) == 2
    pc.caller.generate("How much are tickets?", [c for c in reversed(internals(pc).knowledge.chunks)])  # stores [n1, n0]
    reordering = PerCacheNodePostprocessor(pc, reorder=True)
    assert [n.node.node_id for n in reordering.postprocess_nodes(nodes)] == ["n1", "n0"]


def test_bad_input_gets_clear_errors(make_cache, monkeypatch):
    with pytest.raises(TypeError, match="LlamaIndex index"):
        PerCacheQueryEngine.from_index(object(), cache_dir="/tmp/never")
    with pytest.raises(TypeError, match="PerCache"):
        PerCacheNodePostprocessor("not a cache")
    from percache_llamaindex._imports import require_llama_index

    monkeypatch.setitem(sys.modules, "llama_index.core", None)
    with pytest.raises(MissingDependencyError, match=r"pip install \"percache-llamaindex\""):
        require_llama_index()


@pytest.mark.model  # runs the real model in this process or a subprocess
def test_the_notebook_runs_and_shows_each_source():
    notebook = nbformat.read(EXAMPLES / "llamaindex_quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3").execute()
    printed = "".join(
        o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs
    )
    assert "['full', 'qa_bank', 'full']" in printed  # the third keeps the shared nodes' tokens: not restored states
    assert "reused 0 tokens  Which room" not in printed


def test_eight_gathered_aqueries_answer_as_each_asked_alone(index, engine, corpus, tmp_path):
    llm = PerCacheLlamaCPP(engine=engine, max_new_tokens=8)
    questions = [f"What does the note about {d['id'].replace('-', ' ')} say?" for d in corpus["documents"]]
    questions += [q["question"] for q in corpus["demo_questions"]]
    questions = questions[:8]
    plain = index.as_query_engine(llm=llm, similarity_top_k=2)
    alone = [plain.query(q).response for q in questions]
    cached = PerCacheQueryEngine.from_index(index, cache_dir=tmp_path / "gathered", llm=llm, similarity_top_k=2)

    async def gathered():
        return await asyncio.gather(*(cached.aquery(q) for q in questions))

    responses = asyncio.run(gathered())
    assert [r.response for r in responses] == alone
    assert cached.percache.stats()["queries"] == 8
    cached.close()
