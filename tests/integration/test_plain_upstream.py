"""``percache serve`` over an OpenAI-compatible server that is not a llama-server:
llama-cpp-python's own server (``python -m llama_cpp.server``, no slots, no ``/props``).
The endpoint says so, passes every request it cannot bind through unchanged, and answers
an identical request (apart from ``stream``) from the reply the upstream gave before, with
its text, finish and usage; the ``openai`` client, LangChain ``ChatOpenAI`` and LlamaIndex
``OpenAILike`` get the upstream alone's text, streamed and not."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from percache_core import PerCache
from percache_core.endpoint import serving_in_thread as serving
from percache_core.endpoint.upstream import PlainUpstream, detect_upstream
from percache_core.engines.llama_server.server import free_port
from percache_core.errors import PerCacheError

pytestmark = pytest.mark.model

NOTES = (
    "Minutes of the harbour festival call. The sailing race starts at 10 am from the east pier. "
    "Mira runs the ticket desk; tickets cost 12 euros, children go free. The fireworks are at 10 pm "
    "unless the wind is above 40 km/h; Jonas decides at 6 pm and posts it on the notice board."
)


@pytest.fixture(scope="module")
def upstream(model_path: Path) -> Iterator[str]:
    """llama-cpp-python's OpenAI server on the bundled model, as a user runs it."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "2048", "--n_threads", "2", "--verbose", "False"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise RuntimeError("llama_cpp.server did not start")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory, upstream: str, embedder: Any) -> Iterator[tuple[str, PerCache]]:
    pc = PerCache.open(tmp_path_factory.mktemp("plain"), embedder=embedder)
    try:
        with serving(pc, PlainUpstream(upstream)) as url:
            yield url, pc
    finally:
        pc.close()


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer from the notes in one sentence."},
            {"role": "user", "content": f"{NOTES}\n\nQuestion: {question}"}]


def ask(base_url: str, question: str, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=base_url, api_key="none")
    return client.chat.completions.with_raw_response.create(
        model="local", messages=messages(question), temperature=0, max_tokens=24, **extra
    )


def test_the_upstream_is_told_apart_from_a_llama_server(upstream: str) -> None:
    assert detect_upstream(upstream) == "openai"
    with pytest.raises(PerCacheError, match="no OpenAI-compatible server"):
        detect_upstream(f"http://127.0.0.1:{free_port('127.0.0.1')}")


def test_identical_requests_get_the_upstreams_reply_stored_and_the_rest_passes(
    endpoint: tuple[str, PerCache], upstream: str
) -> None:
    url, pc = endpoint
    alone = ask(upstream + "/v1", "When do the fireworks start?").parse()
    first = ask(url, "When do the fireworks start?")
    assert first.headers["x-percache-source"] == "full"
    assert first.parse().choices[0].message.content == alone.choices[0].message.content
    again = ask(url, "When do the fireworks start?")
    assert again.headers["x-percache-source"] == "prompt_answer"
    reply = again.parse()
    assert reply.choices[0].message.content == alone.choices[0].message.content
    assert reply.usage.completion_tokens == alone.usage.completion_tokens  # the usage of the run that stored it
    assert reply.choices[0].finish_reason == alone.choices[0].finish_reason
    # the same request streamed: the stored reply, as chunks
    client = openai.OpenAI(base_url=url, api_key="none")
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="local", messages=messages("When do the fireworks start?"), temperature=0, max_tokens=24, stream=True
    ) if c.choices]
    assert "".join(pieces) == alone.choices[0].message.content
    # a streamed first ask is stored too, and a whole repeat of it is served
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="local", messages=messages("Who runs the ticket desk?"), temperature=0, max_tokens=24, stream=True
    ) if c.choices)
    whole = ask(url, "Who runs the ticket desk?")
    assert whole.headers["x-percache-source"] == "prompt_answer" and whole.parse().choices[0].message.content == streamed
    assert streamed == ask(upstream + "/v1", "Who runs the ticket desk?").parse().choices[0].message.content
    # a request that sets no temperature samples: it passes through, and nothing is stored of it
    sampled = httpx.post(f"{url}/chat/completions", json={"messages": messages("Hi"), "max_tokens": 4}, timeout=120)
    assert sampled.status_code == 200 and sampled.headers["x-percache-source"] == "passthrough"
    documents = httpx.post(f"{url}/percache/documents", json={"documents": ["a note"]})
    assert documents.status_code == 400 and "llama-server" in documents.json()["error"]["message"]


