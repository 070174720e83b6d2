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
from percache_core.engines.llama_server.server import free_port
from percache_core.models import resolve_model_path

from .endpoint import Messages, streamed
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
    """ChatOpenAI as a user points it at the server (it sends ``max_completion_tokens``,
    which llama_cpp.server ignores: the limit goes as ``max_tokens``)."""
    return ChatOpenAI(base_url=url, api_key="none", model="local", temperature=0, extra_body={"max_tokens": max_tokens})


def side_by_side(name: str, prompts: list[Messages], ours: ChatOpenAI, alone: ChatOpenAI, *, first: int = 0
                 ) -> dict[str, Any]:
    """Each prompt streamed to both sides (alone first on even prompts, counted from
    *first*), the upstream's context moved off the prompt before each (a one-token request
    on other text: llama-cpp-python reuses the longest prefix of its previous prompt, which
    would favour whichever side asks second)."""
    reset = alone.bind(extra_body={"max_tokens": 1})
    sums = {"percache_s": 0.0, "upstream_alone_s": 0.0, "percache_ttft_s": 0.0, "upstream_alone_ttft_s": 0.0}
    same = 0
    for index, messages in enumerate(prompts, start=first):
        runs = {}
        for side in (("alone", "ours") if index % 2 == 0 else ("ours", "alone")):
            reset.invoke("Reply with one word.")
            runs[side] = streamed(alone if side == "alone" else ours, messages)
        sums["percache_s"] += runs["ours"][2]
        sums["upstream_alone_s"] += runs["alone"][2]
        sums["percache_ttft_s"] += runs["ours"][1]
        sums["upstream_alone_ttft_s"] += runs["alone"][1]
        same += runs["ours"][0] == runs["alone"][0]
    row: dict[str, Any] = {"workload": name, "prompts": len(prompts), **{k: round(v, 3) for k, v in sums.items()}}
    row["ratio"] = round(sums["percache_s"] / sums["upstream_alone_s"], 4)
    row["ttft_ratio"] = round(sums["percache_ttft_s"] / sums["upstream_alone_ttft_s"], 4)
    row["identical_to_upstream_alone"] = same
    print(f"  {name:12s} PerCache {row['percache_s']:7.2f} s  alone {row['upstream_alone_s']:7.2f} s  ratio {row['ratio']}"
          f"  TTFT ratio {row['ttft_ratio']}  = alone {same}/{len(prompts)}", flush=True)
    return row


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
    differing = [
        (index + request) % len(prompts) for index, batch in enumerate(replies) for request, r in enumerate(batch)
        if not isinstance(r, BaseException) and r != reference[(index + request) % len(prompts)]
    ]
    stored = len(prompts) // 2  # the prompts asked (and so stored) before the load
    row = {"workload": "load", "clients": clients, "requests": clients * requests, "errors": errors,
           "differing": len(differing), "differing_of_stored_prompts": sum(i < stored for i in differing),
           "differing_prompts": sorted(set(differing)), "seconds": round(seconds, 2)}
    print(f"  load         {clients} x {requests}: {errors} errors, {len(differing)} differing from the upstream's "
          f"fresh reply ({row['differing_of_stored_prompts']} of prompts stored before), prompts "
          f"{row['differing_prompts']}, {seconds:.1f} s", flush=True)
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
            rows = [side_by_side("first", measured, ours, alone), side_by_side("repeat", measured, ours, alone, first=1)]
            everything = measured + extra
            reset = alone.bind(extra_body={"max_tokens": 1})
            fresh, sequential = {}, {}
            for i, m in enumerate(everything):  # each prompt from a context moved off it, then right after another
                reset.invoke("Reply with one word.")
                fresh[i] = str(alone.invoke(lc_messages(m)).content)
            for i, m in enumerate(everything):
                sequential[i] = str(alone.invoke(lc_messages(m)).content)
            row = load(url, everything, fresh, args.clients, args.requests, args.max_tokens)
            row["upstream_alone_after_another_prompt_differing"] = sum(fresh[i] != sequential[i] for i in fresh)
            print(f"  the upstream alone, each prompt right after another against from a moved context: "
                  f"{row['upstream_alone_after_another_prompt_differing']} of {len(fresh)} replies differed", flush=True)
            rows.append(row)
    result = {"upstream": "llama_cpp.server", "model": resolve_model_path(None).name, "rows": rows}
    print(f"wrote {write_json(result, args.out)}")


if __name__ == "__main__":
    main()
