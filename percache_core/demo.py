"""``percache demo`` (``make demo``): the bundled personal corpus answered with PerCache,
each question's answer and where it came from, an idle round and its predicted questions,
then the same questions without a cache and with stock ``llama_cpp.Llama``: the time saved
per question, and whether the answers are the same.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .config import PerCacheConfig
from .pipeline import PerCache
from .serving.prompting import rag_prompt
from .types import Answer

TABLE_HEADER = ["#", "source", "TTFT ms", "total ms", "reused/prompt tok", "QA sim"]


def demo_corpus() -> dict[str, Any]:
    """The small personal corpus (e-mails, meeting notes) bundled for the demo and tests."""
    text = resources.files("percache_core").joinpath("data/demo_corpus.json").read_text("utf-8")
    return json.loads(text)


def _row(answer: Answer, label: str) -> list[str]:
    return [
        label,
        answer.source,
        f"{answer.ttft_s * 1000:7.0f}",
        f"{answer.latency_s * 1000:7.0f}",
        f"{answer.reused_tokens}/{answer.reused_tokens + answer.prefilled_tokens}",
        "" if answer.similarity is None else f"{answer.similarity:.2f}",
    ]


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def run_demo(args: argparse.Namespace, config: PerCacheConfig) -> int:
    """Run the demo on the bundled corpus in *args.cache* (default: a new folder): an idle
    round first (what PerCache does before the user asks), then each question answered by
    PerCache, by the same pipeline without a cache and by stock llama.cpp, side by side in
    a rotating order, then questions the round predicted."""
    corpus = demo_corpus()
    folder = args.cache or tempfile.mkdtemp(prefix="percache-demo-")
    questions = [item["question"] for item in corpus["demo_questions"]]
    print(f"PerCache demo: {len(corpus['documents'])} personal e-mails and meeting notes; cache in {folder}")
    print("Loading the bundled Gemma 3 270M (llama.cpp) and all-MiniLM-L6-v2 ...")
    with PerCache.open(folder, config=config) as pc:
        pc.preload()
        pc.add_documents(corpus["documents"], progress=True)
        report = _idle_round(pc)
        with Systems.open(pc, corpus) as systems:
            runs = [systems.ask(number, question) for number, question in enumerate(questions, 1)]
        _print_table(TABLE_HEADER, [_row(run.answer, f"Q{n}") for n, run in enumerate(runs, 1)])
        _summarise_sources([run.answer for run in runs])
        _print_savings(runs)
        _ask_predicted(pc, report.predicted[:3])
        stats = pc.stats()
        print(
            f"\nQA bank: {stats['qa_bank']['entries']} entries, {stats['qa_bank']['bytes']:,} bytes; "
            f"chunk states: {stats['chunk_states']['nodes']} nodes, {stats['chunk_states']['bytes']:,} bytes"
        )
    return 0


@dataclass
class Run:
    """One question answered by PerCache (its :class:`Answer`), by the same pipeline with
    every cache off and by stock llama.cpp: their texts and seconds."""

    answer: Answer
    cache_off: tuple[str, float]
    stock: tuple[str, float]


class Systems:
    """PerCache, the same pipeline without a cache (a cache folder of its own, every tier
    off) and stock ``llama_cpp.Llama`` completing the same prompt string (its prefix reuse
    on, greedy, the same stop strings), each on an engine of its own."""

    def __init__(self, pc: PerCache, off: PerCache, stock: Any) -> None:
        self.pc, self.off, self.stock = pc, off, stock

    @classmethod
    @contextmanager
    def open(cls, pc: PerCache, corpus: dict[str, Any]) -> Iterator[Systems]:
        from llama_cpp import Llama  # stock llama.cpp, as users run it

        from .models import resolve_model_path

        engine = pc.config.engine
        config = pc.config.replace(qa_bank=False, chunk_states=False, prediction=False)
        stock = Llama(str(resolve_model_path(engine.model_path)), n_ctx=engine.n_ctx, n_batch=engine.n_batch, verbose=False)
        try:
            with PerCache.open(tempfile.mkdtemp(prefix="percache-off-"), config=config, embedder=pc.embedder) as off:
                off.add_documents(corpus["documents"])
                yield cls(pc, off, stock)
        finally:
            stock.close()

    def ask(self, number: int, question: str) -> Run:
        """*question* asked of the three, the first of them rotating with *number*."""
        asks = [self._percache, self._cache_off, self._stock]
        results: dict[str, Any] = {}
        for step in range(3):
            ask = asks[(number + step) % 3]
            results[ask.__name__] = ask(question)
        answer = results["_percache"]
        print(f"\nQ{number}: {question}\n    -> [{answer.source}] {answer.text}")
        return Run(answer, results["_cache_off"], results["_stock"])

    def _percache(self, question: str) -> Answer:
        return self.pc.answer(question)

    def _cache_off(self, question: str) -> tuple[str, float]:
        started = time.perf_counter()
        text = self.off.answer(question).text
        return text, time.perf_counter() - started

    def _stock(self, question: str) -> tuple[str, float]:
        started = time.perf_counter()
        engine = self.pc.config.engine
        spec = rag_prompt(self.pc.config.retrieval.system_prompt, [r.chunk for r in self.pc.retrieve(question)], question)
        reply = self.stock.create_completion(spec.text, max_tokens=engine.max_new_tokens, temperature=0.0, stop=list(engine.stop))
        return reply["choices"][0]["text"].strip(), time.perf_counter() - started


def _print_savings(runs: list[Run]) -> None:
    """The time PerCache saved on each question against both, with the answers."""
    print("\nSeconds per question: PerCache, the same pipeline without a cache, stock llama.cpp")
    for number, run in enumerate(runs, 1):
        answer, (off_text, off_s), (stock_text, stock_s) = run.answer, run.cache_off, run.stock
        same = "same text" if answer.text == off_text else "DIFFERENT text"
        print(
            f"  Q{number} [{answer.source:>13}] {answer.latency_s:6.2f}  {off_s:6.2f}  {stock_s:6.2f}   "
            f"saved {off_s - answer.latency_s:+5.2f} s against no cache ({same}), "
            f"{stock_s - answer.latency_s:+5.2f} s against stock"
        )
        if stock_text != answer.text:
            print(f"      stock llama.cpp answered: {stock_text!r}")
    total = sum(run.answer.latency_s for run in runs)
    off_total = sum(run.cache_off[1] for run in runs)
    stock_total = sum(run.stock[1] for run in runs)
    print(
        f"\nIn all: PerCache {total:.2f} s, without a cache {off_total:.2f} s ({1 - total / off_total:.0%} saved), "
        f"stock llama.cpp {stock_total:.2f} s ({1 - total / stock_total:.0%} saved), each question asked of "
        "the three in a rotating order. The benchmarks measure this over real users (README, 'What it measured')."
    )


def _idle_round(pc: PerCache) -> Any:
    """What PerCache does before the user asks: one idle round predicts likely questions
    and populates both tiers."""
    print("\nIdle time, before any question: one round predicts likely questions and populates both tiers ...")
    report = pc.warm(progress=True)
    print(
        f"  {report.seconds:.1f} s idle compute ({report.strategy}): {report.chunks_summarised} chunks "
        f"summarised, {len(report.predicted)} questions predicted and populated, "
        f"{report.prefill_tokens} tokens prefilled, {report.decode_tokens} decoded"
    )
    for question in report.predicted:
        print(f"  predicted: {question}")
    return report


def _ask_predicted(pc: PerCache, predicted: list[str]) -> None:
    """Asking questions the idle round predicted: their answers were stored before."""
    rows = []
    for number, question in enumerate(predicted, 1):
        answer = pc.answer(question)
        rows.append(_row(answer, f"P{number}"))
        print(f"\nP{number} (predicted): {question}\n    -> [{answer.source}] {answer.text}")
    if rows:
        print()
        _print_table(TABLE_HEADER, rows)


def _summarise_sources(answers: list[Answer]) -> None:
    """Mean TTFT and total time per source against full runs (a prompt answer is an
    identical prompt's stored answer, a QA-bank answer a stored answer the model verified
    as a draft)."""
    full = [a for a in answers if a.source == "full"]
    if not full:
        return
    base_ttft = sum(a.ttft_s for a in full) / len(full)
    base_total = sum(a.latency_s for a in full) / len(full)
    for source in ("chunk_states", "qa_bank", "prompt_answer"):
        chosen = [a for a in answers if a.source == source]
        if chosen:
            ttft = sum(a.ttft_s for a in chosen) / len(chosen)
            total = sum(a.latency_s for a in chosen) / len(chosen)
            print(
                f"{source:>12}: mean TTFT {ttft * 1000:6.0f} ms = {ttft / base_ttft:5.1%}, "
                f"total {total * 1000:6.0f} ms = {total / base_total:5.1%} of a full run"
            )
