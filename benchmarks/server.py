"""PerCache on llama-server against the same llama-server alone, as users run it.

What a user of a local server runs today is ``llama-server -m model.gguf`` called over HTTP
(LangChain ``ChatOpenAI``, LlamaIndex ``OpenAILike``), with the server's own caches on: its
slot reuses the longest common token prefix with the previous prompt (``cache_prompt``) and
keeps older prompts' states in RAM (``--cache-ram``, 8 GiB by default). This benchmark
starts two servers from the same binary, model and threads:

- *the server alone*: ``llama-server -m MODEL -c 4096 -np 1`` (its defaults otherwise),
  called with ``/v1/chat/completions`` and ``/completion``;
- *PerCache*: ``LlamaServer.start`` (the flags exact chunk states need) under
  ``PerCache.open(..., engine=server)``, called through ``PerCacheChatModel`` and
  ``pc.caller.complete``.

Each prompt is sent to both, one after the other with the order alternating (this
machine's speed drifts). Reported: each side's time and the ratio, and how many of
PerCache's texts equal *the server's fresh text* (the PerCache server completing the same
tokens with ``cache_prompt: false``: nothing reused), and how many of the server alone's
do (its own reuse may change its text).

Workloads (``--data``): ``rag_chat``, a multi-turn RAG chat (QMSum passages in the system
message, the conversation so far, the question); ``long_prompts``, completion prompts of
1,000-3,000 tokens; ``restart``, a chat's next turn after both servers and the app were
restarted (time to the first token, streamed).

    .venv/bin/python -m benchmarks.server --data ../shared/data --out benchmarks/results/server.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from percache_core import Decoding, LlamaServer, PerCache, PerCacheConfig, ServerLaunch, TextPrompt
from percache_core.engines.llama_server.server import find_server_binary
from percache_core.engines.llama_server.server_process import wait_until_ready
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_langchain import PerCacheChatModel

from .output import write_json
from .stock import QMSUM_USER, long_prompts, model_paths, rag_chat_turns, user_rows

N_CTX = 4096
MAX_TOKENS = 40


class ServerAlone:
    """``llama-server -m MODEL -c 4096 -np 1 -t N`` with its defaults, over plain HTTP (with
    *server_defaults*, not even ``-c`` and ``-np``: its own context and 4 slots sharing one
    KV cache, as a user starts it)."""

    def __init__(
        self, model_path: Path, threads: int, extra_args: tuple[str, ...] = (), *, server_defaults: bool = False
    ) -> None:
        from percache_core.engines.llama_server.server import free_port

        self.port = free_port("127.0.0.1")
        context = () if server_defaults else ("-c", str(N_CTX), "-np", "1")
        args = [
            str(find_server_binary()), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
            *context, "-t", str(threads), "-tb", str(threads), "--no-webui", *extra_args,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until_ready(LlamaServer(url=f"http://127.0.0.1:{self.port}").http, 180)  # (stopped by close below)

    def _post(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            if not body.get("stream"):
                yield json.loads(response.read())
                return
            for line in response:
                line = line.strip()
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    yield json.loads(line[5:])
        finally:
            connection.close()

    def chat(self, messages: list[tuple[str, str]], max_tokens: int) -> str:
        body = {"messages": [{"role": r, "content": c} for r, c in messages], "max_tokens": max_tokens, "temperature": 0}
        return next(self._post("/v1/chat/completions", body))["choices"][0]["message"]["content"] or ""

    def chat_first_token_s(self, messages: list[tuple[str, str]], max_tokens: int) -> tuple[str, float]:
        """(the reply, seconds to its first piece), streamed."""
        body = {
            "messages": [{"role": r, "content": c} for r, c in messages],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
        }
        started, first, text = time.perf_counter(), None, ""
        for event in self._post("/v1/chat/completions", body):
            piece = (event.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - started
            text += piece
        return text, first if first is not None else time.perf_counter() - started

    def create_completion(
        self, prompt: str, *, max_tokens: int, temperature: float, stop: list[str], stream: bool = True
    ) -> Iterator[dict[str, Any]]:
        """``/completion`` streamed, in ``llama_cpp.Llama.create_completion``'s chunk shape
        (what ``benchmarks.e2e_harness`` calls stock with)."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": temperature, "stop": stop, "stream": True}
        for event in self._post("/completion", body):
            yield {"choices": [{"text": event.get("content") or ""}]}

    def complete(self, prompt: str, max_tokens: int, stop: list[str]) -> str:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stop": stop}
        return str(next(self._post("/completion", body))["content"])

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def lc_messages(messages: list[tuple[str, str]]) -> list[BaseMessage]:
    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    return [kinds[role](content) for role, content in messages]


