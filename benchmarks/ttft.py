"""Time to first token with and without chunk-state reuse, side by side in one run.

For each trial, prompts are [system, 3 chunks of ~150 tokens, question] built from real
paragraphs of ``--data`` (default ``../shared/data``, SQuAD 1.1 dev). In a fresh cache:

    miss       [A, B, C]   nothing stored
    1-path     [A, X, Y]   restores [system, A]
    2-path     [A, B, Z]   restores [system, A, B]
    full-path  [A, B, C]   restores [system, A, B, C]

It also times loading + restoring a stored full-path state, a QA-bank hit end to end
(embedding included), and ``QABank.check`` over a bank of ``--qa-entries`` entries.
Prints a table and writes JSON (``--out``).

    .venv/bin/python benchmarks/ttft.py --data ../shared/data --out benchmarks/results/ttft.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path
from percache_core.qa.bank import QABank
from percache_core.serving.prompting import chunk_text
from percache_core.storage import Store
from percache_core.types import Chunk


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": 1000 * statistics.fmean(values),
        "p50_ms": 1000 * percentile(values, 50),
        "p95_ms": 1000 * percentile(values, 95),
        "n": len(values),
    }


def pick_paragraphs(
    data: Path, engine: LlamaEngine, count: int, seed: int
) -> tuple[list[Chunk], dict[str, str]]:
    """Paragraphs whose chunk segment is 120-180 tokens, and one question per paragraph."""
    documents = load_jsonl(data / "squad11-dev" / "documents.jsonl")
    queries = load_jsonl(data / "squad11-dev" / "queries.jsonl")
    question_for = {}
    for query in queries:
        for doc_id in query["gold_doc_ids"]:
            question_for.setdefault(doc_id, query["question"])
    chunks = []
    for record in documents:
        chunk = Chunk(record["doc_id"], record["doc_id"], record["text"])
        if 120 <= len(engine.tokenize(chunk_text(chunk))) <= 180 and chunk.id in question_for:
            chunks.append(chunk)
    random.Random(seed).shuffle(chunks)
    if len(chunks) < count:
        sys.exit(f"only {len(chunks)} paragraphs of 120-180 tokens in {data}; need {count}")
    return chunks[:count], question_for


def ttft_trials(args, engine, embedder, folder: Path) -> dict:
    chunks, question_for = pick_paragraphs(args.data, engine, 6 * args.trials, args.seed)
    config = PerCacheConfig(qa_bank=False, max_new_tokens=1)
    cases = {"miss": [], "1-path": [], "2-path": [], "full-path": []}
    reused = {name: [] for name in cases}
    prompt_tokens = []
    restore_total, restore_load, restore_set = [], [], []
    for trial in range(args.trials):
        a, b, c, x, y, z = chunks[6 * trial : 6 * trial + 6]
        question = question_for[a.id]
        with PerCache.open(folder / f"trial{trial}", config=config, engine=engine, embedder=embedder) as pc:
            for name, path in (
                ("miss", [a, b, c]),
                ("1-path", [a, x, y]),
                ("2-path", [a, b, z]),
                ("full-path", [a, b, c]),
            ):
                answer = pc.caller.generate(question, path)
                cases[name].append(answer.ttft_s)
                reused[name].append(answer.reused_tokens)
                if name == "miss":
                    prompt_tokens.append(answer.prefilled_tokens)
            node = max(internals(pc).tree.nodes, key=lambda n: (n.depth, n.n_tokens))
            for _ in range(5):
                started = time.perf_counter()
                data = internals(pc).states.get(node)
                loaded = time.perf_counter()
                with engine.lock:
                    assert engine.load_state(data, node.n_tokens)
                done = time.perf_counter()
                restore_load.append(loaded - started)
                restore_set.append(done - loaded)
                restore_total.append(done - started)
    miss_mean = statistics.fmean(cases["miss"])
    return {
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "ttft": {name: summary(values) for name, values in cases.items()},
        "reused_tokens_mean": {name: statistics.fmean(values) for name, values in reused.items()},
        "ttft_ratio_to_miss": {name: statistics.fmean(values) / miss_mean for name, values in cases.items()},
        "state_load_and_restore": {
            "load_from_disk": summary(restore_load),
            "llama_state_seq_set_data": summary(restore_set),
            "total": summary(restore_total),
            "state_bytes": node.size,
        },
    }


def qa_hit_latency(args, engine, embedder, folder: Path) -> dict:
    queries = load_jsonl(args.data / "squad11-dev" / "queries.jsonl")
    questions = [q["question"] for q in queries[: args.qa_questions]]
    with PerCache.open(folder / "qa", config=PerCacheConfig(), engine=engine, embedder=embedder) as pc:
        embeddings = embedder.embed(questions)
        for question, embedding in zip(questions, embeddings):
            internals(pc).qa_bank.put(question, embedding, "stored answer")
        latencies, hits = [], 0
        for question in questions:
            answer = pc.answer(question)
            hits += answer.answered_before
            latencies.append(answer.latency_s)
        embed_times = []
        for question in questions[:50]:
            started = time.perf_counter()
            embedder.embed([question])
            embed_times.append(time.perf_counter() - started)
    return {
        "bank_entries": len(questions),
        "hits": hits,
        "latency": summary(latencies),
        "embedding_only": summary(embed_times),
    }


def check_at_scale(args, folder: Path) -> dict:
    rng = np.random.default_rng(args.seed)
    dimension = 384
    vectors = rng.standard_normal((args.qa_entries, dimension)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    bank = QABank(Store(folder / "big"), dimension=dimension, budget_bytes=10**10)
    started = time.perf_counter()
    for i, vector in enumerate(vectors):
        bank.put(f"synthetic question {i}", vector, "answer")
    fill_s = time.perf_counter() - started
    times, found = [], 0
    for i in rng.integers(0, args.qa_entries, 200):
        query = vectors[i] + 0.01 * rng.standard_normal(dimension).astype(np.float32)
        query /= np.linalg.norm(query)
        started = time.perf_counter()
        hit = bank.nearest(query, similarity_threshold=0.85)
        times.append(time.perf_counter() - started)
        found += hit is not None and hit.entry.question == f"synthetic question {i}"
    bank.close()
    return {
        "entries": args.qa_entries,
        "fill_s": fill_s,
        "check": summary(times),
        "correct_hits": found,
        "queries": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--qa-questions", type=int, default=200)
    parser.add_argument("--qa-entries", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ttft.json"))
    args = parser.parse_args()
    if not (args.data / "squad11-dev" / "documents.jsonl").is_file():
        sys.exit(f"no squad11-dev/documents.jsonl under {args.data}: pass --data")

    model_path = resolve_model_path(None)
    engine = LlamaEngine(model_path)
    engine.warm_up()
    embedder = BertEmbedder()
    embedder.embed(["warm-up"])
    with tempfile.TemporaryDirectory(prefix="percache-bench-") as temporary:
        folder = Path(temporary)
        result = {
            "benchmark": "ttft",
            "settings": {
                "model": model_path.name,
                "embedder": embedder.name,
                "trials": args.trials,
                "seed": args.seed,
                "n_ctx": engine.n_ctx,
                "n_batch": engine.n_batch,
                "machine": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count(),
                },
            },
            "chunk_states": ttft_trials(args, engine, embedder, folder),
            "qa_bank_hit": qa_hit_latency(args, engine, embedder, folder),
            "qa_bank_check_at_scale": check_at_scale(args, folder),
        }
    engine.close()

    states = result["chunk_states"]
    print(f"prompt: system + 3 chunks + question, {states['prompt_tokens_mean']:.0f} tokens on average")
    print(f"{'case':<10} {'TTFT p50 ms':>12} {'mean ms':>9} {'x miss':>7} {'reused tok':>11}")
    for name, timing in states["ttft"].items():
        print(
            f"{name:<10} {timing['p50_ms']:>12.1f} {timing['mean_ms']:>9.1f} "
            f"{states['ttft_ratio_to_miss'][name]:>7.3f} {states['reused_tokens_mean'][name]:>11.0f}"
        )
    restore = states["state_load_and_restore"]
    print(
        f"full-path state ({restore['state_bytes'] / 1e6:.1f} MB): load {restore['load_from_disk']['p50_ms']:.2f} ms"
        f" + restore {restore['llama_state_seq_set_data']['p50_ms']:.2f} ms = {restore['total']['p50_ms']:.2f} ms (p50)"
    )
    qa = result["qa_bank_hit"]
    print(
        f"QA-bank hit, embedding included: p50 {qa['latency']['p50_ms']:.1f} ms ({qa['hits']}/{qa['bank_entries']} hits; "
        f"embedding alone p50 {qa['embedding_only']['p50_ms']:.1f} ms)"
    )
    scale = result["qa_bank_check_at_scale"]
    print(
        f"QABank.check over {scale['entries']:,} entries: p50 {scale['check']['p50_ms']:.2f} ms, "
        f"p95 {scale['check']['p95_ms']:.2f} ms ({scale['correct_hits']}/{scale['queries']} found)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
