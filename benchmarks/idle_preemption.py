"""How long an idle round delays an app's request that arrives while the round runs.

The LangChain app of ``benchmarks.apps`` (its own ``InMemoryVectorStore`` retriever and
template; ``PerCacheRetriever`` around it, ``PerCacheLLM`` with ``PerCacheLLMCache``) on one
user of ``--data``. Its first ``--learn`` questions teach PerCache the app's shape (an idle
round after each). Then, for each later question, an idle round (``pc.warm()``, what
``percache serve --idle`` and the idle worker run; at most ``--max-wait`` + ``--round-after``
seconds, so that what it leaves goes on in the next) starts in a thread, and the question
arrives after a random wait (seeded): the round is then filling the app's leading states,
running its predicted requests or predicting.

Measured per arrival: the *delay*, how long the request waited for the engine's lock while
the round held it (the round yields the engine when its current piece ends: one leading
state's prefill, one predicted request's prefill, or one decoded token; the round may go on
after the request), the request's latency, and the round's mean time per piece (its seconds
over the leading states and predicted requests it ran, for scale). The same question also runs on stock ``llama_cpp`` (not timed against it; its
fresh text checks the app's answer). JSON (``--out``).

    .venv/bin/python -m benchmarks.idle_preemption --data ../shared/data
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.apps import Stock, langchain_sides
from benchmarks.data_sets import add_user_arguments, users_from_arguments
from benchmarks.output import write_json
from percache_core import PerCache, PerCacheConfig, WarmReport
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.models import bundled_model_path


class TimedLock:
    """The engine's lock, counting how long the app's threads (any but the idle round's)
    waited to acquire it while *watching*."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.watching = False
        self.idle_thread: int | None = None
        self.waited = 0.0
        self.acquired = 0

    def __enter__(self) -> bool:
        started = time.perf_counter()
        self.lock.acquire()
        if self.watching and threading.get_ident() != self.idle_thread:
            self.waited += time.perf_counter() - started
            self.acquired += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def arrival(pc: PerCache, lock: TimedLock, ask: Any, question: str, wait_s: float, round_s: float) -> dict[str, Any]:
    """*question* asked *wait_s* after an idle round of at most *round_s* started in a thread."""
    reports: list[WarmReport] = []
    ended: list[float] = []

    def idle() -> None:
        lock.idle_thread = threading.get_ident()
        reports.append(pc.warm(progress=False, max_seconds=round_s))
        ended.append(time.perf_counter())

    worker = threading.Thread(target=idle)
    worker.start()
    time.sleep(wait_s)
    lock.watching, lock.waited, lock.acquired = True, 0.0, 0
    started = time.perf_counter()
    text = ask(question)
    answered = time.perf_counter()
    lock.watching = False
    worker.join()
    report = reports[0]
    pieces = report.app_states_prefilled + report.app_requests_run
    return {
        "question": question,
        "wait_s": wait_s,
        "delay_s": lock.waited,
        "engine_calls": lock.acquired,
        "round_ended_before_request": ended[0] < started,
        "round_went_on_s": max(0.0, ended[0] - answered),
        "latency_s": answered - started,
        "preempted": report.preempted,
        "round_s": report.seconds,
        "round_pieces": pieces,
        "seconds_per_piece": report.seconds / pieces if pieces else None,
        "text": text,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_user_arguments(parser, qmsum_users=0, squad_users=1, queries=12)
    parser.add_argument("--learn", type=int, default=2, help="questions asked first, an idle round after each")
    parser.add_argument("--max-wait", type=float, default=4.0, help="a question arrives 0.2 s to this long into a round")
    parser.add_argument("--round-after", type=float, default=10.0,
                        help="a round stops this long after the latest arrival time (it goes on in the next)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/idle_preemption.json")
    args = parser.parse_args(argv)
    if args.learn < 1 or args.max_wait < 0.2:
        parser.error("--learn must be >= 1 and --max-wait >= 0.2")
    chance = random.Random(args.seed)
    model = bundled_model_path()
    engine = LlamaEngine(model, n_ctx=2048, n_batch=512, n_threads=args.threads)
    lock = engine.lock = TimedLock(engine.lock)  # type: ignore[assignment]
    stock = Stock(model, args.threads, args.max_tokens)
    users = []
    with tempfile.TemporaryDirectory() as folder:
        for user in users_from_arguments(args):
            pc = PerCache.open(Path(folder) / user.name, config=PerCacheConfig(max_new_tokens=args.max_tokens, top_k=args.k), engine=engine)
            pc.add_documents(user.documents, progress=False)
            _, after, sent = langchain_sides(pc, stock, args.k, args.max_tokens)
            questions = [q["question"] for q in user.queries]
            for question in questions[: args.learn]:
                after(question)
                pc.warm(progress=False, max_seconds=30)
            rows = []
            for question in questions[args.learn :]:
                row = arrival(pc, lock, after, question, round(chance.uniform(0.2, args.max_wait), 2), args.max_wait + args.round_after)
                row["identical"] = row.pop("text") == stock.fresh(stock.complete, sent[-1])
                rows.append(row)
                print(f"{user.name}: wait {row['wait_s']:.2f}s delay {row['delay_s']:.3f}s latency {row['latency_s']:.2f}s "
                      f"preempted={row['preempted']} same={row['identical']}", flush=True)
            pc.close()
            delays = [r["delay_s"] for r in rows if not r["round_ended_before_request"]]
            users.append({
                "user": user.name,
                "arrivals": len(rows),
                "during_a_round": len(delays),
                "delay_median_s": statistics.median(delays) if delays else None,
                "delay_max_s": max(delays) if delays else None,
                "identical": sum(r["identical"] for r in rows),
                "rows": rows,
            })  # fmt: skip
    write_json({"per_user": users, "settings": vars(args)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