def timed(call: Callable[[], str]) -> tuple[str, float]:
    started = time.perf_counter()
    text = call()
    return text, time.perf_counter() - started


Step = tuple[Callable[[], str], Callable[[], str], Callable[[], str]]


def side_by_side(name: str, steps: list[Step], *, first: int = 0) -> dict[str, Any]:
    """Each step: (the server alone, PerCache, the fresh reference); alone first on even
    steps (counted from *first*), PerCache first on odd ones; the reference after both
    (not timed)."""
    alone_runs, ours_runs, same, alone_same = [], [], 0, 0
    for index, (alone, ours, fresh) in enumerate(steps, start=first):
        if index % 2 == 0:
            a, o = timed(alone), timed(ours)
        else:
            o, a = timed(ours), timed(alone)
        reference = fresh()
        alone_runs.append(a[1])
        ours_runs.append(o[1])
        same += o[0] == reference
        alone_same += a[0] == reference
    row = {
        "workload": name,
        "prompts": len(steps),
        "server_alone_s": round(sum(alone_runs), 3),
        "percache_s": round(sum(ours_runs), 3),
        "ratio": round(sum(ours_runs) / sum(alone_runs), 4),
        "percache_identical_to_fresh": same,
        "server_alone_identical_to_fresh": alone_same,
    }
    print(f"  {name:28s} PerCache {row['percache_s']:7.2f} s  alone {row['server_alone_s']:7.2f} s  "
          f"ratio {row['ratio']}  PerCache = fresh {same}/{len(steps)}  alone = fresh {alone_same}/{len(steps)}", flush=True)
    return row


def fresh_chat(server: LlamaServer, messages: list[tuple[str, str]], max_tokens: int) -> str:
    tokens = server.tokenize(server.stock_chat(messages).text, True, special=True)
    return "".join(server.complete(tokens, Decoding(max_tokens), cache_prompt=False))


def bench(model_path: Path, data: Path, *, turns: int, long_count: int, restarts: int, threads: int) -> list[dict[str, Any]]:
    chunks, questions = user_rows(data, "qmsum", QMSUM_USER)
    sessions = rag_chat_turns(chunks, questions, turns)
    prompts = long_prompts(chunks, questions, long_count)
    embedder = BertEmbedder()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"
        config = PerCacheConfig(max_new_tokens=MAX_TOKENS, n_ctx=N_CTX, prediction=False)
        alone = ServerAlone(model_path, threads)
        server = LlamaServer.start(model_path, ServerLaunch(n_ctx=N_CTX, n_threads=threads))
        pc = PerCache.open(cache, config=config, engine=server, embedder=embedder)
        pc.preload()  # the server's cut rule: measured once per build and model, kept on disk
        chat = PerCacheChatModel(percache=pc, max_new_tokens=MAX_TOKENS, cache=False)
        history: list[tuple[str, str]] = []

        def turn(index: int) -> list[tuple[str, str]]:
            return sessions[index][:1] + history + sessions[index][1:]

        turns_rows = []
        for index in range(len(sessions)):  # one turn at a time: the next turn needs its answer
            messages = turn(index)
            step: Step = (
                lambda m=messages: alone.chat(m, MAX_TOKENS),
                lambda m=messages: str(chat.invoke(lc_messages(m)).content),
                lambda m=messages: fresh_chat(server, m, MAX_TOKENS),
            )
            turns_rows.append(side_by_side(f"rag_chat turn {index + 1}", [step], first=index))
            history.extend([sessions[index][1], ("assistant", fresh_chat(server, messages, MAX_TOKENS))])
        alone_s = sum(r["server_alone_s"] for r in turns_rows)
        ours_s = sum(r["percache_s"] for r in turns_rows)
        rows.append({
            "workload": "rag_chat (LangChain chat model, all turns)",
            "prompts": len(turns_rows),
            "server_alone_s": round(alone_s, 3),
            "percache_s": round(ours_s, 3),
            "ratio": round(ours_s / alone_s, 4),
            "percache_identical_to_fresh": sum(r["percache_identical_to_fresh"] for r in turns_rows),
            "server_alone_identical_to_fresh": sum(r["server_alone_identical_to_fresh"] for r in turns_rows),
            "turns": turns_rows,
        })

        stop = ["Question:"]
        runner = internals(pc).runtime.runner

        def fresh_completion(prompt: str) -> str:
            tokens = runner.lay_out("", [], spec=TextPrompt(prompt), max_new_tokens=32).tokens
            return "".join(server.complete(tokens, Decoding(32, stop=stop), cache_prompt=False))

        steps = [
            (
                lambda p=p: alone.complete(p, 32, stop),
                lambda p=p: pc.caller.complete(p, decoding=Decoding(max_new_tokens=32, stop=stop)).text,  # type: ignore[union-attr]
                lambda p=p: fresh_completion(p),
            )
            for p in prompts
        ]
        rows.append(side_by_side("long_prompts (first asks)", steps))
        pc.close()
        server.close()
        alone.close()

        rows.append(bench_restart(model_path, sessions, cache, config, embedder, threads, restarts))
    return rows


