"""A personal corpus's scale: adding, retrieving and reopening at 1K-100K chunks, and QA-bank
lookups at 100K-1M entries, through the public API.

    python -m benchmarks.scale --data ../shared/data                   # quick: hashing embedder
    python -m benchmarks.scale --data ../shared/data --embedder minilm # the real embedder (long)

Chunks are generated one-chunk documents: sentences of words drawn from the documents of
``--data`` (so BM25 sees a real vocabulary), with a metadata field of 50 "threads". The
questions are the real questions of ``--data``. Retrieval is timed with the question
embedding given (as the request path gives it), so the figures are PerCache's own; the
embedder's time is in the add throughput. Memory is this process's resident set
(``/proc/self/statm``) and its peak (``ru_maxrss``). QA-bank lookups use random unit
vectors (the stored entries) and perturbed copies of some of them (the questions);
recall@1 is measured against an exact search over the same matrix.

Results: JSON (``--out``, default ``benchmarks/results/scale.json``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals

from .output import write_json

DEFAULT_CHECKPOINTS = (1_000, 10_000, 100_000)


class HashingEmbedder:
    """A cheap 384-d embedder (each word hashed to a slot, unit length), so that the figures
    of the quick run are PerCache's own rather than the embedding model's."""

    name = "benchmark-hashing-384"
    dimension = 384

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, text in zip(rows, texts):
            for word in text.lower().split():
                row[zlib.crc32(word.encode("utf-8")) % self.dimension] += 1.0
            norm = float(np.linalg.norm(row))
            if norm:
                row /= norm
            else:
                row[0] = 1.0
        return rows


def make_embedder(kind: str) -> Any:
    if kind == "minilm":
        from percache_core.knowledge.bert import BertEmbedder

        return BertEmbedder()
    return HashingEmbedder()


def rss_mb() -> float:
    """This process's resident memory now, in MB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 1e6


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def vocabulary_and_questions(data: Path) -> tuple[list[str], list[str]]:
    """Words of the data sets' documents and their real questions."""
    words: list[str] = []
    questions: list[str] = []
    for folder in sorted(p for p in data.iterdir() if (p / "documents.jsonl").is_file()):
        with (folder / "documents.jsonl").open() as lines:
            for count, line in enumerate(lines):
                if count >= 400:
                    break
                words += json.loads(line)["text"].split()
        with (folder / "queries.jsonl").open() as lines:
            questions += [json.loads(line)["question"] for _, line in zip(range(40), lines)]
    if not words or not questions:
        raise SystemExit(f"no documents.jsonl / queries.jsonl under {data}")
    return words, questions


def generated_documents(words: list[str], start: int, count: int, rng: random.Random) -> list[dict[str, Any]]:
    """*count* one-chunk documents of 60-110 words, ids from *start*."""
    return [
        {
            "id": f"mail-{start + i:06d}",
            "text": " ".join(rng.choices(words, k=rng.randint(60, 110))),
            "metadata": {"thread": f"t{(start + i) % 50}"},
        }
        for i in range(count)
    ]


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 3),
        "p95_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
    }


def time_retrieval(pc: PerCache, questions: list[str], embeddings: np.ndarray, top_k: int) -> dict[str, Any]:
    """Hybrid retrieval latency over *questions* (first call untimed: lazy index builds)."""
    started = time.perf_counter()
    internals(pc).knowledge.retrieve(questions[0], top_k, question_embedding=embeddings[0])
    first = time.perf_counter() - started
    samples = []
    for question, embedding in zip(questions, embeddings):
        started = time.perf_counter()
        internals(pc).knowledge.retrieve(question, top_k, question_embedding=embedding)
        samples.append(time.perf_counter() - started)
    scoped = []
    for i, (question, embedding) in enumerate(zip(questions[:20], embeddings)):
        started = time.perf_counter()
        internals(pc).knowledge.retrieve(question, top_k, question_embedding=embedding, where={"thread": f"t{i % 50}"})
        scoped.append(time.perf_counter() - started)
    return {
        "first_retrieval_s": round(first, 3),
        **percentiles(samples),
        "scoped": percentiles(scoped),
    }


