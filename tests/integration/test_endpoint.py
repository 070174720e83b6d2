"""``percache serve`` with real OpenAI clients (the ``openai`` package, LangChain ``ChatOpenAI``,
LlamaIndex ``OpenAILike``): every reply's text is the llama-server alone's with nothing
reused (``cache_prompt: false``), streamed or not, with chunk states restored and repeats
served from stored answers; bad requests get OpenAI's error bodies; a client that goes away
mid-stream leaves nothing stored; a dead server fails requests cleanly and loses nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from percache_core import LlamaServer, PerCache, PerCacheConfig, ServerLaunch
from percache_core.endpoint import EndpointSettings
from percache_core.endpoint import serving_in_thread as serving
from percache_core.inspection import internals

pytestmark = pytest.mark.model

NOTES = (
    "Minutes of the launch planning call, 3 March. The rehearsal of the launch talk is on Thursday "
    "at 3 pm in room B12. Dana brings the projector and the clicker. Finance approved 40,000 euros "
    "for the Harbor design work, of which 6,000 are kept for user testing. The press kit is due on "
    "Friday; Omar writes the first draft and Lea reviews it before noon."
)
SYSTEM = "You answer questions about the user's notes in one short sentence."
QUESTIONS = ["When is the rehearsal?", "Who brings the projector?", "How much is kept for user testing?"]
NO_REUSE = {"cache_prompt": False}


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[LlamaServer]:
    with LlamaServer.start(model_path, ServerLaunch(n_ctx=2048)) as started:
        yield started


@pytest.fixture(scope="module")
def alone(model_path: Path) -> Iterator[openai.OpenAI]:
    """The same model on a llama-server of its own, as a user runs it without PerCache."""
    with LlamaServer.start(model_path, ServerLaunch(n_ctx=2048)) as started:
        yield openai.OpenAI(base_url=started.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory, server: LlamaServer, embedder: Any) -> Iterator[tuple[str, PerCache]]:
    pc = PerCache.open(tmp_path_factory.mktemp("endpoint"), engine=server, embedder=embedder)
    try:
        with serving(pc, server) as url:
            yield url, pc
    finally:
        pc.close()


def chat(question: str, history: list[dict[str, str]] = ()) -> list[dict[str, str]]:  # type: ignore[assignment]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": NOTES}, *history,
            {"role": "user", "content": question}]


def alone_text(alone: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int = 32) -> str:
    reply = alone.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens,
                                          extra_body=NO_REUSE)
    return reply.choices[0].message.content or ""


def streamed(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, Any]:
    pieces, last = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        last = chunk
    return "".join(pieces), last


def test_openai_client_gets_the_servers_own_text_with_states_and_stored_answers(
    endpoint: tuple[str, PerCache], server: LlamaServer, alone: openai.OpenAI
) -> None:
    url, pc = endpoint
    client = openai.OpenAI(base_url=url, api_key="none")
    model = client.models.list().data[0].id
    history: list[dict[str, str]] = []
    sources = []
    for turn, question in enumerate(QUESTIONS):
        messages = chat(question, history)
        if turn % 2:
            text, last = streamed(client, model, messages)
            usage, about = last.usage, last.percache
        else:
            reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
            text, usage, about = reply.choices[0].message.content, reply.usage, reply.percache
        assert text == alone_text(alone, messages), question
        assert usage.prompt_tokens_details.cached_tokens >= about["reused_tokens"]  # restored, or kept in the slot
        sources.append(about["source"])
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
    assert sources[0] == "full" and "chunk_states" in sources[1:]  # later turns restore the notes' state
    again, last = streamed(client, model, chat(QUESTIONS[0]))  # a repeat: no model
    assert last.percache["source"] == "prompt_answer" and again == alone_text(alone, chat(QUESTIONS[0]))
    assert last.usage.prompt_tokens_details.cached_tokens == last.usage.prompt_tokens
    prompt = f"{NOTES}\nQ: Who reviews the press kit?\nA:"
    reply = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16)
    reference = alone.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=16, extra_body=NO_REUSE)
    assert reply.choices[0].text == reference.choices[0].text
    assert internals(pc).runtime.runner.unexpected_reuse == 0


def test_the_reply_comes_before_the_slot_save_and_the_next_request_restores_its_states(
    tmp_path: Path, server: LlamaServer, embedder: Any, alone: openai.OpenAI, monkeypatch: Any
) -> None:
    pc = PerCache.open(tmp_path / "after-reply", engine=server, embedder=embedder)
    slot = internals(pc).runtime.runner.pool.slots[0]
    replied, saves = threading.Event(), []
    original = slot.save

    def save() -> bytes:  # blocks until the client has its reply (a save before the reply would time out)
        saves.append(replied.wait(5))
        return original()

    try:
        with serving(pc, server) as url:
            client = openai.OpenAI(base_url=url, api_key="none")
            ask = lambda messages: client.chat.completions.create(  # noqa: E731
                model="m", messages=messages, temperature=0, max_tokens=32
            )
            other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Buy apples and flour."}]
            ask([*other, {"role": "user", "content": "What do I buy?"}])  # (the server measured once, unwatched)
            pc.caller.finish_relay()
            monkeypatch.setattr(slot, "save", save)
            for turn, question in enumerate(QUESTIONS[:2]):
                reply = ask(chat(question))
                replied.set()
                assert reply.choices[0].message.content == alone_text(alone, chat(question))
                if turn:  # the states saved after the first reply, restored
                    assert reply.percache["source"] == "chunk_states" and reply.percache["reused_tokens"] > 0
                # asked whole, as the client asked: the server's own reply, its reuse shown in its timings
                assert reply.model_extra["timings"]["cache_n"] == reply.percache["reused_tokens"]
                pc.caller.finish_relay()  # (waits for the reply's background save)
                replied.clear()
        assert saves and all(saves)
    finally:
        pc.close()


def test_langchain_and_llamaindex_openai_clients_answer_as_against_the_server_alone(
    endpoint: tuple[str, PerCache], alone: openai.OpenAI
) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    url, _ = endpoint
    model = openai.OpenAI(base_url=url, api_key="none").models.list().data[0].id
    via_endpoint = ChatOpenAI(base_url=url, api_key="none", model=model, temperature=0, max_tokens=32)
    messages = [SystemMessage(SYSTEM), HumanMessage(NOTES), HumanMessage(QUESTIONS[1])]
    reference = alone_text(alone, chat(QUESTIONS[1]))
    assert via_endpoint.invoke(messages).content == reference
    assert "".join(str(c.content) for c in via_endpoint.stream(messages)) == reference
    llm = OpenAILike(api_base=url, api_key="none", model=model, is_chat_model=True, temperature=0, max_tokens=32)
    turns = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=NOTES),
             ChatMessage(role="user", content=QUESTIONS[2])]
    assert llm.chat(turns).message.content == alone_text(alone, chat(QUESTIONS[2]))


def test_passages_of_the_cache_documents_keep_states_where_a_prompt_quotes_them(
    tmp_path: Path, server: LlamaServer, embedder: Any, alone: openai.OpenAI
) -> None:
    pc = PerCache.open(tmp_path / "cache", engine=server, embedder=embedder)
    passages = [NOTES, NOTES.replace("launch", "spring launch").replace("Thursday", "Friday")]
    try:
        with serving(pc, server) as url:
            added = httpx.post(f"{url}/percache/documents", timeout=120,
                               json={"documents": [{"id": f"notes-{i}", "text": t} for i, t in enumerate(passages)]})
            assert added.status_code == 200 and added.json()["chunks"] == 2
            client = openai.OpenAI(base_url=url, api_key="none")
            model = client.models.list().data[0].id
            context = "Use these notes.\n\n" + "\n\n".join(passages)  # an app's retrieved passages, in one message
            asks = [[{"role": "system", "content": context}, {"role": "user", "content": q}] for q in QUESTIONS]
            replies = [client.chat.completions.create(model=model, messages=m, temperature=0, max_tokens=32)
                       for m in asks]
            for messages, reply in zip(asks, replies):
                assert reply.choices[0].message.content == alone_text(alone, messages)
            assert any(r.percache["source"] == "chunk_states" and r.percache["reused_tokens"] >= 64 for r in replies[1:])
            assert httpx.delete(f"{url}/percache/documents/notes-1").json()["chunks_removed"] == 1
            assert pc.chunk_count == 1
    finally:
        pc.close()


def test_idle_rounds_prefill_what_the_client_sends_in_its_own_shape(
    tmp_path: Path, server: LlamaServer, embedder: Any, alone: openai.OpenAI, corpus: dict[str, Any]
) -> None:
    pc = PerCache.open(tmp_path / "cache", config=PerCacheConfig(prediction=False), engine=server, embedder=embedder)
    passages = [d["text"].strip() for d in corpus["documents"][:4]]
    try:
        pc.add_documents([{"id": f"p{i}", "text": t} for i, t in enumerate(passages)], split=False)
        with serving(pc, server) as url:
            client = openai.OpenAI(base_url=url, api_key="none")
            model = client.models.list().data[0].id

            def ask(first: int, second: int, question: str) -> tuple[list[dict[str, str]], Any]:
                context = "Use these notes.\n\n" + passages[first] + "\n\n" + passages[second]
                messages = [{"role": "system", "content": context}, {"role": "user", "content": question}]
                return messages, client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)

            messages, reply = ask(0, 1, QUESTIONS[0])
            assert reply.choices[0].message.content == alone_text(alone, messages, 24)
            shape = pc.stats()["app_requests"]["shapes"][0]  # learned from the relayed request
            assert shape["relayed"] and shape["predicts"] and shape["passages"] == 2 and shape["separator"] == "\n\n"
            report = pc.warm(max_seconds=120, progress=False)
            assert report.app_states_prefilled > 0 and report.app_answers_stored == 0  # states only: replies are the server's
            messages, reply = ask(1, 2, QUESTIONS[1])  # never sent: it starts with a passage the first did not start with
            assert reply.choices[0].message.content == alone_text(alone, messages, 24)
            # (restored, or kept in the slot from the round's last prefill: without the round,
            # only the template's first tokens match, too few for a cut)
            assert reply.percache["reused_tokens"] >= 64
    finally:
        pc.close()


def test_requests_it_cannot_bind_pass_through_and_bad_ones_get_openai_errors(
    endpoint: tuple[str, PerCache], server: LlamaServer, tmp_path: Path
) -> None:
    url, pc = endpoint
    model = openai.OpenAI(base_url=url, api_key="none").models.list().data[0].id
    sampled = httpx.post(f"{url}/chat/completions", json={"model": model, "messages": chat("Hi"), "max_tokens": 4},
                         timeout=120)  # the server's default sampling: random
    assert sampled.status_code == 200 and sampled.headers["x-percache-source"] == "passthrough"
    assert "random" in sampled.headers["x-percache-reason"] and sampled.json()["choices"][0]["message"]["role"]
    faults = {
        b"{": 400,
        b'{"messages": []}': 400,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}': 400,
    }
    for body, status in faults.items():
        reply = httpx.post(f"{url}/chat/completions", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == status and reply.json()["error"]["message"], body
    # a model name the server does not list: the server alone serves it (one model), so does the endpoint
    request = {"model": "gpt-3.5-turbo", "messages": chat("Who pays for the van?"), "temperature": 0, "max_tokens": 16}
    named = openai.OpenAI(base_url=url, api_key="none").chat.completions.create(**request)
    by_server = openai.OpenAI(base_url=server.url + "/v1", api_key="none").chat.completions.create(
        **request, extra_body=NO_REUSE
    )
    assert named.choices[0].message.content == by_server.choices[0].message.content
    assert named.model == by_server.model
    too_long = {"messages": [{"role": "user", "content": "word " * 3000}], "temperature": 0}
    reply = httpx.post(f"{url}/chat/completions", json=too_long, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    with serving(pc, server, EndpointSettings(api_key="sesame", max_request_bytes=2000)) as guarded:
        assert httpx.get(f"{guarded}/models").status_code == 401
        assert httpx.get(f"{guarded}/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        big = httpx.post(f"{guarded}/completions", json={"prompt": "x" * 5000}, headers={"Authorization": "Bearer sesame"})
        assert big.status_code == 413 and big.json()["error"]["message"]


def test_a_client_gone_mid_stream_leaves_nothing_stored(endpoint: tuple[str, PerCache], alone: openai.OpenAI) -> None:
    url, pc = endpoint
    client = openai.OpenAI(base_url=url, api_key="none")
    model = client.models.list().data[0].id
    messages = chat("List every person named in the notes, one per line, with what each of them does.")
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=64, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the client goes away after its first piece
    leases = internals(pc).runtime.runner.pool.leases
    deadline = time.monotonic() + 30
    while leases.leased and time.monotonic() < deadline:  # its run ends at its next piece (a request
        time.sleep(0.01)                                   # sent before shares its batches: the server's text)
    assert not leases.leased
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=64)
    assert reply.percache["source"] != "prompt_answer"  # the cut-off run stored no answer
    assert reply.choices[0].message.content == alone_text(alone, messages, max_tokens=64)


def test_concurrent_clients_run_at_once_and_nothing_batched_is_served_later(
    endpoint: tuple[str, PerCache], alone: openai.OpenAI
) -> None:
    """Clients at once run in the server's slots together (a batched request gets the
    server's text under that batching); asked again one at a time, every request gets the
    server's fresh text: nothing computed under batching was stored."""
    url, pc = endpoint
    model = openai.OpenAI(base_url=url, api_key="none").models.list().data[0].id
    asks = [chat(f"{QUESTIONS[c % 3]} (client {c})") for c in range(4)]

    def ask(messages: list[dict[str, str]]) -> str:
        client = openai.OpenAI(base_url=url, api_key="none")
        if len(messages[-1]["content"]) % 2:
            return streamed(client, model, messages)[0]
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(max_workers=4) as clients:
        texts = list(clients.map(ask, asks))
    assert all(texts) and internals(pc).runtime.runner.batched_runs >= 1
    assert [ask(messages) for messages in asks] == [alone_text(alone, messages) for messages in asks]


