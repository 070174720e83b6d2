"""Existing apps before and after the swap, end to end over users' question sequences.

Each app is written as its framework's docs write it, over a user's documents (the chunks
PerCache made of them, so both sides retrieve from the same passages):

- ``langchain``: an LCEL chain ``{context: retriever | join, question} | prompt | llm |
  parser`` with its own ``InMemoryVectorStore`` retriever (the bundled MiniLM), its own
  template and ``"\\n"`` as its stop string; before on stock ``llama_cpp.Llama`` (as
  LangChain's ``LlamaCpp`` calls it: one model, its own prefix reuse on), after with the
  README's swap (``PerCacheRetriever`` around the same retriever, ``PerCacheLLM`` with
  ``PerCacheLLMCache``) and an idle round (``pc.warm``) before the first question and after
  each answer;
- ``llamaindex``: ``VectorStoreIndex`` + ``as_query_engine(similarity_top_k=k)`` on stock
  ``llama_cpp.Llama`` (before) against ``PerCacheQueryEngine.from_index`` with its own idle
  rounds (``engine.warm``);
- ``openai``: an LCEL chain with the same retriever, a chat template (system message with
  the notes, the question as the user's) and LangChain's ``ChatOpenAI``: before against a
  llama-server alone (its own caches on), after against ``percache serve`` over a
  llama-server of its own (only the URL differs), the user's documents in the endpoint's
  cache and its idle rounds (``pc.warm``, what ``--idle`` runs between requests); the fresh
  text is a third server's, with nothing reused (``cache_prompt: false``).

Questions are asked of both sides in turn, the order alternating per question (this
machine's speed drifts), idle rounds never overlap a timed question, and the states PerCache's
side took are written (untimed, as while its user reads the answer) before the other side
runs, so that its writer thread never shares the cores with a timed question. Reported per app and
user: mean latency before and after, the ratio, the answers identical to the app's own
fresh text (the before side's), where the time went (answers by source, restored and
prefilled tokens), the learned shapes and their agreement, and the idle seconds spent. A PNG of
each app's latency per user, before and after, is written beside the JSON.

    python -m benchmarks.apps --data ../shared/data --qmsum-users 1 --squad-users 1 \\
        --queries-per-user 8 --idle-seconds 20 --apps langchain,llamaindex,openai --models bundled,smollm2

By default the run starts from an empty ``PERCACHE_HOME`` (``--home new``): the first user's
run of each engine setting is a new user's first session (the engine's self-checks not yet
run when the cache opens: answers keep no state until an idle round ran them), reported
apart from later sessions (``summary.sessions``: ratio and slowest question of each; each
row's ``session``, ``self_checks`` and each question's ``checks_ready``).

``--evaluation-idle`` gives the apps the idle time the end-to-end evaluation gives PerCache's
own pipeline (``benchmarks.e2e``: two unbounded rounds before the first question, one after
each answer) instead of rounds of ``--idle-seconds``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.data_sets import User, add_user_arguments, users_from_arguments
from benchmarks.output import write_json
from benchmarks.stock import model_paths, stock_llama
from percache_core import LlamaServer, PerCache, PerCacheConfig, ServerLaunch
from percache_core.endpoint.serve import serving_in_thread
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals

TEMPLATE = "Answer the question from the notes below.\n\n{context}\n\nQuestion: {question}\nAnswer:"
SYSTEM = "Answer the question from the notes below, briefly.\n\n{context}"  # the openai app's system message
LANGCHAIN_TUTORIAL = (  # the prompt of LangChain's RAG tutorial: the question before the context
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, just say that you don't know. Use three "
    "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)
APPS = ("langchain", "llamaindex", "openai", "llamaindex_starter", "langchain_tutorial")


class Stock:
    """Stock ``llama_cpp.Llama`` (its prefix reuse on), greedy, as a framework's wrapper calls it."""

    def __init__(self, model_path: Path, threads: int, max_tokens: int, n_ctx: int = 2048) -> None:
        self.model = stock_llama(model_path, n_ctx, threads)
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx

    def complete(self, prompt: str, stop: Sequence[str] = ("\n",)) -> str:
        out = self.model.create_completion(prompt, max_tokens=self.max_tokens, temperature=0.0, stop=list(stop))
        return out["choices"][0]["text"]

    def fresh(self, run: Callable[[str], str], text: str) -> str:
        """``run(text)`` (a prompt completed, or the stock app asked) from an empty context:
        the fresh text (the prefix reuse of ``complete`` cuts the prefill where the previous
        prompt ends, which can change the text); not timed."""
        self.model.reset()
        return run(text)


