"""The LlamaIndex adapter with a real VectorStoreIndex, the real model and embedder."""

import asyncio
import sys
from pathlib import Path

import nbformat
import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.llms import MockLLM
from llama_index.core.schema import NodeWithScore, TextNode
from nbclient import NotebookClient

from percache_core import MissingDependencyError, PerCacheConfig
from percache_llamaindex import (
    PerCacheEmbedding,
    PerCacheLlamaCPP,
    PerCacheNodePostprocessor,
    PerCacheQueryEngine,
)

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


def open_engine(index, llm, tmp_path, name, **kwargs):
    config = kwargs.pop("config", PerCacheConfig(max_new_tokens=24))
    return PerCacheQueryEngine.from_index(
        index, cache_dir=tmp_path / name, llm=llm, config=config, similarity_top_k=2, **kwargs
    )


def test_miss_then_repeat_hit_then_exact_paraphrase_then_chunk_state_reuse(index, llm, tmp_path):
    engine = open_engine(index, llm, tmp_path, "a")
    first = engine.query(QUESTION)
    assert first.metadata["percache"]["source"] == "full" and len(first.source_nodes) == 2
    hit = engine.query(QUESTION)
    assert hit.metadata["percache"]["source"] == "qa_bank" and str(hit) == str(first)
    assert [n.node.get_content() for n in hit.source_nodes] == [
        n.node.get_content() for n in first.source_nodes
    ]
    off = open_engine(index, llm, tmp_path, "off", config=PerCacheConfig(max_new_tokens=24, qa_bank=False, chunk_states=False))
    paraphrase = engine.query(PARAPHRASE)  # a stored answer is only a draft: the output is exact
    assert str(paraphrase) == str(off.query(PARAPHRASE))
    reuse = engine.query("When is the presentation rehearsal for the launch talk?")
    assert reuse.metadata["percache"]["reused_tokens"] > 0
    engine.close()
    off.close()


def test_chunk_state_hit_gives_the_same_text_as_the_cache_off(index, llm, tmp_path):
    off = open_engine(
        index,
        llm,
        tmp_path,
        "off",
        config=PerCacheConfig(max_new_tokens=24, qa_bank=False, chunk_states=False),
    )
    on = open_engine(index, llm, tmp_path, "on", config=PerCacheConfig(max_new_tokens=24, qa_bank=False))
    expected = str(off.query(QUESTION))
    assert str(on.query(QUESTION)) == expected
    again = on.query(QUESTION)
    assert again.metadata["percache"]["source"] == "chunk_states" and str(again) == expected


def test_streaming_async_and_instrumentation(index, llm, tmp_path):
    events = []

    class Recorder(BaseEventHandler):
        def handle(self, event, **kwargs):
            events.append(type(event).__name__)

    dispatcher = get_dispatcher()
    handler = Recorder()
    dispatcher.add_event_handler(handler)
    try:
        streaming = open_engine(index, llm, tmp_path, "s", streaming=True)
        response = streaming.query(QUESTION)
        text = "".join(response.response_gen)
        assert text.strip() and response.metadata["percache"]["source"] == "full"
        answer = asyncio.run(open_engine(index, llm, tmp_path, "async").aquery(QUESTION))
        assert str(answer) == text.strip()
    finally:
        dispatcher.event_handlers.remove(handler)
    assert "QueryStartEvent" in events and "QueryEndEvent" in events


def test_other_llms_get_the_qa_bank_only(index, tmp_path):
    engine = PerCacheQueryEngine.from_index(
        index, cache_dir=tmp_path / "mock", llm=MockLLM(max_tokens=8), similarity_top_k=2
    )
    first = engine.query(QUESTION)
    assert first.metadata["percache"]["source"] == "full"
    assert not engine.percache.config.chunk_states
    assert engine.query(QUESTION).metadata["percache"]["source"] == "qa_bank"
    assert engine.query(PARAPHRASE).metadata["percache"]["source"] == "full"  # exact: same question only
    report = engine.warm(progress=False)  # idle prediction would answer with another model
    assert report.populated == 0 and not engine.percache.parts.runtime.engine_loaded
    semantic = PerCacheQueryEngine.from_index(
        index,
        cache_dir=tmp_path / "mock-semantic",
        llm=MockLLM(max_tokens=8),
        config=PerCacheConfig(qa_mode="semantic", similarity_threshold=0.8),
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
    assert len(pc.knowledge) == 2
    pc.generate("How much are tickets?", [c for c in reversed(pc.knowledge.chunks)])  # stores [n1, n0]
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
    assert "['full', 'qa_bank', 'chunk_states']" in printed
