"""An LCEL RAG app written as LangChain's docs write it (its own vector store retriever over
the user's notes, its own template, its own stop string), swapped onto PerCache as the
README shows, with idle rounds between questions: every answer is stock
``llama_cpp.Llama``'s text for the same prompt, the app's request shape is learned, idle
work stores the leading states of the app's prompts (not PerCache's own) and the app's
identical request for a predicted question is answered from what idle work stored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from benchmarks.stock import stock_llama
from percache_core.inspection import internals
from percache_langchain import PerCacheLLM, PerCacheRetriever

TEMPLATE = "Use the notes to answer briefly.\n\n{context}\n\nQuestion: {question}\nAnswer:"
QUESTIONS = ("When is the presentation rehearsal for the launch talk?", "Who repairs the boiler?")


class MiniLM(Embeddings):
    def __init__(self, embedder) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


@pytest.fixture
def stock(model_path) -> Iterator[object]:
    llm = stock_llama(model_path, n_ctx=2048, threads=2)
    yield llm
    llm.close()


def stock_text(stock, prompt: str, stop: list[str] | None) -> str:
    """Stock's text from an empty context (its prefix reuse cuts the prefill where the previous
    prompt ends, which can change the text: measured here, ' 10 April.' against ' 12 May ...')."""
    stock.reset()
    return stock(prompt, max_tokens=24, temperature=0.0, stop=stop or [])["choices"][0]["text"]


def test_an_lcel_app_gains_idle_work_in_its_own_requests_with_stocks_text(make_cache, embedder, corpus, stock):
    pc = make_cache("lcel", documents=False)
    notes = [Document(d["text"], id=d["id"]) for d in corpus["documents"]]
    pc.add_documents([{"id": d.id, "text": d.page_content} for d in notes], split=False)
    store = InMemoryVectorStore.from_documents(notes, MiniLM(embedder))
    retriever = PerCacheRetriever(inner=store.as_retriever(search_kwargs={"k": 2}), percache=pc)
    prompts: list[str] = []
    template = PromptTemplate.from_template(TEMPLATE)

    def keep(prompt_value):
        prompts.append(prompt_value.to_string())
        return prompt_value

    join = lambda docs: "\n\n".join(d.page_content for d in docs)  # noqa: E731
    llm = PerCacheLLM(percache=pc, max_new_tokens=24, stop=["\n"])
    chain = {"context": retriever | join, "question": RunnablePassthrough()} | template | keep | llm | StrOutputParser()
    reports = []
    for question in QUESTIONS:
        assert chain.invoke(question) == stock_text(stock, prompts[-1], ["\n"])
        if not reports:  # one idle round, after the first question
            reports.append(pc.warm(progress=False, max_seconds=20, max_predictions=2))
    shapes = pc.stats()["app_requests"]["shapes"]
    assert len(shapes) == 1 and shapes[0]["passages"] == 2 and shapes[0]["predicts"]
    assert shapes[0]["agreement"] == 1.0  # the app's own retriever rebuilds its requests exactly
    assert sum(r.app_states_prefilled for r in reports) > 0
    assert {node.label for node in internals(pc).tree.nodes} == {"text"}  # no state of PerCache's own prompt
    predicted = [q for r in reports for q in r.predicted]
    if any(r.app_answers_stored for r in reports):  # a predicted question, asked by the app
        before = pc.stats()["prompt_answers"]
        assert chain.invoke(predicted[0]) == stock_text(stock, prompts[-1], ["\n"])
        assert pc.stats()["prompt_answers"] == before + 1  # answered from what idle work stored
    # a new question restores the leading state of [instructions + its first note]
    assert chain.invoke("Which room is the launch talk rehearsal in?") == stock_text(stock, prompts[-1], ["\n"])
    assert pc.stats()["chunk_state_hits"] >= 1


def test_the_readme_llm_adds_no_stop_string_the_app_did_not_set(make_cache, stock):
    pc = make_cache("plain")
    prompt = "Use the notes to answer briefly.\n\nThe rehearsal is on Thursday at 4 pm.\n\nQuestion: When?\nAnswer:"
    assert PerCacheLLM(percache=pc, max_new_tokens=24).invoke(prompt) == stock_text(stock, prompt, None)
    assert PerCacheLLM(percache=pc, max_new_tokens=24).invoke(prompt, stop=["."]) == stock_text(stock, prompt, ["."])
