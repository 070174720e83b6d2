"""Running the endpoint: :func:`serve` (``percache serve``) opens the server and the cache,
then serves with uvicorn until stopped (Ctrl-C), and closes the cache and a started server;
:func:`serving_in_thread` serves an open cache from a thread of this process (tests,
benchmarks, an app that hosts the endpoint itself)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..config import PerCacheConfig
from ..engines.llama_server.server import LlamaServer, ServerLaunch, free_port
from ..errors import PerCacheError
from ..pipeline import PerCache
from .app import EndpointSettings
from .documents import WatchedDocuments
from .routes import create_app
from .upstream import PlainUpstream, detect_upstream

API_KEY_ENV = "PERCACHE_API_KEY"
SHARED_SECRET_ENV = "PERCACHE_SHARED_SECRET"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def open_server(
    upstream: str | None, model: str | None, slot_save_path: str | None, *, wait_upstream_s: float = 0.0,
    slots: int | None = None, batch_invariant: bool = False,
) -> LlamaServer | PlainUpstream:
    """The server to serve over: the one at *upstream*, a llama-server (its
    ``--slot-save-path`` folder as *slot_save_path*, else stored answers only) or another
    OpenAI-compatible server (:func:`~percache_core.endpoint.upstream.detect_upstream`:
    stored replies only), waited for up to *wait_upstream_s* seconds (one started at the same
    time is still loading); or a llama-server started on the GGUF *model* (neither given: the
    bundled model, as ``percache ask`` loads it) with *slots* slots (None: llama-server's 4),
    *batch_invariant* as :class:`~percache_core.engines.llama_server.server_process.ServerLaunch` says.

    Raises:
        PerCacheError: both *upstream* and *model*; nothing OpenAI-compatible at *upstream*
            within the wait.
    """
    if upstream is not None and model is not None:
        raise PerCacheError("give either --upstream URL (a running server) or --model GGUF, not both")
    if upstream is not None:
        key = os.environ.get("LLAMA_API_KEY")

        def waiting() -> None:
            print(f"percache serve: waiting up to {wait_upstream_s:g} s for the upstream at {upstream}", flush=True)

        if detect_upstream(upstream, key, wait_s=wait_upstream_s, waiting=waiting) == "openai":
            return PlainUpstream(upstream, key)
        return LlamaServer(upstream, slot_save_path=slot_save_path, api_key=key)
    if model is None:
        print("percache serve: starting a llama-server on the bundled model (give --upstream or --model for another)")
    return LlamaServer.start(model, ServerLaunch(slot_save_path=slot_save_path, n_slots=slots, batch_invariant=batch_invariant))


def checked_api_key(host: str, api_key: str | None) -> str | None:
    """The key clients must give: *api_key*, else ``$PERCACHE_API_KEY``; required on any
    address but loopback.

    >>> checked_api_key("127.0.0.1", None) is None
    True
    >>> checked_api_key("0.0.0.0", None)
    Traceback (most recent call last):
    ...
    percache_core.errors.PerCacheError: serving on 0.0.0.0 needs --api-key (or $PERCACHE_API_KEY)
    """
    key = api_key or os.environ.get(API_KEY_ENV) or None
    if key is None and host not in LOOPBACK:
        raise PerCacheError(f"serving on {host} needs --api-key (or ${API_KEY_ENV})")
    return key


@dataclass(frozen=True)
class BetweenRequests:
    """What ``percache serve`` does besides answering: *documents* (folders or globs of
    ``.txt``, ``.md``, ``.jsonl`` files) ingested at start and watched while serving
    (:class:`~percache_core.endpoint.documents.WatchedDocuments`), and *idle* prediction
    between requests."""

    idle: bool = False
    documents: tuple[str, ...] = ()


def serve(
    cache: str | Path,
    server: LlamaServer | PlainUpstream,
    *,
    address: tuple[str, int] = ("127.0.0.1", 8080),
    settings: EndpointSettings = EndpointSettings(),
    config: PerCacheConfig | None = None,
    between: BetweenRequests = BetweenRequests(),
) -> None:
    """Serve *cache* over *server* at ``http://host:port/v1`` until interrupted.

    Args:
        cache: the cache folder.
        server: the llama-server the cache runs on (closed at the end if it was started).
        address: (host, port) to listen on.
        settings: the API key and the largest request body.
        config: the cache's settings (None: the defaults).
        between: documents to ingest and watch, and idle prediction between requests.

    >>> serve("~/.percache/me", LlamaServer("http://127.0.0.1:8081"))   # doctest: +SKIP
    """
    import uvicorn  # the serve extra; loaded only to serve

    host, port = address
    if isinstance(server, PlainUpstream):
        _serve_plain(Path(cache).expanduser(), server, address, settings, config, between)
        return
    pc = PerCache.open(Path(cache).expanduser(), config=config, engine=server)
    watched = WatchedDocuments(pc, between.documents)
    try:
        if between.documents:
            added, _ = watched.sync()
            print(f"percache serve: {added} documents from {', '.join(between.documents)} (watched)")
            watched.start()
        pc.preload()
        if between.idle:
            pc.start_worker()
        print(f"percache serve: http://{host}:{port}/v1 over {server.url} ({server.model_name}), cache {cache}")
        uvicorn.run(create_app(pc, server, settings), host=host, port=port, log_level="warning")
    finally:
        watched.stop()
        pc.close()
        if server.owns_process:
            server.close()


def _serve_plain(
    cache: Path,
    upstream: PlainUpstream,
    address: tuple[str, int],
    settings: EndpointSettings,
    config: PerCacheConfig | None,
    between: BetweenRequests,
) -> None:
    """:func:`serve` over an upstream that is not a llama-server: stored replies only."""
    import uvicorn

    if between.documents or between.idle:
        raise PerCacheError(
            f"{upstream.url} is an OpenAI-compatible server but not a llama-server: documents and idle "
            "prediction need a llama-server's tokenizer and slots (leave out --documents and --idle)"
        )
    host, port = address
    with PerCache.open(cache, config=config) as pc:  # its model never loads: nothing runs on it
        print(f"percache serve: http://{host}:{port}/v1 over {upstream.url} ({upstream.model_name}), cache {cache}")
        print("percache serve: the upstream is not a llama-server: identical requests get stored replies, "
              "everything else passes through")
        uvicorn.run(create_app(pc, upstream, settings), host=host, port=port, log_level="warning")


def shared_config(shared_url: str | None) -> PerCacheConfig | None:
    """The settings of a cache that shares the Redis tier at *shared_url* (its secret from
    ``$PERCACHE_SHARED_SECRET``), or None (defaults, local only).

    Raises:
        PerCacheError: a URL with no secret.
    """
    if shared_url is None:
        return None
    secret = os.environ.get(SHARED_SECRET_ENV)
    if not secret:
        raise PerCacheError(f"--shared-url needs ${SHARED_SECRET_ENV} (the key that signs shared entries)")
    try:
        return PerCacheConfig(shared_url=shared_url, shared_secret=secret)
    except ValueError as error:
        raise PerCacheError(str(error)) from None


@contextmanager
def serving_in_thread(
    pc: PerCache, server: LlamaServer | PlainUpstream, settings: EndpointSettings = EndpointSettings(), *, host: str = "127.0.0.1"
) -> Iterator[str]:
    """Serve *pc* over *server* on a free port of *host* from a thread until the block ends:
    the base URL (``http://host:port/v1``). The cache stays open.

    >>> with serving_in_thread(pc, server) as url:                          # doctest: +SKIP
    ...     openai.OpenAI(base_url=url, api_key="none").models.list()
    """
    import uvicorn

    port = free_port(host)
    web = uvicorn.Server(uvicorn.Config(create_app(pc, server, settings), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, name="percache-endpoint", daemon=True)
    thread.start()
    while not web.started and thread.is_alive():
        time.sleep(0.02)
    if not web.started:
        raise PerCacheError(f"the endpoint could not listen on {host}:{port}")
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        web.should_exit = True
        thread.join()