def test_langchain_and_llamaindex_clients_get_the_upstream_alones_text(endpoint: tuple[str, PerCache], upstream: str) -> None:
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    url, _ = endpoint
    question = "How much does a ticket cost?"

    def chat(base: str) -> ChatOpenAI:  # ChatOpenAI sends max_completion_tokens, which this server ignores
        return ChatOpenAI(base_url=base, api_key="none", model="gpt-3.5-turbo", temperature=0,
                          extra_body={"max_tokens": 24})

    lc_messages = [("system", messages(question)[0]["content"]), ("human", messages(question)[1]["content"])]
    alone = chat(upstream + "/v1").invoke(lc_messages).content
    assert chat(url).invoke(lc_messages).content == alone  # a model name the upstream does not list
    assert "".join(str(c.content) for c in chat(url).stream(lc_messages)) == alone

    def like(base: str) -> OpenAILike:
        return OpenAILike(api_base=base, api_key="none", model="gpt-3.5-turbo", is_chat_model=True, temperature=0,
                          max_tokens=24)

    li_messages = [ChatMessage(role=m["role"], content=m["content"]) for m in messages("Who runs the ticket desk?")]
    li_alone = like(upstream + "/v1").chat(li_messages).message.content
    assert like(url).chat(li_messages).message.content == li_alone
    assert "".join(r.delta or "" for r in like(url).stream_chat(li_messages)) == li_alone


def test_every_route_and_model_name_answers_as_the_upstream_alone(endpoint: tuple[str, PerCache], upstream: str) -> None:
    url, _ = endpoint
    base = url.removesuffix("/v1")
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/docs", None), ("GET", "/no/such/route", None),
                               ("POST", "/v1/embeddings", {"input": "hello"}),
                               ("POST", "/extras/tokenize", {"input": "hello"})]:
        mine = httpx.request(method, base + path, json=body, timeout=120)
        theirs = httpx.request(method, upstream + path, json=body, timeout=120)
        assert mine.status_code == theirs.status_code, path
        if theirs.headers.get("content-type", "").startswith("application/json") and path != "/v1/models":
            assert mine.json() == theirs.json(), path


def test_concurrent_clients_get_the_upstream_alones_replies(endpoint: tuple[str, PerCache], upstream: str) -> None:
    url, _ = endpoint
    questions = ["Where does the race start?", "Who decides about the fireworks?", "Do children pay?"]
    alone = {q: ask(upstream + "/v1", q).parse().choices[0].message.content for q in questions}

    def client(index: int) -> list[bool]:
        return [ask(url, q).parse().choices[0].message.content == alone[q] for q in questions * 2]

    with ThreadPoolExecutor(4) as pool:
        results = [same for batch in pool.map(client, range(4)) for same in batch]
    assert len(results) == 24 and all(results)


def test_percache_serve_opens_a_plain_upstream_and_refuses_what_needs_a_llama_server(upstream: str, tmp_path: Path) -> None:
    from percache_core.endpoint.serve import BetweenRequests, open_server, serve

    server = open_server(upstream, None, None)
    assert isinstance(server, PlainUpstream) and server.model_name
    for between in (BetweenRequests(idle=True), BetweenRequests(documents=(str(tmp_path),))):
        with pytest.raises(PerCacheError, match="not a llama-server"):
            serve(tmp_path / "cache", server, between=between)
