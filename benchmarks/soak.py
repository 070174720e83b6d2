"""Soak: several processes answer on one cache folder, with documents added and idle
rounds in between, as a web app with workers would.

Side by side in one run (each phase alone on the machine):

1. references: afterwards, each (question, retrieved chunks) pair that was answered is
   answered again with every cache off from the same chunks (added notes change BM25's
   statistics and so, now and then, what a question retrieves: the reference must be the
   pipeline's answer for the prompt that was actually laid out);
2. one process alone answers ``--questions`` questions (the latency baseline);
3. ``--processes`` processes answer ``--questions`` questions each on one fresh folder;
   every 10 questions a process adds a note, every 25 it runs a short idle round;
4. kills: a process is killed with SIGKILL ``--kills`` times during ``warm()`` and as
   often during a shared-tier sync (QA entries and chunk states coming from Redis), and
   each time the folder must open and answer as cache-off does.

Reports errors (target 0), answers differing from cache-off (target 0), the largest
budget overshoot seen on disk over the run (target <= one entry) and p50/p95 latency of
the shared folder against one process alone, as JSON.

    .venv/bin/python -m benchmarks.soak --data ../shared/data --processes 4 --questions 250
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.data_sets import default_data_folder, load_users
from benchmarks.output import write_json
from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals
from percache_core.storage import Store
from percache_core.types import ANSWERED_BEFORE

MB = 1024 * 1024
OFF = {"qa_bank": False, "chunk_states": False}
SECRET = "soak-secret-of-sixteen-or-more"


def budgets(args: argparse.Namespace) -> dict:
    return {
        "qa_bank_budget_bytes": args.qa_budget_kb * 1024,
        "chunk_state_budget_bytes": args.state_budget_mb * MB,
        "max_new_tokens": args.max_new_tokens,
        "prediction_stride": 2,
        "min_free_disk_bytes": 0,
    }


def note(process: int, index: int) -> dict:
    return {"id": f"soak-note-{process}-{index}", "text": f"Soak note {process}-{index}: crate zq{index}x{process} holds cables."}


def store_totals(folder: Path) -> dict[str, int]:
    """Bytes of QA entries and of chunk states on disk (every fingerprint folder)."""
    totals = {"qa": 0, "states": 0}
    qa = Store(folder / "qa_bank")
    totals["qa"], largest_qa = qa.total_size("qa:"), max((r.size for r in qa.records("qa:")), default=0)
    qa.close()
    largest_state = 0
    for fingerprint in (folder / "states").glob("*"):
        states = Store(fingerprint)
        totals["states"] += states.total_size("node:")
        largest_state = max([largest_state, *(r.size for r in states.records("node:"))])
        states.close()
    totals["largest_qa"], totals["largest_state"] = largest_qa, largest_state
    return totals


def work(folder: str, process: int, questions: list[str], config: dict, results: multiprocessing.Queue) -> None:
    """One worker process: answer *questions*, add notes and run idle rounds between."""
    rows, errors, overshoot = [], [], {"qa": 0, "states": 0}
    try:
        with PerCache.open(folder, config=PerCacheConfig(**config)) as pc:
            for index, question in enumerate(questions, 1):
                try:
                    started = time.perf_counter()
                    answer = pc.answer(question)
                    rows.append({"question": question, "text": answer.text, "source": answer.source,
                                 "chunk_ids": list(answer.chunk_ids),
                                 "latency_s": time.perf_counter() - started})
                    if index % 10 == 0:
                        pc.add_documents([note(process, index)])
                    if index % 25 == 0:
                        pc.warm(max_seconds=5, progress=False)
                    totals = store_totals(Path(folder))
                    overshoot["qa"] = max(overshoot["qa"], totals["qa"] - config["qa_bank_budget_bytes"])
                    overshoot["states"] = max(
                        overshoot["states"], totals["states"] - config["chunk_state_budget_bytes"]
                    )
                except Exception:
                    errors.append(traceback.format_exc(limit=3))
    except Exception:
        errors.append(traceback.format_exc(limit=3))
    results.put({"process": process, "rows": rows, "errors": errors, "overshoot": overshoot})


def run_processes(folder: Path, plans: list[list[str]], config: dict) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    workers = [
        context.Process(target=work, args=(str(folder), n, plan, config, results)) for n, plan in enumerate(plans)
    ]
    for worker in workers:
        worker.start()
    collected = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return sorted(collected, key=lambda r: r["process"])


def references(folder: Path, documents: list[dict], rows: list[dict], config: dict) -> dict[tuple, str]:
    """Cache-off answers for every (question, retrieved chunks) pair in *rows*."""
    answers: dict[tuple, str] = {}
    with PerCache.open(folder, config=PerCacheConfig(**{**config, **OFF})) as pc:
        pc.add_documents(documents)
        for row in rows:
            key = (row["question"], tuple(row["chunk_ids"]))
            if key not in answers:
                chunks = [internals(pc).knowledge.get_chunk(chunk_id) for chunk_id in key[1]]
                answers[key] = pc.caller.generate(row["question"], chunks).text
    return answers


def shared(url: str) -> dict:
    return {"shared_url": url, "shared_secret": SECRET, "shared_namespace": "soak", "shared_sync_interval_s": 0.05}


def warm_until_killed(folder: str, config: dict, started: multiprocessing.Event) -> None:
    with PerCache.open(folder, config=PerCacheConfig(**config)) as pc:
        pc.preload()
        started.set()
        pc.warm(max_seconds=600, progress=False)


def sync_until_killed(folder: str, config: dict, started: multiprocessing.Event) -> None:
    with PerCache.open(folder, config=PerCacheConfig(**config)) as pc:
        started.set()  # the sync thread is reading the catalog from now on
        for question in ("What holds cables?",) * 10**6:
            pc.answer(question)


def fill_shared_tier(url: str, documents: list[dict], questions: list[str], config: dict, entries: int) -> None:
    """Another client's writes: chunk states of answered questions, and *entries* QA entries."""
    with tempfile.TemporaryDirectory() as folder:
        with PerCache.open(folder, config=PerCacheConfig(**config, **shared(url))) as pc:
            pc.add_documents(documents)
            for question in questions:
                pc.answer(question)
            for index in range(entries):
                pc.caller.remember(f"Which crate holds item {index}?", f"Crate {index % 97} holds item {index}.")


