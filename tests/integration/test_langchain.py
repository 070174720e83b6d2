"""The LangChain adapter: the standard cache suites, a real LCEL chain, the real model."""

import importlib.util
import sys
from pathlib import Path

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.globals import set_llm_cache
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.outputs import Generation
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda
from langchain_tests.integration_tests import (
    AsyncCacheTestSuite,
    ChatModelIntegrationTests,
    SyncCacheTestSuite,
)
from langchain_tests.unit_tests import ChatModelUnitTests

from percache_core import InvalidQuestionError, MissingDependencyError, PerCache, PerCacheConfig
from percache_core.inspection import internals
from percache_langchain import (
    PerCacheChatModel,
    PerCacheLLM,
    PerCacheLLMCache,
    PerCacheRetriever,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTES = [
    Document(
        page_content="The rehearsal for the launch talk is on Thursday at 4 pm in the Birch room.", id="r"
    ),
    Document(page_content="Finance approved 18,500 euros for the Harbor design work.", id="b"),
]


def empty_cache(tmp_path, engine, embedder) -> PerCacheLLMCache:
    return PerCacheLLMCache(PerCache.open(tmp_path / "lc", engine=engine, embedder=embedder))


class TestSyncCache(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, tmp_path, engine, embedder):
        return empty_cache(tmp_path, engine, embedder)


class TestAsyncCache(AsyncCacheTestSuite):
    @pytest.fixture
    async def cache(self, tmp_path, engine, embedder):
        return empty_cache(tmp_path, engine, embedder)


class _ChatModelOnACache:
    """The standard suites' ``chat_model_params`` need a PerCache: one on the shared engine."""

    @pytest.fixture(autouse=True)
    def _percache(self, make_cache):
        type(self).percache = make_cache("chat", documents=False, max_new_tokens=16)

    @property
    def chat_model_class(self):
        return PerCacheChatModel

    @property
    def chat_model_params(self):
        # the bundled Gemma is a base model with no template in its file: stock's llama-2
        # fallback makes it answer "" to the suites' one-word prompts, which they refuse;
        # llama.cpp's built-in Gemma template is what a user of this model would name
        return {"percache": type(self).percache, "chat_template": "gemma"}

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestChatModelUnit(_ChatModelOnACache, ChatModelUnitTests):
    pass


class TestChatModelIntegration(_ChatModelOnACache, ChatModelIntegrationTests):
    pass


class FixedRetriever(BaseRetriever):
    def _get_relevant_documents(self, query, *, run_manager):
        return list(NOTES)


class RetrieverEvents(BaseCallbackHandler):
    def __init__(self):
        self.starts = 0

    def on_retriever_start(self, *args, **kwargs):
        self.starts += 1


def prompt_for(question: str) -> str:
    context = "\n\n".join(d.page_content for d in NOTES)
    return f"Use the notes.\n\n{context}\n\nQuestion: {question}\nAnswer:"


def test_exact_mode_serves_only_the_same_prompt_and_llm_string(make_cache):
    pc = make_cache(documents=False)
    cache = PerCacheLLMCache(pc)
    cache.update("prompt one", "model A", [Generation(text="one")])
    assert cache.lookup("prompt one", "model B") is None
    assert cache.lookup("prompt one", "model A") == [Generation(text="one")]
    retriever = PerCacheRetriever(inner=FixedRetriever(), percache=pc)
    retriever.invoke("When is the launch talk rehearsal?")
    cache.update(
        prompt_for("When is the launch talk rehearsal?"), "model A", [Generation(text="Thursday 4 pm")]
    )
    assert cache.lookup(prompt_for("When is the launch talk rehearsal?"), "model A") == [
        Generation(text="Thursday 4 pm")
    ]
    retriever.invoke("When is the rehearsal for the launch talk?")
    assert cache.lookup(prompt_for("When is the rehearsal for the launch talk?"), "model A") is None
    # idle prediction learns from the user's questions, not from the prompts used as keys
    assert list(internals(pc).parts.activity.history)[-2:] == [
        "When is the launch talk rehearsal?",
        "When is the rehearsal for the launch talk?",
    ]
    cache.lookup("x" * 5000, "model A")  # a long prompt of an unknown question joins no history
    assert all(len(question) < 600 for question in internals(pc).parts.activity.history)
    cache.clear()
    assert cache.lookup("prompt one", "model A") is None


def test_semantic_mode_keys_on_the_question_and_binds_the_prompt_around_it(make_cache):
    pc = make_cache(documents=False, qa_mode="semantic", max_error_rate=1.0, similarity_threshold=0.8)
    cache = PerCacheLLMCache(pc)
    retriever = PerCacheRetriever(inner=FixedRetriever(), percache=pc)
    retriever.invoke("When is the launch talk rehearsal?")
    cache.update(
        prompt_for("When is the launch talk rehearsal?"), "model A", [Generation(text="Thursday 4 pm")]
    )
    stored = {e.question for e in internals(pc).qa_bank.entries}
    assert "When is the launch talk rehearsal?" in stored  # the question, not the long prompt
    retriever.invoke("When is the rehearsal for the launch talk?")
    hit = cache.lookup(prompt_for("When is the rehearsal for the launch talk?"), "model A")
    assert hit == [Generation(text="Thursday 4 pm")]
    german = prompt_for("When is the rehearsal for the launch talk?").replace(
        "Use the notes.", "Use the notes and answer in German."
    )
    assert cache.lookup(german, "model A") is None  # another chain's prompt: another binding
    assert cache.lookup(prompt_for("When is the rehearsal for the launch talk?"), "model B") is None


def test_llm_reuses_document_states_and_matches_the_cache_off(make_cache):
    off = make_cache("off", documents=False, qa_bank=False, chunk_states=False)
    on = make_cache("on", documents=False, qa_bank=False)
    results = {}
    for name, pc in (("off", off), ("on", on)):
        events = RetrieverEvents()
        retriever = PerCacheRetriever(inner=FixedRetriever(), percache=pc)
        retriever.invoke("When is the rehearsal?", config={"callbacks": [events]})
        assert events.starts == 2  # the wrapper and the inner retriever both report
        llm = PerCacheLLM(percache=pc)
        # another prompt in between: the context no longer holds the notes, a stored state does
        asks = ("When is the rehearsal?", None, "Where is the rehearsal?")
        results[name] = [llm.invoke(prompt_for(q) if q else "Say hello in one word.") for q in asks]
    assert results["on"] == results["off"]
    assert on.stats()["chunk_state_hits"] == 1 and on.stats()["reused_tokens"] > 0
    assert len(internals(on).knowledge) == 2  # the retriever added the documents


def test_streaming_gives_the_invoke_text(make_cache):
    pc = make_cache(documents=False, qa_bank=False)
    PerCacheRetriever(inner=FixedRetriever(), percache=pc).invoke("How much did finance approve?")
    llm = PerCacheLLM(percache=pc)
    text = llm.invoke(prompt_for("How much did finance approve?"))
    pieces = list(llm.stream(prompt_for("How much did finance approve?")))
    assert len(pieces) >= 1 and "".join(pieces) == text


@pytest.mark.model  # runs the real model in this process or a subprocess
def test_the_lcel_example_runs_and_shows_each_source(tmp_path):
    spec = importlib.util.spec_from_file_location("langchain_lcel", EXAMPLES / "langchain_lcel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(str(tmp_path / "example"))
    assert [r["source"] for r in results] == ["full", "qa_bank", "chunk_states"]


def test_bad_input_gets_clear_errors(monkeypatch):
    with pytest.raises(TypeError, match="PerCache"):
        PerCacheLLMCache("not a cache")
    with pytest.raises((TypeError, ValueError), match="PerCache"):
        PerCacheRetriever(inner=FixedRetriever(), percache=object())
    with pytest.raises((TypeError, ValueError), match="PerCache"):
        PerCacheLLM(percache=PerCacheConfig())
    from percache_langchain._imports import require_langchain

    monkeypatch.setitem(sys.modules, "langchain_core", None)
    with pytest.raises(MissingDependencyError, match=r"pip install \"percache-langchain\""):
        require_langchain()


def test_an_empty_question_is_refused_by_the_chain_before_any_work(make_cache):
    pc = make_cache("empty", documents=False)
    chain = PerCacheRetriever(inner=FixedRetriever(), percache=pc) | RunnableLambda(lambda docs: "never")
    for question in ("", "   "):
        with pytest.raises(InvalidQuestionError, match="empty"):
            chain.invoke(question)
    assert pc.chunk_count == 0  # nothing was retrieved or added


def test_chat_model_keeps_the_text_with_or_without_cache_for_two_chains(make_cache):
    chains = {
        "brief": ChatPromptTemplate.from_messages(
            [("system", "Answer briefly from the notes."), ("human", "{context}\n\nQuestion: {question}")]
        ),
        "quote": ChatPromptTemplate.from_messages(
            [("system", "Quote the note that answers."), ("human", "Notes:\n{context}\n\nAsk: {question}")]
        ),
    }
    questions = ["When is the rehearsal?", "How much did finance approve?"]

    def outputs(pc, cache):
        retriever = PerCacheRetriever(inner=FixedRetriever(), percache=pc)
        context = RunnableLambda(lambda q: "\n\n".join(d.page_content for d in retriever.invoke(q)))
        model = PerCacheChatModel(percache=pc, max_new_tokens=16, cache=cache)
        results = {}
        for name, prompt in chains.items():
            chain = {"context": context, "question": RunnableLambda(lambda q: q)} | prompt | model
            results[name] = [chain.invoke(q).content for q in questions + questions[:1]]
        return results

    off = make_cache("off", documents=False, qa_bank=False, chunk_states=False)
    expected = outputs(off, False)
    shared = make_cache("shared", documents=False)
    first = outputs(shared, PerCacheLLMCache(shared))
    assert first == expected
    entries = len(internals(shared).qa_bank)
    assert entries == 4  # two chains x two questions; the repeats were served
    assert outputs(shared, PerCacheLLMCache(shared)) == expected  # all from the cache now
    assert len(internals(shared).qa_bank) == entries
    # the notes' states were kept; each chain's later questions went on from the context
    assert shared.stats()["chunk_states"]["nodes"] > 0 and shared.stats()["reused_tokens"] > 0


def test_chat_model_stream_goes_through_the_llm_cache(make_cache):
    pc = make_cache(documents=False)
    cache = PerCacheLLMCache(pc)
    model = PerCacheChatModel(percache=pc, max_new_tokens=12, cache=cache)
    messages = [SystemMessage("Be brief."), HumanMessage("Name a fruit.")]
    streamed = list(model.stream(messages))
    text = "".join(c.content for c in streamed)
    assert text and streamed[-1].usage_metadata["output_tokens"] >= 1
    assert len(internals(pc).qa_bank) == 1  # the streamed answer was stored under invoke's key
    assert model.invoke(messages).content == text
    assert len(internals(pc).qa_bank) == 1 and "".join(c.content for c in model.stream(messages)) == text
    uncached = PerCacheChatModel(percache=pc, max_new_tokens=12, cache=False)
    assert uncached.invoke(messages).content == text
    set_llm_cache(None)


def chain_on(pc, cache, max_new_tokens=16):
    """An app's LCEL chain: retrieved notes and the question in a chat prompt, PerCache's
    chat model with *cache* as its LLM cache."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer briefly from the notes."), ("human", "{context}\n\nQuestion: {question}")]
    )
    retriever = PerCacheRetriever(inner=FixedRetriever(), percache=pc)
    context = RunnableLambda(lambda q: "\n\n".join(d.page_content for d in retriever.invoke(q)))
    model = PerCacheChatModel(percache=pc, max_new_tokens=max_new_tokens, cache=cache)
    return {"context": context, "question": RunnableLambda(lambda q: q)} | prompt | model


def test_idle_prediction_through_the_apps_chain_fills_its_llm_cache(make_cache):
    plain = chain_on(make_cache("off", documents=False, qa_bank=False, chunk_states=False), False)
    pc = make_cache("warm", documents=False)
    chain = chain_on(pc, PerCacheLLMCache(pc))
    question = "When is the rehearsal?"
    chain.invoke(question)
    entries, counted = len(internals(pc).qa_bank), pc.stats()["queries"]
    report = pc.warm(max_predictions=2, progress=False, answer=lambda q: bool(chain.invoke(q).content))
    assert report.predicted and len(internals(pc).qa_bank) > entries  # the chain's answers, in its LLM cache
    assert list(internals(pc).parts.activity.history) == [question] and pc.stats()["queries"] == counted
    hits = pc.stats()["qa_bank_hits"]
    for predicted in report.predicted:
        assert chain.invoke(predicted).content == plain.invoke(predicted).content
    assert pc.stats()["qa_bank_hits"] - hits == len(report.predicted)  # each served by the cache


def test_a_batch_of_eight_at_four_at_once_answers_as_each_asked_alone(make_cache):
    questions = [
        f"{ask} {topic}?"
        for ask in ("When is", "Who approved")
        for topic in ("the rehearsal", "the launch talk", "the Harbor design work", "the budget")
    ]
    plain = chain_on(make_cache("off", documents=False, qa_bank=False, chunk_states=False), False, 8)
    alone = [plain.invoke(q).content for q in questions]
    pc = make_cache("batched", documents=False)
    batched = chain_on(pc, PerCacheLLMCache(pc), 8).batch(questions, config={"max_concurrency": 4})
    assert [m.content for m in batched] == alone
    assert len(internals(pc).qa_bank) == 8


def test_the_names_of_0_2_import_with_a_deprecation_warning():
    import percache_langchain

    renamed = {
        "PerCacheLlamaCPP": PerCacheLLM,
        "PerCacheChatLlamaCPP": PerCacheChatModel,
        "PerCacheSemanticCache": PerCacheLLMCache,
    }
    for old, new in renamed.items():
        with pytest.warns(DeprecationWarning, match=f"{old} is now {new.__name__}"):
            assert getattr(percache_langchain, old) is new
    with pytest.raises(AttributeError):
        percache_langchain.PerCacheNothing  # noqa: B018
