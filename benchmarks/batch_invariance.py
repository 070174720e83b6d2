"""Whether a llama-server computes a request the same with and without other requests beside
it, per server configuration, bit for bit.

A llama-server batches the work of its slots: one request's prompt tokens share a ubatch
with another's prompt or decode tokens. Where that changes a request's arithmetic, what a
run batched with another computes differs from a lone run's, and PerCache keeps nothing of
it. Read in llama.cpp's CPU backend (the sources this build comes from), a token's numbers
may depend on its batch through weight repacking (``-nr`` turns it off), the tiled K-quant
matmul at 8 rows or more (env ``GGML_CPU_TILED_MM=0``), llamafile's tinyBLAS, which
declines one token row (a build whose tinyBLAS takes every batch size: ``make
llama-server-invariant``, or one without llamafile), CPU flash attention's paths (``-fa
off``) and one KV cache shared by every slot (``--no-kv-unified`` gives each slot its own).
This benchmark measures which configurations make a request's result independent of its
neighbours (``--server`` names the binary).

Per model and configuration: a reference server (``-np 1``) runs each prompt alone, fresh
(``cache_prompt: false``); a two-slot server of the same configuration then runs it alone
in slot 0, alone in slot 1 while slot 0 holds another prompt, beside another request's
prefill (a long prompt sent just before) and beside another's decode (sent once the other
streams tokens). Compared with the reference: the first token's top-10 log-probabilities
and 64 greedy tokens. Prompts (on Gemma 3's tokenizer): 146 tokens, 1,040 (past its
512-token window) and 3,731 (past 2,048). Also each configuration's prefill and decode speed alone (the server's timings).

    .venv/bin/python -m benchmarks.batch_invariance --models bundled,smollm2 \\
        --out benchmarks/results/batch_invariance.json

With ``--load N``: N clients at once instead, on an N-slot server of each configuration,
each sending ``--requests`` RAG prompts over QMSum passages of ``--data`` (fresh, greedy,
any slot); each reply is compared with the same prompt alone on a one-slot server of the
same configuration, and the load's wall time is reported.

    .venv/bin/python -m benchmarks.batch_invariance --configs "all four" --load 4 --data ../shared/data
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from percache_core.engines.llama_server.server import LlamaServer, find_server_binary, free_port
from percache_core.engines.llama_server.server_process import wait_until_ready
from percache_core.kv.probe_text import probe_sentences

from .data_sets import default_data_folder, read_data_set
from .output import write_json
from .stock import model_paths

# name -> (flags, environment)
CONFIGS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),
    "no repack": (("-nr",), {}),
    "flash attention off": (("-fa", "off"), {}),
    "tiled matmul off": ((), {"GGML_CPU_TILED_MM": "0"}),
    "no unified KV": (("--no-kv-unified",), {}),
    "all four": (("-nr", "-fa", "off", "--no-kv-unified"), {"GGML_CPU_TILED_MM": "0"}),
    # what LlamaServer.start runs (ServerLaunch), without and with the invariant launch's switches (its flash
    # attention on: invariant only on the build make llama-server-invariant makes)
    "PerCache's launch": (("-b", "512", "-ub", "512", "--swa-full", "-no-kvu"), {}),
    "PerCache's invariant launch": (("-b", "512", "-ub", "512", "--swa-full", "-no-kvu", "-nr", "-fa", "on"),
                                    {"GGML_CPU_TILED_MM": "0"}),
    "PerCache's invariant launch with -fa off": (("-b", "512", "-ub", "512", "--swa-full", "-no-kvu", "-nr", "-fa", "off"),
                                                 {"GGML_CPU_TILED_MM": "0"}),  # (the launch a model faster without it gets)
    "PerCache's invariant launch with the tiled matmul forced": (
        ("-b", "512", "-ub", "512", "--swa-full", "-no-kvu", "-nr", "-fa", "on"), {"GGML_CPU_TILED_MM_FORCE": "1"}),
    "PerCache's invariant launch with -fa off and the tiled matmul forced": (
        ("-b", "512", "-ub", "512", "--swa-full", "-no-kvu", "-nr", "-fa", "off"), {"GGML_CPU_TILED_MM_FORCE": "1"}),
}
PROMPT_SENTENCES = {"short": 6, "past 512": 45, "past 2048": 160}  # 146, 1,040 and 3,731 tokens on Gemma 3
GREEDY_TOKENS = 64
SCENARIOS = ("alone in slot 0", "alone in slot 1", "beside a prefill", "beside a decode")


class Server:
    """A llama-server of *model* with *flags* and *env* on a free loopback port."""

    def __init__(self, binary: Path, model: Path, threads: int, flags: tuple[str, ...], env: dict[str, str]) -> None:
        self.port = free_port("127.0.0.1")
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-c", "16384",
                "-t", str(threads), "-tb", str(threads), "--no-webui", *flags]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
        wait_until_ready(LlamaServer(url=f"http://127.0.0.1:{self.port}").http, 180)

    def stream(self, prompt: str, slot: int, n_predict: int) -> Iterator[dict[str, Any]]:
        """``/completion`` of *prompt* in *slot*, fresh and greedy, streamed: its events."""
        body = {"prompt": prompt, "n_predict": n_predict, "id_slot": slot, "cache_prompt": False, "temperature": 0,
                "n_probs": 10, "return_tokens": True, "stream": True}
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            for line in connection.getresponse():
                if line.startswith(b"data:"):
                    yield json.loads(line[5:])
        finally:
            connection.close()

    def run(self, prompt: str, slot: int = 0, n_predict: int = GREEDY_TOKENS) -> dict[str, Any]:
        """The request's greedy tokens, first token's top log-probabilities and timings."""
        tokens: list[int] = []
        first: list[tuple[int, float]] | None = None
        timings: dict[str, Any] = {}
        for event in self.stream(prompt, slot, n_predict):
            tokens += [int(t) for t in event.get("tokens") or ()]
            probabilities = event.get("completion_probabilities")
            if probabilities and first is None:
                first = [(int(p["id"]), float(p["logprob"])) for p in probabilities[0]["top_logprobs"]]
            timings = event.get("timings") or timings
        return {"tokens": tokens, "first": first, "timings": timings}

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lone_runs(binary: Path, model: Path, threads: int, name: str, prompts: list[str]) -> dict[str, dict[str, Any]]:
    """Each of *prompts* alone on a one-slot server of configuration *name*: the
    references the runs beside others are compared with, by prompt."""
    flags, env = CONFIGS[name]
    with Server(binary, model, threads, ("-np", "1", *flags), env) as server:
        return {prompt: server.run(prompt, 0) for prompt in prompts}


def beside(server: Server, prompt: str, other: str, other_tokens: int, wait_for_tokens: bool) -> dict[str, Any]:
    """*prompt* in slot 0 while *other* runs in slot 1: sent once the other streams its
    first token (*wait_for_tokens*: beside its decode) or 0.3 s after it (beside its
    prefill: this one's prompt joins the batches of the other's). Also whether the other was
    still running when this one ended (beside a prefill it often was not: its few tokens
    end first)."""
    started, done = threading.Event(), threading.Event()

    def other_request() -> None:
        for event in server.stream(other, 1, other_tokens):
            if event.get("tokens"):
                started.set()
        started.set()
        done.set()

    thread = threading.Thread(target=other_request)
    thread.start()
    if wait_for_tokens:
        started.wait(600)
    else:
        time.sleep(0.3)
    result = server.run(prompt, 0)
    result["other_running_at_end"] = not done.is_set()
    thread.join()
    return result


def compare(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Whether *result* equals the lone *reference*: its first log-probabilities, its
    tokens, and the first token where they part (None: none)."""
    tokens, expected = result["tokens"], reference["tokens"]
    parted = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if parted is None and len(tokens) != len(expected):
        parted = min(len(tokens), len(expected))
    return {"first_logprobs_equal": result["first"] == reference["first"], "tokens_equal": parted is None,
            "parted_at": parted, **({k: result[k] for k in ("other_running_at_end",) if k in result})}