def kill_during(target, folder: Path, config: dict, rng: random.Random, wait: tuple[float, float]) -> float:
    """Run *target* in a process, SIGKILL it *wait* seconds after it says it started."""
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    process = context.Process(target=target, args=(str(folder), config, started))
    process.start()
    if not started.wait(timeout=300):
        process.kill()
        raise RuntimeError(f"{target.__name__} did not start")
    delay = rng.uniform(*wait)
    time.sleep(delay)
    if not process.is_alive():
        raise RuntimeError(f"{target.__name__} ended before it was killed")
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    return delay


def kills(root: Path, documents: list[dict], questions: list[str], config: dict, args: argparse.Namespace) -> list[dict]:
    """Kill -9 during warm() and during a shared-tier sync; after each, open the folder and
    answer. Returns one row per kill with the answers (compared with cache-off later)."""
    from tests.local_redis import RedisServer

    rng = random.Random(args.seed)
    rows: list[dict] = []
    server = RedisServer(root / "redis").start()
    try:
        fill_shared_tier(server.url, documents, questions[:4], config, args.shared_entries)
        for kind, target, wait, extra in (
            ("warm", warm_until_killed, (0.5, 6.0), {}),
            ("shared_sync", sync_until_killed, (0.2, 2.0), shared(server.url)),
        ):
            folder = root / f"killed-{kind}"
            with PerCache.open(folder, config=PerCacheConfig(**config)) as pc:
                pc.add_documents(documents)
            for round_ in range(args.kills):
                delay = kill_during(target, folder, {**config, **extra}, rng, wait)
                row = {"kind": kind, "round": round_, "killed_after_s": round(delay, 2), "error": None}
                try:
                    with PerCache.open(folder, config=PerCacheConfig(**config)) as pc:
                        question = questions[round_ % len(questions)]
                        answer = pc.answer(question)
                        row |= {"question": question, "text": answer.text, "source": answer.source,
                                "chunk_ids": list(answer.chunk_ids),
                                "corrupt_dropped": pc.stats()["chunk_states"]["corrupt_dropped"],
                                "qa_entries_kept": len(internals(pc).qa_bank), "states_kept": len(internals(pc).tree.nodes)}
                except Exception:
                    row["error"] = traceback.format_exc(limit=3)
                rows.append(row)
    finally:
        server.stop()
    return rows


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=default_data_folder())
    parser.add_argument("--dataset", default="squad11-dev")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--questions", type=int, default=250, help="questions per process")
    parser.add_argument("--distinct", type=int, default=40, help="distinct questions drawn from")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--qa-budget-kb", type=int, default=64)
    parser.add_argument("--state-budget-mb", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=5, help="kills during warm() and as many during a sync")
    parser.add_argument("--shared-entries", type=int, default=3000, help="QA entries in Redis for the sync kills")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args(argv)

    user = load_users(args.data, args.dataset, users=1, queries_per_user=args.distinct, seed=args.seed)[0]
    pool = [q["question"] for q in user.queries]
    rng = random.Random(args.seed)
    plans = [[rng.choice(pool) for _ in range(args.questions)] for _ in range(args.processes)]
    config = budgets(args)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        notes = [note(p, i) for p in range(args.processes) for i in range(10, args.questions + 1, 10)]
        alone_folder, shared_folder = root / "alone", root / "shared"
        for folder in (alone_folder, shared_folder):
            with PerCache.open(folder, config=PerCacheConfig(**config)) as pc:
                pc.add_documents(user.documents)
        alone = run_processes(alone_folder, plans[:1], config)
        together = run_processes(shared_folder, plans, config)
        final = store_totals(shared_folder)
        killed = kills(root, user.documents, pool, config, args) if args.kills else []
        every_row = [row for run in alone + together for row in run["rows"]]
        answered_after_kill = [row for row in killed if row["error"] is None]
        reference = references(root / "reference", user.documents + notes, every_row + answered_after_kill, config)

    def summary(runs: list[dict]) -> dict:
        rows = [row for run in runs for row in run["rows"]]
        latencies = [row["latency_s"] for row in rows]
        differing = [r for r in rows if r["text"] != reference[(r["question"], tuple(r["chunk_ids"]))]]
        return {
            "answers": len(rows),
            "errors": sum(len(run["errors"]) for run in runs),
            "error_samples": [e for run in runs for e in run["errors"]][:3],
            "differing_from_cache_off": len(differing),
            "differing_samples": differing[:3],
            "qa_bank_served": sum(r["source"] in ANSWERED_BEFORE for r in rows),
            "p50_s": percentile(latencies, 0.5),
            "p95_s": percentile(latencies, 0.95),
            "overshoot_bytes": {
                kind: max(run["overshoot"][kind] for run in runs) for kind in ("qa", "states")
            },
        }

    report = {
        "setting": vars(args) | {"data": str(args.data), "out": str(args.out)},
        "questions_whose_retrieval_changed": sum(
            len({tuple(r["chunk_ids"]) for r in every_row if r["question"] == q}) > 1 for q in pool
        ),
        "alone": summary(alone),
        "shared_folder": summary(together),
        "final_bytes": final,
        "kills": {
            "killed": len(killed),
            "errors_after": sum(row["error"] is not None for row in killed),
            "differing_from_cache_off": sum(
                row["text"] != reference[(row["question"], tuple(row["chunk_ids"]))] for row in answered_after_kill
            ),
            "corrupt_states_dropped": sum(row.get("corrupt_dropped", 0) for row in answered_after_kill),
            "rows": killed,
        },
    }
    report["shared_folder"]["p50_vs_alone"] = report["shared_folder"]["p50_s"] / report["alone"]["p50_s"]
    report["shared_folder"]["p95_vs_alone"] = report["shared_folder"]["p95_s"] / report["alone"]["p95_s"]
    write_json(report, args.out, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "setting"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