def stock_llamaindex_llm(stock: Stock) -> Any:
    """What LlamaIndex's ``LlamaCPP`` does with these settings, on *stock* (its context window
    the model's ``n_ctx``, greedy, the answer ending at a line break)."""
    from llama_index.core.base.llms.types import CompletionResponse, LLMMetadata
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM

    class StockLlamaCPP(CustomLLM):
        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(context_window=stock.n_ctx, num_output=stock.max_tokens, model_name="stock")

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            return CompletionResponse(text=stock.complete(prompt))

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
            raise NotImplementedError

    return StockLlamaCPP()


def user_files(user: User) -> list[tuple[str, str]]:
    """The user's documents as whole files (name, text), as ``SimpleDirectoryReader`` reads a
    folder: the data set's chunks of one document (``<doc>#c<i>``) joined in order."""
    files: dict[str, list[str]] = {}
    for document in user.documents:
        files.setdefault(document["id"].split("#")[0], []).append(document["text"].strip())
    return [(name, "\n".join(parts)) for name, parts in files.items()]


def llamaindex_starter_sides(
    user: User, pc: PerCache, stock: Stock, engine: LlamaEngine, max_tokens: int, folder: Path
) -> tuple[Callable[[str], str], Callable[[str], str], Any]:
    """LlamaIndex's starter app with its defaults: the user's whole files,
    ``VectorStoreIndex.from_documents`` (its default splitter: 1,024-token chunks, 200
    overlap), ``as_query_engine()`` (top 2, compact, its QA template) on stock with a
    4,096-token context (before), ``PerCacheQueryEngine.from_index`` with
    ``PerCacheLlamaCPP(n_ctx=4096)`` (after), both embedding with *pc*'s embedder (the bundled
    MiniLM); the after side's engine."""
    from llama_index.core import Document, VectorStoreIndex

    from percache_llamaindex import PerCacheEmbedding, PerCacheLlamaCPP, PerCacheQueryEngine

    files = [Document(text=text, id_=name) for name, text in user_files(user)]
    index = VectorStoreIndex.from_documents(files, embed_model=PerCacheEmbedding(pc.embedder))
    plain = index.as_query_engine(llm=stock_llamaindex_llm(stock))
    llm = PerCacheLlamaCPP(engine=engine, n_ctx=engine.n_ctx, max_new_tokens=max_tokens, stop=["\n"])
    config = PerCacheConfig(n_ctx=engine.n_ctx, max_new_tokens=max_tokens)
    after = PerCacheQueryEngine.from_index(index, cache_dir=folder, llm=llm, config=config)
    return (lambda q: str(plain.query(q).response)), (lambda q: str(after.query(q).response)), after