def measure(binary: Path, model: Path, threads: int, name: str) -> dict[str, Any]:
    """One configuration on one model: the reference runs, then every scenario."""
    flags, env = CONFIGS[name]
    prompts = {size: " ".join(probe_sentences(count)) + "\nQuestion: who said the van is late?\nAnswer:"
               for size, count in PROMPT_SENTENCES.items()}
    long_other = " ".join(probe_sentences(150)[::-1])
    alone = lone_runs(binary, model, threads, name, list(prompts.values()))
    references = {size: alone[prompt] for size, prompt in prompts.items()}
    rows = []
    with Server(binary, model, threads, ("-np", "2", *flags), env) as server:
        for size, prompt in prompts.items():
            runs = {"alone in slot 0": server.run(prompt, 0)}
            server.run(long_other, 0, 1)  # slot 0 holds another prompt
            runs["alone in slot 1"] = server.run(prompt, 1)
            runs["beside a prefill"] = beside(server, prompt, long_other, 8, wait_for_tokens=False)
            runs["beside a decode"] = beside(server, prompt, "Count from one to two hundred:", 400, wait_for_tokens=True)
            rows += [{"prompt": size, "prompt_tokens": references[size]["timings"].get("prompt_n"), "scenario": scenario,
                      **compare(runs[scenario], references[size])} for scenario in SCENARIOS]
    long = references["past 2048"]["timings"]
    speed = {"prefill_tokens_per_s": long.get("prompt_per_second"), "decode_tokens_per_s": long.get("predicted_per_second")}
    invariant = all(r["first_logprobs_equal"] and r["tokens_equal"] for r in rows)
    print(f"{model.name} {name}: {'invariant' if invariant else 'differs'} "
          f"({sum(r['tokens_equal'] for r in rows)}/{len(rows)} texts, "
          f"{sum(r['first_logprobs_equal'] for r in rows)}/{len(rows)} first log-probabilities); "
          f"prefill {speed['prefill_tokens_per_s']:.0f} tok/s, decode {speed['decode_tokens_per_s']:.1f} tok/s", flush=True)
    return {"model": model.name, "config": name, "flags": list(flags), "env": env, "invariant": invariant, **speed, "rows": rows}


