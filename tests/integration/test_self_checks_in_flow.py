"""The engine's self-checks in the flows users run, on the real model: never inside an
answer, run by the first idle round (or ``preload()``), their cost shown in ``stats()``,
and a state layout proved up to the engine's ``n_ctx``. Each test opens an engine of its
own setting under an empty ``PERCACHE_HOME``: a new user's first session."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.prompts import PromptTemplate

from benchmarks.stock import stock_llama
from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.engines.llama_cpp.kind import KIND, self_checks
from percache_core.inspection import internals
from percache_langchain import PerCacheLLM

CHECKS = {"cut_rule", "state_layout", "draft_bound", "drafts_pay"}
# LangChain's RAG tutorial: the question before the context
TUTORIAL = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, just say that you don't know. Use three "
    "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)


@pytest.fixture
def new_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "percache-home"
    monkeypatch.setenv("PERCACHE_HOME", str(home))
    return home


@pytest.fixture
def new_engine(model_path: Path, new_home: Path):
    engine = LlamaEngine(model_path, n_ctx=2048, n_batch=256)  # a setting no other test measured
    yield engine
    engine.close()


# -- the flows after the first: every check but the state layout known from an earlier
# process (measured once below), so that each flow proves the reach its own way, in
# seconds rather than the 25 s of all the checks

FLOW_SETTING = dict(n_ctx=1024, n_batch=256)  # between one and three of Gemma 3's windows
EARLIER_CHECKS = ("cut_rule", "draft_bound", "drafts_pay")


@pytest.fixture(scope="module")
def earlier_checks(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The verdict file an earlier process of the flows' setting left: every check but the
    state layout."""
    home = tmp_path_factory.mktemp("earlier-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PERCACHE_HOME", str(home))
        engine = LlamaEngine(model_path, **FLOW_SETTING)
        try:
            checks = self_checks(engine)
            for name in EARLIER_CHECKS:
                checks[name][1]()
        finally:
            engine.close()
    return (home / "self_checks.json").read_text("utf-8")


@pytest.fixture
def flow_engine(model_path: Path, new_home: Path, earlier_checks: str):
    """An engine of the flows' setting whose home holds the earlier process's verdicts."""
    new_home.mkdir(parents=True, exist_ok=True)
    (new_home / "self_checks.json").write_text(earlier_checks, "utf-8")
    engine = LlamaEngine(model_path, **FLOW_SETTING)
    assert KIND.pending_checks(engine) == ["state_layout"]
    yield engine
    engine.close()


def test_a_first_session_answers_before_the_checks_and_the_first_idle_round_proves_n_ctx(
    tmp_path, model_path, new_engine, embedder, corpus
):
    # (no question prediction and no pairs: they are tested apart, and the checks run before them)
    config = PerCacheConfig(max_new_tokens=16, knowledge_prefill_neighbours=0, prediction=False)
    reference = PerCache.open(tmp_path / "off", config=config.replace(chunk_states=False, qa_bank=False),
                              engine=new_engine, embedder=embedder)
    pc = PerCache.open(tmp_path / "on", config=config.replace(qa_bank=False), engine=new_engine, embedder=embedder)
    with reference, pc:
        for cache in (reference, pc):
            cache.add_documents(corpus["documents"])
        question = "When is the presentation rehearsal for the launch talk?"
        first = pc.answer(question)
        report = pc.stats()["engine_self_check"]
        assert first.source == "full" and set(report["pending"]) == CHECKS and report["checks"] == {}
        assert internals(pc).runtime.checks_ready() is False and not list(internals(pc).tree.nodes)

        pc.warm()  # the first idle round runs the checks, then fills states
        report = pc.stats()["engine_self_check"]
        assert report["pending"] == [] and set(report["checks"]) >= CHECKS
        assert report["state_layout"]["reach_tokens"] == new_engine.n_ctx == report["n_ctx"]
        assert all(c["seconds"] > 0 and c["measured_by"] == "this process" for c in report["checks"].values())
        again = pc.answer("Who repairs the boiler?")
        assert again.reused_tokens > 0 and again.text == reference.answer("Who repairs the boiler?").text
        assert pc.answer(question).text == first.text == reference.answer(question).text
        measured = report["checks"]

    # a new process (a new engine of the same build, model and setting) reads them from disk
    again = LlamaEngine(model_path, n_ctx=new_engine.n_ctx, n_batch=new_engine.n_batch)
    try:
        with PerCache.open(tmp_path / "next", engine=again, embedder=embedder) as pc:
            assert internals(pc).runtime.checks_ready()
            report = pc.stats()["engine_self_check"]
            assert report["pending"] == [] and set(report["checks"]) == set(measured)
            assert all(report["checks"][n]["seconds"] == pytest.approx(c["seconds"], abs=1e-3) for n, c in measured.items())
            assert all(c["measured_by"] == "an earlier process" for c in report["checks"].values())
    finally:
        again.close()