def test_a_dead_upstream_gets_clean_502s_loses_nothing_and_once_back_serves_its_states(
    tmp_path: Path, model_path: Path, embedder: Any, alone: openai.OpenAI
) -> None:
    """The endpoint stays up while its llama-server is down (a crash, a restart, an
    update): requests fail cleanly with 502s that name the server, and nothing stored is
    lost. Once the server is back on the same address, build, model and slot folder, the
    states stored before restore into it and the replies are the fresh text; the cache
    opened again serves its stored answers."""
    from percache_core.engines.llama_server.server import free_port

    slots = tmp_path / "slots"
    launch = ServerLaunch(n_ctx=2048, slot_save_path=slots, port=free_port("127.0.0.1"))
    upstream = LlamaServer.start(model_path, launch)
    attached = LlamaServer(upstream.url, slot_save_path=slots)

    def asker(url: str) -> Any:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        return lambda messages: client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=32)

    try:
        with PerCache.open(tmp_path / "cache", engine=attached, embedder=embedder) as pc, serving(pc, attached) as url:
            ask = asker(url)
            first = ask(chat(QUESTIONS[0]))
            deadline = time.monotonic() + 30  # its states are saved once the reply is sent
            while not pc.stats()["chunk_states"]["nodes"] and time.monotonic() < deadline:
                time.sleep(0.2)
            upstream.close()  # the llama-server dies
            for question in QUESTIONS[:2]:  # a stored answer too: nothing is served unbound
                with pytest.raises(openai.APIStatusError) as failed:
                    ask(chat(question))
                assert failed.value.status_code == 502 and "llama-server" in str(failed.value)
            upstream = LlamaServer.start(model_path, launch)  # back where it was
            after = ask(chat(QUESTIONS[1]))
            assert after.percache["source"] == "chunk_states" and after.percache["reused_tokens"] >= 64
            assert after.choices[0].message.content == alone_text(alone, chat(QUESTIONS[1]))
            assert first.choices[0].message.content == alone_text(alone, chat(QUESTIONS[0]))
        with PerCache.open(tmp_path / "cache", engine=attached, embedder=embedder) as pc, serving(pc, attached) as url:
            repeat = asker(url)(chat(QUESTIONS[0]))  # a new process's cache: what was stored is there
        assert repeat.percache["source"] == "prompt_answer"
        assert repeat.choices[0].message.content == first.choices[0].message.content
    finally:
        upstream.close()