def load_prompts(data: Path, clients: int, requests: int) -> list[list[str]]:
    """Per client, *requests* RAG prompts over QMSum passages of ``--data``: two passages
    of about 300-600 tokens and a question of the meeting; clients in pairs share their
    passages (as ``benchmarks.endpoint``'s load workload), each with its own questions."""
    documents, queries = read_data_set(data, "qmsum")
    by_user: dict[str, list[str]] = {}
    for document in documents:
        by_user.setdefault(document["user"], []).append(document["text"].strip())
    users = sorted(by_user)
    prompts: list[list[str]] = []
    for client in range(clients):
        user = users[(client // 2) % len(users)]
        passages = by_user[user]
        questions = [q["question"] for q in queries.get(user, [])] or ["What was decided?"]
        own = []
        for index in range(requests):
            first, second = passages[index % len(passages)], passages[(index + 1) % len(passages)]
            question = questions[(client % 2 + 2 * index) % len(questions)]
            own.append(f"Context:\n{first[:2000]}\n\n{second[:2000]}\nQuestion: {question}\nAnswer:")
        prompts.append(own)
    return prompts


def under_load(binary: Path, model: Path, threads: int, name: str, prompts: list[list[str]]) -> dict[str, Any]:
    """One client per list of *prompts* (:func:`load_prompts`), all at once on a server of
    as many slots of configuration *name*, each sending its prompts one after another
    (fresh, greedy, any slot), compared with each prompt alone on a one-slot server of the
    same configuration; and the load's wall time."""
    flags, env = CONFIGS[name]
    clients, requests = len(prompts), max(len(own) for own in prompts)
    references = lone_runs(binary, model, threads, name, [p for own in prompts for p in own])
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def client(own: list[str], delay: float) -> None:
        time.sleep(delay)
        for prompt in own:
            result = server.run(prompt, -1)
            with lock:
                results[prompt] = result

    with Server(binary, model, threads, ("-np", str(clients), *flags), env) as server:
        started = time.perf_counter()
        workers = [threading.Thread(target=client, args=(own, 0.15 * i)) for i, own in enumerate(prompts)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        wall = time.perf_counter() - started
    rows = [{"prompt_tokens": references[p]["timings"].get("prompt_n"), **compare(results[p], references[p])}
            for own in prompts for p in own]
    texts = sum(r["tokens_equal"] for r in rows)
    firsts = sum(r["first_logprobs_equal"] for r in rows)
    print(f"{model.name} {name} under load ({clients} clients x {requests}): {texts}/{len(rows)} texts, "
          f"{firsts}/{len(rows)} first log-probabilities equal a lone run's; wall {wall:.1f} s", flush=True)
    return {"model": model.name, "config": name, "flags": list(flags), "env": env, "clients": clients,
            "requests": requests, "texts_equal": texts, "first_logprobs_equal": firsts, "runs": len(rows),
            "wall_s": wall, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bundled", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--server", type=Path, default=None, help="a llama-server binary (default: the one PerCache finds)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="default: benchmarks/results/batch_invariance.json (with --load: batch_invariance_load.json)")
    parser.add_argument("--load", type=int, default=0, metavar="CLIENTS",
                        help="instead: this many clients at once, each prompt compared with a lone run (prompts from --data)")
    parser.add_argument("--requests", type=int, default=6, help="prompts per client with --load")
    parser.add_argument("--data", type=Path, help="the folder with qmsum/ (for --load)")
    args = parser.parse_args(argv)
    if args.load < 0 or args.requests < 1:
        parser.error("--load: 0 or more clients; --requests: 1 or more")
    out = args.out or f"benchmarks/results/batch_invariance{'_load' if args.load else ''}.json"
    names = [name.strip() for name in args.configs.split(",")]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    binary = args.server or find_server_binary()
    prompts = load_prompts(args.data or default_data_folder(), args.load, args.requests) if args.load else None
    results: list[dict[str, Any]] = []
    for model in model_paths(args.models):
        for name in names:
            if prompts is not None:
                results.append(under_load(binary, model, args.threads, name, prompts))
            else:
                results.append(measure(binary, model, args.threads, name))
            write_json({"server": str(binary), "results": results}, out)  # after each: a stopped run keeps them
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
