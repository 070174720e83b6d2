"""``percache serve`` over an upstream that is not a llama-server: llama-cpp-python's own
OpenAI server (``python -m llama_cpp.server``), against the same server alone, through
LangChain ``ChatOpenAI`` (streamed, temperature 0), only the URL differing.

- ``first``: each RAG chat prompt (3 QMSum passages and a question) to both sides, the
  order alternating per prompt; the endpoint passes it through and keeps the reply;
- ``repeat``: the same prompts again to both sides (the upstream alone reuses its own
  prefix; the endpoint answers from the stored reply);
- ``load``: *clients* threads x *requests* each through the endpoint (the prompts above and
  new ones), every reply compared with the upstream alone's text for that prompt.

    PYTHONPATH=. .venv/bin/python -m benchmarks.plain_upstream --data ../shared/data
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from langchain_openai import ChatOpenAI

from percache_core import PerCache
from percache_core.endpoint.serve import serving_in_thread
from percache_core.endpoint.upstream import PlainUpstream
from percache_core.kv.llama_server import free_port
from percache_core.models import resolve_model_path

from .endpoint import Messages, side_by_side
from .output import write_json
from .server import lc_messages
from .stock import QMSUM_USER, rag_chat_turns, user_rows


@contextmanager
def llama_cpp_server(model: Path, threads: int) -> Iterator[str]:
    """llama-cpp-python's OpenAI server on *model*, as a user starts it; its base URL."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "4096", "--n_threads", str(threads), "--verbose", "False"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def client(url: str, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(base_url=url, api_key="none", model="local", temperature=0, max_tokens=max_tokens)


def load(url: str, prompts: list[Messages], reference: dict[int, str], clients: int, requests: int,
         max_tokens: int) -> dict[str, Any]:
    """*clients* x *requests* through the endpoint: errors and replies that differ from
    *reference* (the upstream alone's text per prompt index)."""
    chat = client(url, max_tokens)

    def run(index: int) -> list[str | BaseException]:
        out: list[str | BaseException] = []
        for request in range(requests):
            try:
                out.append(str(chat.invoke(lc_messages(prompts[(index + request) % len(prompts)])).content))
            except Exception as error:  # counted, not raised: the figure is how many fail
                out.append(error)
        return out

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(run, range(clients)))
    seconds = time.perf_counter() - started
    errors = sum(isinstance(r, BaseException) for batch in replies for r in batch)
    differing = sum(
        not isinstance(r, BaseException) and r != reference[(index + request) % len(prompts)]
        for index, batch in enumerate(replies) for request, r in enumerate(batch)
    )
    row = {"workload": "load", "clients": clients, "requests": clients * requests, "errors": errors,
           "differing": differing, "seconds": round(seconds, 2)}
    print(f"  load         {clients} x {requests}: {errors} errors, {differing} differing, {seconds:.1f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="the shared data folder (qmsum inside)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plain_upstream.json"))
    args = parser.parse_args()
    chunks, questions = user_rows(args.data, "qmsum", QMSUM_USER)
    prompts = [session for session in rag_chat_turns(chunks, questions, args.prompts * 2)]
    measured, extra = prompts[: args.prompts], prompts[args.prompts :]
    with llama_cpp_server(resolve_model_path(None), args.threads) as upstream, tempfile.TemporaryDirectory() as folder:
        with PerCache.open(Path(folder) / "cache") as pc, serving_in_thread(pc, PlainUpstream(upstream)) as url:
            alone = client(upstream + "/v1", args.max_tokens)
            ours = client(url, args.max_tokens)
            rows = [side_by_side("first", measured, ours, alone, alone),
                    side_by_side("repeat", measured, ours, alone, alone, first=1)]
            everything = measured + extra
            reference = {i: str(alone.invoke(lc_messages(m)).content) for i, m in enumerate(everything)}
            rows.append(load(url, everything, reference, args.clients, args.requests, args.max_tokens))
    result = {"upstream": "llama_cpp.server", "model": resolve_model_path(None).name, "rows": rows}
    print(f"wrote {write_json(result, args.out)}")


if __name__ == "__main__":
    main()