def langchain_tutorial_sides(
    pc: PerCache, user: User, stock: Stock, max_tokens: int
) -> tuple[Callable[[str], str], Callable[[str], str], list[str]]:
    """LangChain's RAG tutorial app: the user's files split by
    ``RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200)`` into an
    ``InMemoryVectorStore``, ``as_retriever()`` (4 passages), the tutorial's prompt (the
    question before the context), no stop string; before on stock, after with the README's swap (the
    splits are *pc*'s knowledge). The prompts each side sent."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    files = [Document(text, id=name) for name, text in user_files(user)]
    splits = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200).split_documents(files)
    pc.add_documents([{"id": f"split-{i}", "text": d.page_content} for i, d in enumerate(splits)], split=False)
    store = InMemoryVectorStore(minilm_embeddings(pc))
    store.add_documents(splits)
    retriever = store.as_retriever()
    return lcel_sides(pc, stock, retriever, LANGCHAIN_TUTORIAL, max_tokens, stop=())  # the tutorial sets none


def stock_langchain_llm(stock: Stock) -> Any:
    """What LangChain's ``LlamaCpp`` does with these settings, on *stock*."""
    from langchain_core.language_models.llms import LLM

    class StockLLM(LLM):
        @property
        def _llm_type(self) -> str:
            return "stock-llama-cpp"

        def _call(self, prompt: str, stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any) -> str:
            return stock.complete(prompt, stop or [])

    return StockLLM()