def bench_chunks(args: argparse.Namespace, embedder: Any, folder: Path) -> dict[str, Any]:
    words, questions = vocabulary_and_questions(Path(args.data))
    rng = random.Random(7)
    questions = questions[: args.questions]
    embeddings = embedder.embed(questions)
    checkpoints = sorted(set(args.checkpoints))
    rows = []
    config = PerCacheConfig()
    pc = PerCache.open(folder, config=config, embedder=embedder)
    added, add_seconds = 0, 0.0
    try:
        for checkpoint in checkpoints:
            while added < checkpoint:
                count = min(args.batch, checkpoint - added)
                documents = generated_documents(words, added, count, rng)
                started = time.perf_counter()
                pc.add_documents(documents, split=False, progress=args.progress)
                add_seconds += time.perf_counter() - started
                added += count
            row = {
                "chunks": added,
                "add_chunks_per_s": round(added / add_seconds, 1),
                "rss_mb": round(rss_mb(), 1),
                "peak_rss_mb": round(peak_rss_mb(), 1),
                **time_retrieval(pc, questions, embeddings, args.top_k),
            }
            row["rss_after_retrieval_mb"] = round(rss_mb(), 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        pc.close()
    write_qa_entries(folder / "qa_bank", args.reopen_qa_entries)
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:  # a fresh process: its time and peak memory are the reopen's
        reopen = pool.apply(reopen_and_answer, (str(folder), questions[0], args.top_k, args.answer, args.embedder))
    reopen = {"chunks": added, "qa_entries": args.reopen_qa_entries, **reopen}
    print(json.dumps({"reopen": reopen}), flush=True)
    return {"checkpoints": rows, "reopen": reopen, "peak_rss_mb": round(peak_rss_mb(), 1)}


def write_qa_entries(folder: Path, count: int) -> None:
    """*count* answered QA entries written straight into the QA bank's store."""
    from percache_core.storage import Store

    rng = np.random.default_rng(5)
    store = Store(folder)
    for start in range(0, count, 10_000):
        vectors = rng.standard_normal((min(count, start + 10_000) - start, 384), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        store.put_many([qa_record(start + i, vector) for i, vector in enumerate(vectors)])
    store.close()


def reopen_and_answer(folder: str, question: str, top_k: int, answer: bool, embedder_kind: str) -> dict[str, Any]:
    """Open the folder, retrieve once and (with *answer*) answer once with the bundled
    model: the seconds of each and this process's peak memory (the embedder's loading
    included with ``minilm``)."""
    embedder = make_embedder(embedder_kind)
    started = time.perf_counter()
    pc = PerCache.open(folder, config=PerCacheConfig(), embedder=embedder)
    opened = time.perf_counter() - started
    try:
        started = time.perf_counter()
        internals(pc).knowledge.retrieve(question, top_k, question_embedding=embedder.embed([question])[0])
        first_retrieval = time.perf_counter() - started
        result = {"open_s": round(opened, 3), "first_retrieval_s": round(first_retrieval, 3)}
        result["qa_entries_loaded"] = len(internals(pc).qa_bank)
        if answer:
            started = time.perf_counter()
            reply = pc.answer(question)
            result["first_answer_s"] = round(time.perf_counter() - started, 3)
            result["first_answer_source"] = reply.source
            result["open_to_answer_s"] = round(opened + first_retrieval + result["first_answer_s"], 3)
        result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    finally:
        pc.close()
    return result


def qa_record(i: int, vector: np.ndarray) -> tuple[str, dict[str, Any], np.ndarray]:
    """One answered QA entry as the QA bank stores it (key ``qa:<id>``)."""
    entry_id = f"e{i:07d}"
    value = {
        "id": entry_id,
        "question": f"question {i}",
        "answer": f"answer {i}",
        "chunk_ids": [],
        "metadata": {"origin": "user"},
        "created_at": 0.0,
    }
    return f"qa:{entry_id}", value, vector


def bench_qa_lookup(args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    """QA-bank search latency and recall@1 against exact search, at each size in *sizes*
    (entries written straight into a bank: adding 1M answers through the pipeline would
    time the store, not the lookup)."""
    from percache_core.qa.bank import QABank
    from percache_core.storage import Store

    rng = np.random.default_rng(3)
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory() as folder:
            store = Store(Path(folder))
            vectors = rng.standard_normal((size, 384), dtype=np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            started = time.perf_counter()
            for start in range(0, size, 10_000):
                store.put_many([qa_record(i, vectors[i]) for i in range(start, min(size, start + 10_000))])
            written = time.perf_counter() - started
            started = time.perf_counter()
            bank = QABank(store, dimension=384, budget_bytes=1 << 40)
            loaded = time.perf_counter() - started
            picks = rng.choice(size, args.questions, replace=False)
            queries = vectors[picks] + 0.02 * rng.standard_normal((len(picks), 384), dtype=np.float32)
            queries /= np.linalg.norm(queries, axis=1, keepdims=True)
            samples, right = [], 0
            for query in queries:
                started = time.perf_counter()
                hits = bank.search(query, top_n=1, similarity_threshold=-1.0)
                samples.append(time.perf_counter() - started)
                exact = int(np.argmax(vectors @ query))
                right += bool(hits) and hits[0].entry.question == f"question {exact}"
            rows.append(
                {
                    "entries": size,
                    "write_s": round(written, 1),
                    "load_s": round(loaded, 2),
                    **percentiles(samples),
                    "recall_at_1": right / len(queries),
                    "rss_mb": round(rss_mb(), 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            bank.close()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="folder of data sets (documents.jsonl, queries.jsonl)")
    parser.add_argument("--embedder", choices=("hashing", "minilm"), default="hashing")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=list(DEFAULT_CHECKPOINTS))
    parser.add_argument("--batch", type=int, default=10_000, help="documents per add_documents call")
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--qa-entries", type=int, nargs="*", default=[100_000, 1_000_000])
    parser.add_argument("--reopen-qa-entries", type=int, default=100_000, help="QA entries beside the chunks")
    parser.add_argument("--no-answer", dest="answer", action="store_false", help="reopen without a first answer")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--out", default="benchmarks/results/scale.json")
    args = parser.parse_args(argv)
    embedder = make_embedder(args.embedder)
    with tempfile.TemporaryDirectory() as folder:
        result: dict[str, Any] = {
            "embedder": embedder.name,
            "chunks": bench_chunks(args, embedder, Path(folder) / "cache"),
        }
    result["qa_lookup"] = bench_qa_lookup(args, args.qa_entries)
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
