"""The engine's self-checks in the flows users run, on the real model: never inside an
answer, run by the first idle round (or ``preload()``), their cost shown in ``stats()``,
and a state layout proved up to the engine's ``n_ctx``. Each test opens an engine of its
own setting under an empty ``PERCACHE_HOME``: a new user's first session."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.prompts import PromptTemplate

from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
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


def test_a_first_session_answers_before_the_checks_and_the_first_idle_round_proves_n_ctx(
    tmp_path, model_path, new_engine, embedder, corpus
):
    config = PerCacheConfig(max_new_tokens=16, knowledge_prefill_neighbours=1)
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

        pc.warm(max_predictions=2)  # the first idle round runs the checks, then fills states
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
    from llama_cpp import Llama

    pc = make_cache("tutorial", documents=False)
    llm = PerCacheLLM(percache=pc, max_new_tokens=16)
    prompt = PromptTemplate.from_template(TUTORIAL)
    stock = Llama(str(model_path), n_ctx=2048, n_batch=512, n_threads=2, verbose=False)
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
