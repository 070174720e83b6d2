"""Whether what PerCache keeps under load on a batch-invariant server equals lone fresh runs.

``percache serve`` in front of a server it started with ``ServerLaunch(batch_invariant=True)``
keeps the answers and states of runs batched with others as a lone run's. This checks that
claim on the load workload of ``benchmarks.endpoint`` (clients at once, pairs sharing
passages): after the clients' requests ran together, each request is

- compared with the server's fresh text for it (``cache_prompt: false``, alone);
- asked again through the endpoint, alone: it must come from the stored answer, with the
  same text;
- asked with another question over the same passages, alone: it must restore the states
  kept under load (reused tokens) and give the server's fresh text.

Each is a (request, kept result) pair; reported: how many equal.

    .venv/bin/python -m benchmarks.invariant_load --data ../shared/data --clients 4 --requests 6
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from percache_core import LlamaServer, PerCache, PerCacheConfig, ServerLaunch
from percache_core.endpoint.serve import serving_in_thread
from percache_core.inspection import internals

from .endpoint import client, lc_messages
from .output import write_json
from .stock import QMSUM_USER, model_paths, rag_chat_turns, user_rows


def check(model: Path, data: Path, clients: int, requests: int) -> dict[str, Any]:
    """The load's requests at once, then each checked alone (see the module)."""
    chunks, questions = user_rows(data, "qmsum", QMSUM_USER)
    sessions = rag_chat_turns(chunks, questions, clients * requests + 2)
    asks = [[list(sessions[(c // 2 + n * clients) % len(sessions)][:1]) + [("user", sessions[(c + n) % len(sessions)][1][1])]
             for n in range(requests)] for c in range(clients)]
    other = sessions[-1][1][1]  # a question none of them asks
    launch = ServerLaunch(n_ctx=4096, n_slots=4, batch_invariant=True)
    with tempfile.TemporaryDirectory() as folder, LlamaServer.start(model, launch) as server:
        fresh = client(f"{server.url}/v1", extra_body={"cache_prompt": False})
        with PerCache.open(Path(folder) / "cache", config=PerCacheConfig(prediction=False), engine=server) as pc, \
                serving_in_thread(pc, server) as url:
            pc.preload()

            def run(own: list[list[tuple[str, str]]]) -> list[str]:
                chat = client(url)
                return [str(chat.invoke(lc_messages(m)).content) for m in own]

            with ThreadPoolExecutor(max_workers=clients) as pool:
                under_load = [t for texts in pool.map(run, asks) for t in texts]
            flat = [m for own in asks for m in own]
            runner = internals(pc).runtime.runner
            batched, served_before = runner.batched_runs, pc.stats()["prompt_answers"]
            chat = client(url)
            again = [str(chat.invoke(lc_messages(m)).content) for m in flat]
            from_store = pc.stats()["prompt_answers"] - served_before
            variants = [m[:-1] + [("user", other)] for m in flat[::2]]
            reused_before = pc.stats()["reused_tokens"]
            variant_texts = [str(chat.invoke(lc_messages(m)).content) for m in variants]
            reused = pc.stats()["reused_tokens"] - reused_before
        references = [str(fresh.invoke(lc_messages(m)).content) for m in flat]
        variant_references = [str(fresh.invoke(lc_messages(m)).content) for m in variants]
    return {
        "model": model.name, "clients": clients, "requests": len(flat), "batched_runs": batched,
        "under_load_equal_fresh": sum(a == b for a, b in zip(under_load, references)),
        "asked_again_from_store": from_store,
        "asked_again_equal": sum(a == b for a, b in zip(again, under_load)),
        "variants": len(variants), "variant_reused_tokens": reused,
        "variant_equal_fresh": sum(a == b for a, b in zip(variant_texts, variant_references)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="the shared data folder (QMSum passages)")
    parser.add_argument("--models", default="bundled", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="requests per client")
    parser.add_argument("--out", default="benchmarks/results/invariant_load.json")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        parser.error("--clients and --requests: 1 or more")
    results = []
    for model in model_paths(args.models):
        results.append(check(model, args.data, args.clients, args.requests))
        print(results[-1], flush=True)
        write_json({"results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