def test_a_question_first_prompt_restores_its_instructions_with_stocks_text(make_cache, model_path):
    pc = make_cache("tutorial", documents=False)
    llm = PerCacheLLM(percache=pc, max_new_tokens=16)
    prompt = PromptTemplate.from_template(TUTORIAL)
    stock = stock_llama(model_path, n_ctx=2048, threads=2)
    context = "The rehearsal for the launch talk is on Thursday at 4 pm in the Birch room."
    try:
        answers = []
        for question in ("When is the rehearsal?", "Where is the launch talk rehearsed?"):
            text = prompt.format(question=question, context=context)
            stream = pc.caller.complete(text, documents=[context], question=question, stream=True)
            answers.append(("".join(stream), stream.answer))
            stock.reset()
            assert answers[-1][0] == stock(text, max_tokens=24, temperature=0.0)["choices"][0]["text"][: len(answers[-1][0])]
        first, second = (answer for _, answer in answers)
        assert first.reused_tokens == 0 and second.reused_tokens > 40  # the instructions, not the question
        assert second.reused_tokens < len(internals(pc).engine.tokenize(TUTORIAL.split("{question}")[0], True)) + 1
    finally:
        stock.close()
    assert llm.max_new_tokens == 16


# -- flows that run no idle round: the checks run in the background after the first answer

CHECKS_WAIT_S = 240.0  # the checks take about 20 s alone at n_ctx=2048 on 2 cores


def _proved_after_background_checks(pc: PerCache, engine: LlamaEngine) -> dict:
    """Wait for the background self-checks the first answer started; the report (every
    check known, the state layout measured in this process, the reach proved to ``n_ctx``)."""
    background = internals(pc).scheduler.background_checks
    assert background.running  # started by the answer that found the checks pending
    assert background.wait(timeout=CHECKS_WAIT_S)
    report = _proved_here(pc, engine)
    assert set(report["checks"]) == CHECKS  # no idle round ran: the checks alone
    return report


def _proved_here(pc: PerCache, engine: LlamaEngine) -> dict:
    """The report of a flow that found only the state layout pending: every check known,
    the layout measured in this process up to ``n_ctx``, the others read from disk."""
    report = pc.stats()["engine_self_check"]
    assert report["pending"] == [] and set(report["checks"]) >= CHECKS  # (an idle round measures more)
    by = {name: report["checks"][name]["measured_by"] for name in CHECKS}
    assert by == {**dict.fromkeys(EARLIER_CHECKS, "an earlier process"), "state_layout": "this process"}
    assert all(check["measured_at"] for check in report["checks"].values())
    assert report["state_layout"]["reach_tokens"] == engine.n_ctx == report["n_ctx"]
    return report