def test_the_percache_serve_command_serves_and_stops_with_its_server(
    tmp_path: Path, model_path: Path, alone: openai.OpenAI
) -> None:
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "percache_core.cli", "serve", "--model", str(model_path),
               "--cache", str(tmp_path / "cache"), "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for _ in range(600):
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert process.poll() is None, process.stdout.read() if process.stdout else ""
                time.sleep(0.2)
        reply = client.chat.completions.create(model=model, messages=chat(QUESTIONS[0]), temperature=0, max_tokens=32)
        assert reply.choices[0].message.content == alone_text(alone, chat(QUESTIONS[0]))
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C: the cache closed, the started server stopped
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert f"http://127.0.0.1:{port}/v1" in output


def test_every_other_route_of_the_server_answers_through_the_endpoint_as_alone(
    endpoint: tuple[str, PerCache], server: LlamaServer
) -> None:
    url, _ = endpoint
    root = url.removesuffix("/v1")
    messages = [{"role": "user", "content": "Hi"}]
    routes = [
        ("GET", "/health", None),
        ("GET", "/props", None),
        ("GET", "/slots", None),
        ("GET", "/metrics", None),  # not enabled on this server: its own error, the same way
        ("POST", "/tokenize", {"content": "The van leaves at 3 pm."}),
        ("POST", "/detokenize", {"tokens": [1, 651, 4287]}),
        ("POST", "/apply-template", {"messages": messages}),
        ("POST", "/v1/embeddings", {"input": "hi"}),
        ("POST", "/completion", {"prompt": "The van leaves at", "n_predict": 4, "temperature": 0, "cache_prompt": False}),
        ("GET", "/no-such-route", None),
    ]
    for method, path, body in routes:
        mine = httpx.request(method, root + path, json=body, timeout=120)
        alone = httpx.request(method, server.url + path, json=body, timeout=120)
        assert mine.status_code == alone.status_code, path
        assert mine.headers.get("content-type") == alone.headers.get("content-type"), path
        if path == "/completion":  # timings differ run to run
            assert mine.json()["content"] == alone.json()["content"], path
        elif path == "/slots":  # what each slot last ran differs
            assert [s["id"] for s in mine.json()] == [s["id"] for s in alone.json()], path
        else:
            assert mine.content == alone.content, path
    with serving(endpoint[1], server, EndpointSettings(api_key="sesame")) as guarded:
        assert httpx.get(guarded.removesuffix("/v1") + "/health").status_code == 401
        ready = httpx.get(guarded.removesuffix("/v1") + "/health", headers={"Authorization": "Bearer sesame"})
        assert ready.status_code == 200 and ready.json() == httpx.get(server.url + "/health").json()
