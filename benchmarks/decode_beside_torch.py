"""Decode speed of PerCache's engine and of stock ``llama_cpp.Llama`` before and after a torch
embedder has run in the process, as in an app whose embedder is a HuggingFace model.

PerCache makes its llama.cpp calls on a compute thread of its own; the app calls torch (and
stock calls llama.cpp) from the app's thread. In an OpenMP build of llama.cpp the two threads'
OpenMP teams share libgomp's count of threads, and with more threads than cores libgomp stops
spinning at its barriers. This measures what that costs on this build (``OPENMP`` in its
system info says which build it is), the sides alternating prompt by prompt:

    python -m benchmarks.decode_beside_torch --out /tmp/decode_beside_torch.json

Each side: a 400-token prompt, then ``--tokens`` greedy tokens, timed per decoded token
(PerCache: ``LlamaEngine.generate``; stock: ``create_completion`` of ``tokens + 1`` less one
token, both from an empty context). Needs torch and sentence-transformers (the suite's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.output import write_json
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.models import resolve_model_path

TEXT = "The meeting discussed the budget, the schedule and the hiring plan for the next quarter. " * 60


def percache_ms(engine: LlamaEngine, tokens: list[int], decoded: int) -> float:
    """PerCache's engine: milliseconds per decoded token after *tokens*."""
    with engine.lock:
        engine.reset()
        engine.eval(tokens)
        started = time.perf_counter()
        count = sum(1 for _ in engine.generate(max_new_tokens=decoded))
        return (time.perf_counter() - started) * 1000 / count


def stock_ms(stock: Any, tokens: list[int], decoded: int) -> float:
    """Stock, called from this thread (the app's): milliseconds per decoded token, from the
    difference of a completion of *decoded* + 1 tokens and one of 1 token."""
    seconds = []
    for count in (1, decoded + 1):
        stock.reset()
        started = time.perf_counter()
        stock.create_completion(tokens, max_tokens=count, temperature=0.0)
        seconds.append(time.perf_counter() - started)
    return (seconds[1] - seconds[0]) * 1000 / decoded


def measure(engine: LlamaEngine, stock: Any, tokens: list[int], decoded: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per token of each side over *rounds*, the order alternating."""
    times: dict[str, list[float]] = {"percache": [], "stock": []}
    for round_ in range(rounds):
        order = ("percache", "stock") if round_ % 2 == 0 else ("stock", "percache")
        for side in order:
            run = percache_ms(engine, tokens, decoded) if side == "percache" else stock_ms(stock, tokens, decoded)
            times[side].append(run)
    return {side: round(statistics.median(values), 2) for side, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="tokens decoded per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side and phase")
    parser.add_argument("--out", default="benchmarks/results/decode_beside_torch.json")
    args = parser.parse_args(argv)

    from llama_cpp import Llama, llama_print_system_info

    from percache_core.knowledge.embedding import SentenceTransformerEmbedder

    path = resolve_model_path(None)
    engine = LlamaEngine(path, n_ctx=2048, n_batch=512)
    threads = os.cpu_count() or 1  # as the engine's (Llama's own default is half the cores)
    # called from this thread, as an app calls it
    stock = Llama(str(path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    tokens = engine.tokenize(TEXT, True)[:400]
    try:
        before = measure(engine, stock, tokens, args.tokens, args.rounds)
        SentenceTransformerEmbedder().embed(["a question about the budget", "the hiring plan"])
        after = measure(engine, stock, tokens, args.tokens, args.rounds)
    finally:
        engine.close()
        stock.close()
    info = llama_print_system_info().decode("utf-8", "replace")
    result = {
        "openmp_build": "OPENMP = 1" in info,
        "ms_per_token": {"before_torch": before, "after_torch": after},
        "percache_over_stock": {phase: round(v["percache"] / v["stock"], 3) for phase, v in (("before_torch", before), ("after_torch", after))},
        "settings": vars(args),
    }
    write_json(result, args.out)
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