def test_pc_answer_alone_proves_n_ctx_in_the_background(tmp_path, flow_engine, embedder, corpus):
    config = PerCacheConfig(max_new_tokens=16, qa_bank=False)
    reference = PerCache.open(tmp_path / "off", config=config.replace(chunk_states=False),
                              engine=flow_engine, embedder=embedder)
    with PerCache.open(tmp_path / "on", config=config, engine=flow_engine, embedder=embedder) as pc, reference:
        for cache in (reference, pc):
            cache.add_documents(corpus["documents"])
        first = pc.answer("When is the presentation rehearsal for the launch talk?")
        assert first.source == "full" and not internals(pc).runtime.checks_ready()
        _proved_after_background_checks(pc, flow_engine)
        question = "Who repairs the boiler?"
        assert pc.answer(question).text == reference.answer(question).text  # keeps the states of its prompt
        again = pc.answer("Who repairs the boiler, and when?")
        assert again.reused_tokens > 0 and again.text == reference.answer("Who repairs the boiler, and when?").text


def _llamaindex_engine(tmp_path: Path, engine: LlamaEngine, corpus: dict):
    from llama_index.core import Document, VectorStoreIndex

    from percache_llamaindex import PerCacheEmbedding, PerCacheLlamaCPP, PerCacheQueryEngine

    documents = [Document(text=d["text"], id_=d["id"]) for d in corpus["documents"]]
    index = VectorStoreIndex.from_documents(documents, embed_model=PerCacheEmbedding())
    llm = PerCacheLlamaCPP(engine=engine, max_new_tokens=16)
    return PerCacheQueryEngine.from_index(index, cache_dir=tmp_path / "li", llm=llm, similarity_top_k=2)


def test_the_llamaindex_swap_without_warm_proves_n_ctx_in_the_background(tmp_path, flow_engine, corpus):
    query_engine = _llamaindex_engine(tmp_path, flow_engine, corpus)
    try:
        first = query_engine.query("When is the presentation rehearsal for the launch talk?")
        assert first.metadata["percache"]["source"] == "full"
        _proved_after_background_checks(query_engine.percache, flow_engine)
    finally:
        query_engine.close()


def test_the_llamaindex_swap_with_warm_proves_n_ctx_in_its_first_round(tmp_path, flow_engine, corpus):
    query_engine = _llamaindex_engine(tmp_path, flow_engine, corpus)
    try:
        query_engine.query("When is the presentation rehearsal for the launch talk?")
        query_engine.warm(max_seconds=8, progress=False)  # the check takes a few seconds of it
        _proved_here(query_engine.percache, flow_engine)
    finally:
        query_engine.close()


def test_a_langchain_chain_without_warm_proves_n_ctx_in_the_background(tmp_path, flow_engine, embedder, corpus):
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore

    from percache_langchain import PerCacheLLMCache, PerCacheRetriever

    class MiniLM(Embeddings):  # the README's
        def embed_documents(self, texts):
            return embedder.embed(texts).tolist()

        def embed_query(self, text):
            return self.embed_documents([text])[0]

    with PerCache.open(tmp_path / "lc", engine=flow_engine, embedder=embedder) as pc:
        notes = [Document(d["text"], id=d["id"]) for d in corpus["documents"]]
        store = InMemoryVectorStore.from_documents(notes, MiniLM())
        retriever = PerCacheRetriever(inner=store.as_retriever(search_kwargs={"k": 2}), percache=pc)
        prompt = PromptTemplate.from_template("Use the notes to answer briefly.\n\n{context}\n\nQuestion: {question}\nAnswer:")
        join = lambda docs: "\n\n".join(d.page_content for d in docs)  # noqa: E731
        llm = PerCacheLLM(percache=pc, cache=PerCacheLLMCache(pc), max_new_tokens=16)
        chain = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
        chain.invoke("When is the presentation rehearsal for the launch talk?")
        _proved_after_background_checks(pc, flow_engine)
        chain.invoke("Who repairs the boiler?")
        assert pc.stats()["chunk_states"]["nodes"] > 0  # answers keep states once the checks are known
