"""What ``percache serve`` keeps under load is exact: clients at once on a llama-server
started with its defaults, then every request asked again alone.

The load is laid out as the endpoint benchmark's (``benchmarks.endpoint --workloads load``,
``load_asks``: pairs of clients share passages, which come again every few rounds), over 8
chats of the QMSum user (so prompts repeat: 32 distinct among 8 x 13), sent by ``--clients`` clients
at once, ``--requests`` each, through ``percache serve`` in front of a default server with
``--slot-save-path``. Runs batched there get the server's text under batching and keep
nothing; runs that computed alone keep their answers and states. Then each request is
asked again through the same endpoint, one at a time: a stored answer, or a run that
restores the states kept under load. Each of those replies is compared with the fresh
text (a second default server, one request at a time, ``cache_prompt: false``). Reported
per model: the pairs, how many differ, how the replies were served (stored answer, states
restored, fresh), the runs batched under load, and how many replies under load were the
fresh text.

With ``--batch-invariant`` the endpoint runs in front of a server PerCache starts so
(``ServerLaunch(batch_invariant=True)``, 4 slots), which keeps batched runs' answers and
states as lone runs'; the fresh text is then a one-slot server of the same launch's.

    .venv/bin/python -m benchmarks.load_exactness --data ../shared/data --models bundled,smollm2
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from percache_core import LlamaServer, PerCache, PerCacheConfig, ServerLaunch
from percache_core.endpoint.serve import serving_in_thread
from percache_core.inspection import internals

from .endpoint import MAX_TOKENS, load_asks, load_side
from .output import write_json
from .server import ServerAlone
from .stock import QMSUM_USER, model_paths, rag_chat_turns, user_rows


def ask(chat: openai.OpenAI, messages: list[tuple[str, str]], **extra: Any) -> Any:
    """*messages* asked on *chat*, greedy, as the load's clients ask (``extra``: body fields)."""
    return chat.chat.completions.create(
        model="model", messages=[{"role": role, "content": text} for role, text in messages],  # type: ignore[misc]
        temperature=0, max_tokens=MAX_TOKENS, extra_body=extra or None,
    )


def servers(model_path: Path, slots: Path, threads: int, invariant: bool) -> tuple[Any, Any, LlamaServer, str]:
    """(the served server, the reference server, the endpoint's :class:`LlamaServer`, the
    reference's base URL): default servers, or launches of PerCache's batch-invariant kind."""
    if invariant:
        launch = ServerLaunch(n_slots=4, n_threads=threads, slot_save_path=slots, batch_invariant=True)
        served = LlamaServer.start(model_path, launch)
        reference = LlamaServer.start(model_path, replace(launch, n_slots=1, slot_save_path=None))
        return served, reference, served, f"{reference.url}/v1"
    served, reference = (ServerAlone(model_path, threads, ("--slot-save-path", str(slots)), server_defaults=True),
                         ServerAlone(model_path, threads, (), server_defaults=True))
    return served, reference, LlamaServer(url=f"http://127.0.0.1:{served.port}", slot_save_path=slots), \
        f"http://127.0.0.1:{reference.port}/v1"


def model_pairs(model_path: Path, data: Path, clients: int, requests: int, threads: int,
                invariant: bool = False) -> dict[str, Any]:
    """One model's load, then its requests again alone against the fresh text."""
    chunks, questions = user_rows(data, "qmsum", QMSUM_USER)
    asks = load_asks(rag_chat_turns(chunks, questions, 8), clients, requests)
    prompts = [messages for own in asks for messages in own]
    with tempfile.TemporaryDirectory() as folder:
        slots = Path(folder) / "slots"
        slots.mkdir()
        server, reference, attached, reference_url = servers(model_path, slots, threads, invariant)
        try:
            fresh = openai.OpenAI(base_url=reference_url, api_key="none", timeout=600)
            with PerCache.open(Path(folder) / "cache", config=PerCacheConfig(prediction=False), engine=attached) as pc, \
                    serving_in_thread(pc, attached) as url:
                pc.preload()
                seconds, _, errors, under_load = load_side(url, asks)
                runner = internals(pc).runtime.runner
                batched, kept = runner.batched_runs, pc.stats()["chunk_states"]["nodes"]
                ours = openai.OpenAI(base_url=url, api_key="none", timeout=600)
                served = []
                for messages in prompts:
                    reply = ask(ours, messages)
                    about = getattr(reply, "percache", None) or {}
                    served.append((reply.choices[0].message.content or "", about.get("source", "?"),
                                   int(about.get("reused_tokens") or 0)))
            references = [ask(fresh, messages, cache_prompt=False).choices[0].message.content or "" for messages in prompts]
        finally:
            server.close()
            reference.close()
    sources = dict(Counter(source for _, source, _ in served))
    different = [i for i, ((text, _, _), ref) in enumerate(zip(served, references)) if text != ref]
    loaded = [text for texts in under_load for text in texts]
    row = {"clients": clients, "requests": len(prompts), "batch_invariant": invariant, "load_seconds": round(seconds, 1),
           "load_errors": errors, "batched_under_load": batched, "states_kept_under_load": kept,
           "under_load_equal_fresh": sum(a == b for a, b in zip(loaded, references)), "pairs": len(prompts),
           "different": len(different), "sources": sources,
           "differences": [{"request": i, "source": served[i][1], "percache": served[i][0], "fresh": references[i]}
                           for i in different],
           "restored_tokens": sum(reused for _, _, reused in served)}
    print(f"  {model_path.name}: {row['pairs']} pairs, {row['different']} different, sources {sources}, "
          f"{batched} batched under load, {kept} states kept, {row['under_load_equal_fresh']} replies under load "
          "the fresh text", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/load_exactness.json"))
    parser.add_argument("--models", default="bundled", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=13, help="requests per client")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="serve a server PerCache starts batch-invariant (make llama-server-invariant)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        parser.error("--clients and --requests: 1 or more")
    results: dict[str, Any] = {"max_tokens": MAX_TOKENS, "models": {}}
    for path in model_paths(args.models):
        print("model", path.name, flush=True)
        results["models"][path.name] = model_pairs(path, args.data, args.clients, args.requests, args.threads,
                                                   args.batch_invariant)
        write_json(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