def minilm_embeddings(pc: PerCache) -> Any:
    """The bundled MiniLM (*pc*'s embedder) as LangChain ``Embeddings``."""
    from langchain_core.embeddings import Embeddings

    class MiniLM(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return pc.embedder.embed(texts).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    return MiniLM()


def vector_store_retriever(pc: PerCache, k: int) -> Any:
    """The LangChain apps' own retriever: an ``InMemoryVectorStore`` over the user's
    documents (the chunks PerCache made of them) with the bundled MiniLM (*pc*'s embedder)
    as LangChain ``Embeddings``, *k* passages."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    notes = [Document(c.text, id=c.id) for c in internals(pc).knowledge.chunks]
    return InMemoryVectorStore.from_documents(notes, minilm_embeddings(pc)).as_retriever(search_kwargs={"k": k})


def langchain_sides(pc: PerCache, stock: Stock, k: int, max_tokens: int) -> tuple[Callable[[str], str], Callable[[str], str], list[str]]:
    """The LCEL app before (stock) and after (PerCache), and the prompts each sent."""
    return lcel_sides(pc, stock, vector_store_retriever(pc, k), TEMPLATE, max_tokens)


def lcel_sides(
    pc: PerCache, stock: Stock, retriever: Any, template: str, max_tokens: int, stop: Sequence[str] = ("\n",)
) -> tuple[Callable[[str], str], Callable[[str], str], list[str]]:
    """An LCEL app ``{context: retriever | join, question} | prompt | llm | parser`` with
    *template* and *stop* before (stock) and after (the README's swap on *pc*), and the
    prompts each sent."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from percache_langchain import PerCacheLLM, PerCacheLLMCache, PerCacheRetriever

    prompt = PromptTemplate.from_template(template)
    sent: list[str] = []

    def keep(value: Any) -> Any:
        sent.append(value.to_string())
        return value

    join = lambda docs: "\n\n".join(d.page_content for d in docs)  # noqa: E731
    before_llm = stock_langchain_llm(stock).bind(stop=list(stop))
    before = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | keep | before_llm | StrOutputParser()
    wrapped = PerCacheRetriever(inner=retriever, percache=pc, add_to_knowledge=False)
    llm = PerCacheLLM(percache=pc, cache=PerCacheLLMCache(pc), max_new_tokens=max_tokens, stop=list(stop))
    after = {"context": wrapped | join, "question": RunnablePassthrough()} | prompt | keep | llm | StrOutputParser()
    return before.invoke, after.invoke, sent


def llamaindex_sides(
    pc: PerCache, stock: Stock, k: int, max_tokens: int, folder: Path
) -> tuple[Callable[[str], str], Callable[[str], str], Any]:
    """The LlamaIndex app before (``index.as_query_engine`` on stock) and after
    (``PerCacheQueryEngine.from_index`` with ``PerCacheLlamaCPP``), and the after side's
    engine (its ``warm`` is the idle round)."""
    from llama_index.core import Document, VectorStoreIndex

    from percache_llamaindex import PerCacheEmbedding, PerCacheLlamaCPP, PerCacheQueryEngine

    notes = [Document(text=c.text, id_=c.id) for c in internals(pc).knowledge.chunks]
    index = VectorStoreIndex.from_documents(notes, embed_model=PerCacheEmbedding(pc.embedder))
    plain = index.as_query_engine(llm=stock_llamaindex_llm(stock), similarity_top_k=k)
    llm = PerCacheLlamaCPP(engine=internals(pc).engine, max_new_tokens=max_tokens, stop=["\n"])
    engine = PerCacheQueryEngine.from_index(index, cache_dir=folder, llm=llm, similarity_top_k=k)
    return (lambda q: str(plain.query(q).response)), (lambda q: str(engine.query(q).response)), engine


class OpenAIServers:
    """The ``openai`` app's llama-servers, one per side (the same binary, model, threads and
    arithmetic flags): alone (before), under ``percache serve`` (after), and one that
    answers with nothing reused (the fresh text; not timed)."""

    def __init__(self, model_path: Path, threads: int) -> None:
        from .endpoint import ARITHMETIC
        from .server import N_CTX, ServerAlone

        self.alone = ServerAlone(model_path, threads, ARITHMETIC)
        self.fresh = ServerAlone(model_path, threads, ARITHMETIC)
        self.under = LlamaServer.start(model_path, ServerLaunch(n_ctx=N_CTX, n_threads=threads))

    def close(self) -> None:
        self.alone.close()
        self.fresh.close()
        self.under.close()


def openai_sides(
    pc: PerCache, url: str, servers: OpenAIServers, k: int, max_tokens: int
) -> tuple[Callable[[str], str], Callable[[str], str], Callable[[str], str]]:
    """The ``openai`` app before (the server alone) and after (``percache serve`` at *url*),
    and the fresh text of the last request the app sent (the question is that request's)."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_openai import ChatOpenAI

    retriever = vector_store_retriever(pc, k)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    sent: list[Any] = []

    def keep(value: Any) -> Any:
        sent.append(value)
        return value

    def chat(base_url: str, **extra: Any) -> Any:
        return ChatOpenAI(base_url=base_url, api_key="none", model="model", temperature=0, max_tokens=max_tokens,
                          max_retries=0, timeout=600, **extra)

    join = lambda docs: "\n\n".join(d.page_content for d in docs)  # noqa: E731

    def app(base_url: str) -> Callable[[str], str]:
        chain = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | keep | chat(base_url) | StrOutputParser()
        return chain.invoke

    fresh = chat(f"http://127.0.0.1:{servers.fresh.port}/v1", extra_body={"cache_prompt": False})
    return app(f"http://127.0.0.1:{servers.alone.port}/v1"), app(url), lambda question: str(fresh.invoke(sent[-1]).content)


class Models:
    """One GGUF model as both sides load it: a PerCache engine and stock ``llama_cpp.Llama``
    per context length (2,048 tokens; the starter apps' 4,096), loaded on first use."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path, self.args = path, args
        self._engines: dict[int, LlamaEngine] = {}
        self._stocks: dict[int, Stock] = {}

    def engine(self, n_ctx: int = 2048) -> LlamaEngine:
        if n_ctx not in self._engines:
            self._engines[n_ctx] = LlamaEngine(self.path, n_ctx=n_ctx, n_batch=512, n_threads=self.args.threads)
        return self._engines[n_ctx]

    def stock(self, n_ctx: int = 2048) -> Stock:
        if n_ctx not in self._stocks:
            self._stocks[n_ctx] = Stock(self.path, self.args.threads, self.args.max_tokens, n_ctx)
        return self._stocks[n_ctx]


STARTER_CTX = 4096  # PerCacheLlamaCPP(n_ctx=4096): room for two 1,024-token chunks and the template


def run_user(
    user: User, app: str, args: argparse.Namespace, models: Models, folder: Path, servers: OpenAIServers | None = None
) -> dict[str, Any]:
    """One user's questions through one app, before and after, side by side."""
    with ExitStack() as stack:
        config = PerCacheConfig(max_new_tokens=args.max_tokens, top_k=args.k)
        on = servers.under if app == "openai" and servers is not None else models.engine()
        pc = PerCache.open(folder / f"{app}-{user.name}", config=config, engine=on)
        if app not in ("llamaindex_starter", "langchain_tutorial"):  # their own chunks
            pc.add_documents(user.documents, progress=False)  # the endpoint's: percache serve --documents
        stock = models.stock(STARTER_CTX if app == "llamaindex_starter" else 2048)
        if app in ("llamaindex", "llamaindex_starter"):  # the engine's own cache, over the app's chunks
            if app == "llamaindex":
                before, after, app_engine = llamaindex_sides(pc, stock, args.k, args.max_tokens, folder / f"li-{user.name}")
            else:
                before, after, app_engine = llamaindex_starter_sides(
                    user, pc, stock, models.engine(STARTER_CTX), args.max_tokens, folder / f"lis-{user.name}"
                )
            pc.close()
            pc, warm = app_engine.percache, app_engine.warm
            # the stock app asked again (its synthesizer turns an empty completion into "Empty
            # Response": the model's text alone is not what the app answers)
            fresh = lambda question: stock.fresh(before, question)  # noqa: E731
        elif app == "openai":
            assert servers is not None
            pc.preload()  # the server's cut rule, as percache serve does at start
            url = stack.enter_context(serving_in_thread(pc, servers.under))
            before, after, fresh = openai_sides(pc, url, servers, args.k, args.max_tokens)
            warm = pc.warm
        else:
            if app == "langchain":
                before, after, sent = langchain_sides(pc, stock, args.k, args.max_tokens)
            else:
                before, after, sent = langchain_tutorial_sides(pc, user, stock, args.max_tokens)
            warm = pc.warm
            stop = ("\n",) if app == "langchain" else ()
            fresh = lambda question: stock.fresh(lambda text: stock.complete(text, stop), sent[-1])  # noqa: E731
        row = _questions(user, app, args, pc, (before, after, fresh), warm)
    pc.close()  # (after the endpoint stopped serving)
    return row


def _ask(question: str, index: int, pc: PerCache, sides: tuple[Callable[[str], str], ...]) -> dict[str, Any]:
    """*question* on both sides in turn (the order alternating with *index*), then the fresh
    text (untimed); the row."""
    before, after, fresh_text = sides
    timings: dict[str, float] = {}
    texts: dict[str, str] = {}
    counters = pc.stats()
    checks_ready = internals(pc).runtime.checks_ready()  # false: before the first idle round ran the self-checks
    for side in (("before", "after") if index % 2 == 0 else ("after", "before")):
        started = time.perf_counter()
        texts[side] = (before if side == "before" else after)(question)
        timings[side] = time.perf_counter() - started
        if side == "after":  # untimed, before the other side shares the cores: its states written
            internals(pc).runner.flush()
            internals(pc).scheduler.background_checks.wait()  # and any self-checks it started done
    now = pc.stats()
    fresh = fresh_text(question)
    return {
        "question": question,
        "before_s": timings["before"],
        "after_s": timings["after"],
        "identical": texts["after"] == fresh,
        "stock_identical": texts["before"] == fresh,
        "checks_ready": checks_ready,
        "texts": {**texts, "fresh": fresh},
        **{name: now[name] - counters[name] for name in ("prompt_answers", "reused_tokens", "prefilled_tokens", "generated_tokens")},
    }


def _questions(
    user: User, app: str, args: argparse.Namespace, pc: PerCache,
    sides: tuple[Callable[[str], str], Callable[[str], str], Callable[[str], str]], warm: Callable[..., Any],
) -> dict[str, Any]:
    """The user's questions on both sides in turn, idle rounds between them (then each asked
    again, with ``--repeats``); the row."""
    rows: list[dict[str, Any]] = []
    limit = None if args.evaluation_idle else args.idle_seconds  # an unbounded round: as benchmarks.e2e
    rounds_first = 2 if args.evaluation_idle else 1 if args.idle_seconds else 0
    def idle_round() -> Any:  # its states written (untimed) before a timed question shares the cores
        report = warm(progress=False, max_seconds=limit)
        internals(pc).runner.flush()
        return report

    # a new user's first session: the engine's self-checks still to run (by the first idle round)
    first_session = not internals(pc).runtime.checks_ready()
    idle = [idle_round() for _ in range(rounds_first)]
    for index, query in enumerate(user.queries):
        rows.append(_ask(query["question"], index, pc, sides))
        if rounds_first:
            idle.append(idle_round())
        print(f"{app} {user.name} q{index}: {rows[-1]['before_s']:.2f}s -> {rows[-1]['after_s']:.2f}s "
              f"same={rows[-1]['identical']}", flush=True)  # fmt: skip
    repeats = [_ask(q["question"], i, pc, sides) for i, q in enumerate(user.queries)] if args.repeats else []
    stats = pc.stats()
    before_mean = sum(r["before_s"] for r in rows) / len(rows)
    after_mean = sum(r["after_s"] for r in rows) / len(rows)
    return {
        "app": app,
        "user": user.name,
        "dataset": user.dataset,
        "session": "first" if first_session else "later",
        "before_mean_s": before_mean,
        "after_mean_s": after_mean,
        "ratio": after_mean / before_mean,
        "identical": sum(r["identical"] for r in rows),
        "questions": len(rows),
        "idle_seconds": sum(r.seconds for r in idle),
        "idle": {
            "app_states_prefilled": sum(r.app_states_prefilled for r in idle),
            "app_requests_run": sum(r.app_requests_run for r in idle),
            "app_answers_stored": sum(r.app_answers_stored for r in idle),
            "prefill_tokens": sum(r.prefill_tokens for r in idle),  # over idle_seconds: the rounds' prefill rate
            "predicted": [q for r in idle for q in r.predicted],
        },
        "shapes": stats["app_requests"]["shapes"],
        "neighbour_order": stats["app_requests"]["neighbour_order"],
        "reused_tokens": sum(r["reused_tokens"] for r in rows),
        "prompt_tokens": sum(r["reused_tokens"] + r["prefilled_tokens"] for r in rows),
        "chunk_states": stats["chunk_states"],
        "self_checks": stats["engine_self_check"].get("checks"),  # what each cost, when, by whom
        "rows": rows,
        **_repeat_summary(repeats),
    }


def _repeat_summary(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The identical questions asked again: their mean latencies, ratio and identical count."""
    if not repeats:
        return {}
    before = sum(r["before_s"] for r in repeats) / len(repeats)
    after = sum(r["after_s"] for r in repeats) / len(repeats)
    return {"repeat_before_mean_s": before, "repeat_after_mean_s": after, "repeat_ratio": after / before,
            "repeat_identical": sum(r["identical"] for r in repeats), "repeat_rows": repeats}


def _by_session(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ratio of first sessions (a new user's, the engine's self-checks still to run) and
    of later ones apart, and the first sessions' slowest question against stock."""
    found: dict[str, Any] = {}
    for session in ("first", "later"):
        rows = [q for r in results if r["session"] == session for q in r["rows"]]
        if rows:
            found[session] = {
                "questions": len(rows),
                "ratio": sum(q["after_s"] for q in rows) / sum(q["before_s"] for q in rows),
                "worst_question_ratio": max(q["after_s"] / q["before_s"] for q in rows),
            }
    return found


def plot(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """A PNG of each app's mean latency per user, before and after the swap, with the ratio
    over each pair of bars. Needs matplotlib (``pip install "percache-core[bench]"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(6.0, 1.3 * len(results)), 4))
    places = np.arange(len(results))
    for offset, side, colour in ((-0.2, "before", "tab:gray"), (0.2, "after", "tab:blue")):
        axis.bar(places + offset, [r[f"{side}_mean_s"] for r in results], 0.4, label=side, color=colour)
    for place, r in zip(places, results):
        top = max(r["before_mean_s"], r["after_mean_s"])
        axis.annotate(f"{r['ratio']:.2f}x", (place, top), ha="center", va="bottom", fontsize=7)
    models = {r.get("model") for r in results}
    labels = [f"{r['app']}\n{r['user'].split('/')[-1]}" + (f"\n{r['model'].split('.')[0]}" if len(models) > 1 else "") for r in results]
    axis.set_xticks(places, labels, fontsize=7)
    axis.set(ylabel="mean latency per question (s)", title="Each app before and after the swap, per user")
    axis.set_ylim(top=1.2 * max(max(r["before_mean_s"], r["after_mean_s"]) for r in results))
    axis.legend(fontsize=7, loc="upper right", ncols=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def run_model(model: Path, apps: Sequence[str], users: Sequence[User], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every app over every user on one GGUF model; a row per app and user."""
    models = Models(model, args)
    servers = OpenAIServers(model, args.threads) if "openai" in apps else None
    results = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for app in apps:
                for user in users:
                    r = {"model": model.name, **run_user(user, app, args, models, Path(folder), servers)}
                    results.append(r)
                    print(f"== {model.name} {app} {user.name}: {r['before_mean_s']:.3f}s -> {r['after_mean_s']:.3f}s "
                          f"({r['ratio']:.3f}x), {r['identical']}/{r['questions']} identical, idle {r['idle_seconds']:.0f}s, "
                          f"reused {r['reused_tokens']} of {r['prompt_tokens']} tokens, {r['neighbour_order']} pairs", flush=True)
    finally:
        if servers is not None:
            servers.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_user_arguments(parser, qmsum_users=1, squad_users=1, queries=8)
    parser.add_argument("--apps", default="langchain,llamaindex", help=f"comma-separated: {', '.join(APPS)}")
    parser.add_argument("--repeats", action="store_true", help="then each question asked again (identical requests)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="one idle round of at most this long before each question")
    parser.add_argument("--evaluation-idle", action="store_true",
                        help="the evaluation's idle instead (as benchmarks.e2e gives PerCache's own pipeline): "
                             "two unbounded rounds before the first question, one after each answer")
    parser.add_argument("--k", type=int, default=3, help="passages per question")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="bundled", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--out", default="benchmarks/results/apps.json")
    parser.add_argument("--home", choices=("new", "current"), default="new",
                        help="new: an empty PERCACHE_HOME (the first user's run is a new user's first session); "
                             "current: the machine's (its self-check verdicts)")
    args = parser.parse_args(argv)
    if args.home == "new":  # a new user's machine: no self-check verdict, no assembled model copy
        os.environ["PERCACHE_HOME"] = tempfile.mkdtemp(prefix="percache-home-")
    users = users_from_arguments(args)
    apps = args.apps.split(",")
    if set(apps) - set(APPS):
        parser.error(f"unknown apps: {args.apps} (known: {', '.join(APPS)})")
    results = []
    for model in model_paths(args.models):
        results += run_model(model, apps, users, args)
    before = sum(r["before_mean_s"] * r["questions"] for r in results)
    after = sum(r["after_mean_s"] * r["questions"] for r in results)
    summary = {"ratio": after / before if before else None, "identical": sum(r["identical"] for r in results),
               "questions": sum(r["questions"] for r in results), "sessions": _by_session(results)}
    print(f"all: {summary}")
    out = write_json({"summary": summary, "per_user": results, "settings": vars(args)}, args.out)
    try:
        print(f"plot: {plot(results, out.with_suffix('.png'))}")
    except ImportError:
        pass  # matplotlib is optional
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
