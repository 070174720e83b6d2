"""The shared tier on a loopback Redis: TTFT of a shared-tier hit against a local miss and a
local hit, the catalog's false-positive rate, network round trips the catalog avoids, and
answers per second with several client processes. Writes JSON (``--out``).

    .venv/bin/python benchmarks/shared_tier.py --data ../shared/data --out benchmarks/results/shared_tier.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.data_sets import default_data_folder, read_jsonl
from benchmarks.output import write_json
from percache_core import Chunk, PerCache, PerCacheConfig
from percache_core.inspection import internals
from percache_core.shared.bloom import BloomFilter
from tests.local_redis import RedisServer

SECRET = "benchmark-secret-twenty-chars"


def prompts(data: Path, count: int) -> list[tuple[str, list[Chunk]]]:
    documents = read_jsonl(data / "squad11-dev" / "documents.jsonl")
    queries = read_jsonl(data / "squad11-dev" / "queries.jsonl")
    by_id = {d["doc_id"]: d for d in documents}
    chosen, used = [], set()
    for query in queries:
        gold = query["gold_doc_ids"][0]
        if gold in used or gold not in by_id:
            continue
        used.add(gold)
        others = [d for d in documents if d["user"] == by_id[gold]["user"] and d["doc_id"] != gold][:2]
        chunks = [Chunk(d["doc_id"], d["doc_id"], d["text"]) for d in [by_id[gold], *others]]
        chosen.append((query["question"], chunks))
        if len(chosen) == count:
            break
    return chosen


def config(url: str | None, **changes) -> PerCacheConfig:
    shared = (
        {
            "shared_url": url,
            "shared_secret": SECRET,
            "shared_namespace": "bench",
            "shared_sync_interval_s": 0.1,
        }
        if url
        else {}
    )
    return PerCacheConfig(**({"max_new_tokens": 1, "qa_bank": False} | shared | changes))


def writer(url: str, data: str, count: int) -> None:
    with PerCache.open(tempfile.mkdtemp(), config=config(url)) as pc:
        for question, chunks in prompts(Path(data), count):
            pc.caller.generate(question, chunks)


def client(url: str, data: str, count: int, queue) -> None:
    """One of the clients answering questions at the same time (throughput)."""
    with PerCache.open(tempfile.mkdtemp(), config=config(url, qa_bank=True, max_new_tokens=16)) as pc:
        work = prompts(Path(data), count)
        pc.preload()
        time.sleep(0.5)  # let the catalog sync
        started = time.perf_counter()
        for question, chunks in work:
            pc.caller.generate(question, chunks)
        queue.put((len(work), time.perf_counter() - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=default_data_folder())
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/shared_tier.json"))
    args = parser.parse_args()
    server = RedisServer(Path(tempfile.mkdtemp()) / "redis").start()
    context = multiprocessing.get_context("spawn")
    try:
        url = server.url
        process = context.Process(target=writer, args=(url, str(args.data), args.prompts))
        process.start()
        process.join()
        work = prompts(args.data, args.prompts)
        ttft = {"local miss": [], "shared-tier hit": [], "local hit": []}
        with PerCache.open(tempfile.mkdtemp(), config=config(None)) as alone:
            alone.preload()
            for question, chunks in work:
                ttft["local miss"].append(alone.caller.generate(question, chunks).ttft_s)
        with PerCache.open(tempfile.mkdtemp(), config=config(url)) as reader:
            reader.preload()
            time.sleep(0.5)
            for question, chunks in work:
                shared_hit = reader.caller.generate(question, chunks)
                local_hit = reader.caller.generate(question, chunks)
                ttft["shared-tier hit"].append(shared_hit.ttft_s)
                ttft["local hit"].append(local_hit.ttft_s)
            fresh = prompts(args.data, 2 * args.prompts)[args.prompts :]  # never populated
            for question, chunks in fresh:
                reader.caller.generate(question, chunks)
            bloom = internals(reader).shared.bloom
            stats = reader.stats()["shared"]
        full = BloomFilter(bloom.capacity, bloom.false_positive_rate)  # the same filter, filled to capacity
        for _ in range(full.capacity):
            full.add(uuid.uuid4().hex)
        probes = [uuid.uuid4().hex for _ in range(20_000)]
        false_positives = sum(p in full for p in probes)
        queue = context.Queue()
        clients = [
            context.Process(target=client, args=(url, str(args.data), args.prompts, queue))
            for _ in range(args.clients)
        ]
        wall = time.perf_counter()
        for process in clients:
            process.start()
        done = [queue.get(timeout=600) for _ in clients]
        for process in clients:
            process.join()
        wall = time.perf_counter() - wall
    finally:
        server.stop()
    miss = statistics.fmean(ttft["local miss"])
    result = {
        "benchmark": "shared_tier",
        "settings": vars(args) | {"data": str(args.data), "out": str(args.out)},
        "ttft_ms": {
            name: {"mean": 1000 * statistics.fmean(v), "p50": 1000 * statistics.median(v)}
            for name, v in ttft.items()
        },
        "ttft_ratio_to_local_miss": {name: statistics.fmean(v) / miss for name, v in ttft.items()},
        "catalog": {
            "keys": bloom.count,
            "filled_to_capacity": full.capacity,
            "configured_false_positive_rate": bloom.false_positive_rate,
            "measured_false_positive_rate": false_positives / len(probes),
            "round_trips_avoided_on_misses": stats["catalog_misses"],
            "fetches": stats["fetches"],
            "wasted_fetches": stats["wasted_fetches"],
        },
        "throughput": {
            "clients": args.clients,
            "answers": sum(n for n, _ in done),
            "wall_s": wall,
            "answers_per_s": sum(n for n, _ in done) / wall,
        },
    }
    for name, value in result["ttft_ms"].items():
        print(
            f"{name:<16} TTFT mean {value['mean']:7.1f} ms  ({result['ttft_ratio_to_local_miss'][name]:.3f} x local miss)"
        )
    catalog = result["catalog"]
    print(
        f"catalog: {catalog['keys']} keys, false positives {catalog['measured_false_positive_rate']:.4f} "
        f"(configured {catalog['configured_false_positive_rate']}), {catalog['round_trips_avoided_on_misses']} misses without a round trip, "
        f"{catalog['wasted_fetches']} wasted fetches of {catalog['fetches']}"
    )
    print(
        f"{args.clients} clients: {result['throughput']['answers']} answers in {wall:.1f} s = {result['throughput']['answers_per_s']:.2f} answers/s"
    )
    write_json(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