def streamed_first_token_s(chat: PerCacheChatModel, messages: list[tuple[str, str]]) -> tuple[str, float]:
    """(the reply, seconds to its first piece) of *chat* streamed."""
    started, first, text = time.perf_counter(), None, ""
    for piece in chat.stream(lc_messages(messages)):
        if piece.content and first is None:
            first = time.perf_counter() - started
        text += str(piece.content)
    return text, first if first is not None else time.perf_counter() - started


def bench_restart(
    model_path: Path,
    sessions: list[list[tuple[str, str]]],
    cache: Path,
    config: PerCacheConfig,
    embedder: Any,
    threads: int,
    restarts: int,
) -> dict[str, Any]:
    """A chat of two turns, then both servers and the app restarted, then the next turn
    (the last turn, its answer and a new question): time to its first token, streamed."""
    alone_s, ours_s, same = [], [], 0
    for index in range(restarts):
        system, question = sessions[index * 2]
        messages = [system, question]
        # before the restart: one turn on both sides
        alone = ServerAlone(model_path, threads)
        server = LlamaServer.start(model_path, ServerLaunch(n_ctx=N_CTX, n_threads=threads))
        pc = PerCache.open(cache, config=config, engine=server, embedder=embedder)
        chat = PerCacheChatModel(percache=pc, max_new_tokens=MAX_TOKENS, cache=False)
        answer = str(chat.invoke(lc_messages(messages)).content)
        alone.chat(messages, MAX_TOKENS)
        pc.close(), server.close(), alone.close()
        messages = [*messages, ("assistant", answer), sessions[index * 2 + 1][1]]
        # after the restart of both servers and the app: the next turn
        alone = ServerAlone(model_path, threads)
        server = LlamaServer.start(model_path, ServerLaunch(n_ctx=N_CTX, n_threads=threads))
        pc = PerCache.open(cache, config=config, engine=server, embedder=embedder)
        chat = PerCacheChatModel(percache=pc, max_new_tokens=MAX_TOKENS, cache=False)

        if index % 2 == 0:
            a, o = alone.chat_first_token_s(messages, MAX_TOKENS), streamed_first_token_s(chat, messages)
        else:
            o, a = streamed_first_token_s(chat, messages), alone.chat_first_token_s(messages, MAX_TOKENS)
        alone_s.append(a[1])
        ours_s.append(o[1])
        same += o[0] == fresh_chat(server, messages, MAX_TOKENS)
        pc.close(), server.close(), alone.close()
    row = {
        "workload": "restart: next turn, time to first token",
        "prompts": restarts,
        "server_alone_ttft_s": [round(s, 3) for s in alone_s],
        "percache_ttft_s": [round(s, 3) for s in ours_s],
        "ratio": round(sum(ours_s) / sum(alone_s), 4),
        "percache_identical_to_fresh": same,
    }
    print(f"  restart TTFT: PerCache {row['percache_ttft_s']} alone {row['server_alone_ttft_s']} ratio {row['ratio']} "
          f"identical {same}/{restarts}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/server.json"))
    parser.add_argument("--models", default="bundled", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--long", type=int, default=6)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "models": {}}
    for path in model_paths(args.models):
        print(f"model {path.name}", flush=True)
        results["models"][path.name] = bench(
            path, args.data, turns=args.turns, long_count=args.long, restarts=args.restarts, threads=args.threads
        )
    write_json(results, args.out)


if __name__ == "__main__":
    main()
