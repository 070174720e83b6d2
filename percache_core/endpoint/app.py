"""The endpoint's web application: OpenAI's routes over a :class:`~percache_core.PerCache`
whose engine is a :class:`~percache_core.engines.llama_server.server.LlamaServer`.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: a request the cache can bind
  runs through ``pc.caller.relay`` (stored answer, or chunk states restored and the request
  relayed to the server's own endpoint); any other passes through to the server uncached.
  Both stream as server-sent events when asked. ``usage.prompt_tokens_details.cached_tokens``
  counts the prompt tokens not prefilled; the ``X-PerCache-Source`` header (replies with
  ``stream`` off) and the ``percache`` field of the reply or of its last chunk say where the
  answer came from (``prompt_answer``, ``chunk_states``, ``full`` or ``passthrough``).
- ``GET /v1/models``: the server's model list.
- ``POST /v1/percache/documents``, ``DELETE /v1/percache/documents/{id}``: the cache's
  documents (their passages' states are kept where a prompt quotes them);
  ``GET /v1/percache/stats``: ``pc.stats()``.
- every other route (``/health``, ``/props``, ``/tokenize``, ``/v1/embeddings``,
  ``/metrics``, ...): passed through to the server with its method, query and body, the
  server's status, headers and body streamed back (the API key checked as on the cached
  routes; a request that sends a body holds the server, as a completion does).

Starlette and uvicorn serve it: HTTP parsing, keep-alive, streaming and client disconnects
are theirs (well-kept, and what the Python model servers use); the model work runs in
worker threads, one request on the server at a time, in the order the lock grants.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engines.llama_server.server import LlamaServer, ServerError, ServerUnreachable
from ..errors import ContextOverflowError, PerCacheError
from ..pipeline import PerCache
from ..serving.state_runner import RelayedRequest
from ..serving.streaming import AnswerStream, BackgroundStream
from ..types import Answer
from .protocol import (
    DONE,
    PATHS,
    APIError,
    Kind,
    ServerDefaults,
    json_object,
    last_user_text,
    message_texts,
    pass_reason,
    read_request,
    sse,
    stored_chunks,
    whole_reply,
)

logger = logging.getLogger(__name__)

SOURCE_HEADER = "X-PerCache-Source"
_END = object()
PASSED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}  # set per hop


@dataclass(frozen=True)
class EndpointSettings:
    """How the endpoint serves: *api_key* (None: no key asked; ``percache serve`` asks for one
    on any address but loopback), *max_request_bytes* (larger bodies get 413)."""

    api_key: str | None = None
    max_request_bytes: int = 8 * 1024 * 1024


async def error_response(request: Request, error: Exception) -> Response:
    """An OpenAI error body: the request's fault as raised, anything else a server error."""
    if not isinstance(error, APIError):
        logger.exception("the endpoint failed on %s", request.url.path, exc_info=error)
        error = APIError(500, f"PerCache failed: {type(error).__name__}: {error}", type="server_error")
    return JSONResponse(error.body(), status_code=error.status)


@dataclass(frozen=True)
class Forward:
    """A request sent to the server as it is: whether it *hold*s the server meanwhile."""

    method: str
    url: str
    content: bytes
    headers: dict[str, str]
    hold: bool = True


class Endpoint:
    """The routes over *pc* on a llama-server (see the module docstring); :func:`~percache_core.endpoint.routes.create_app`
    serves them."""

    holds_engine = True  # a passed-through request with a body holds the server (no PerCache run meanwhile)

    def __init__(self, pc: PerCache, server: LlamaServer, settings: EndpointSettings) -> None:
        self.pc, self.server, self.settings = pc, server, settings
        self.defaults = ServerDefaults.from_props(server.props)
        self._models: dict[str, Any] | None = None

    # -- the routes ---------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def text(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(await run_in_threadpool(self._model_list))

    async def other(self, request: Request) -> Response:
        """Any route PerCache does not serve itself, passed through to the server."""
        self._authorize(request)
        raw = await self._body(request)
        url = self.server.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        return await self._relay_reply(Forward(request.method, url, raw, headers, hold=bool(raw)), {})

    async def add_documents(self, request: Request) -> Response:
        self._authorize(request)
        body = json_object(await self._body(request))
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise APIError(400, "'documents' must be a non-empty list", param="documents")
        try:
            chunks = await run_in_threadpool(self.pc.add_documents, documents)
        except (TypeError, ValueError, PerCacheError) as error:
            raise APIError(400, str(error), param="documents") from None
        return JSONResponse({"chunks": len(chunks)})

    async def delete_document(self, request: Request) -> Response:
        self._authorize(request)
        removed = await run_in_threadpool(self.pc.delete_documents, [request.path_params["doc_id"]])
        return JSONResponse({"chunks_removed": removed})

    async def stats(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(await run_in_threadpool(self.pc.stats))

    # -- completions --------------------------------------------------------------------------

    async def _complete(self, request: Request, kind: Kind) -> Response:
        self._authorize(request)
        raw = await self._body(request)
        models = await run_in_threadpool(self._model_names)
        body = read_request(raw, kind, models if self._model_count() > 1 else None)
        model = str(body.get("model") or models[0])
        reason = pass_reason(body, kind, self.defaults)
        if reason is not None:
            return await self._pass_through(kind, body, reason)
        relay = RelayedRequest(PATHS[kind], body)  # (the relay sets how it streams)
        laid_out = await run_in_threadpool(self._prompt, kind, body)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream"):
            return StreamingResponse(
                self._stream(kind, relay, laid_out, model, wants_usage),
                media_type="text/event-stream",
            )
        prompt, documents, question = laid_out
        try:
            answer = await run_in_threadpool(self.pc.caller.relay, relay, prompt, documents=documents, question=question)
        except (ServerError, ContextOverflowError) as error:
            raise _server_fault(error) from None
        assert isinstance(answer, Answer)
        whole = relay.reply.whole  # the server's own reply, where the server ran it (asked whole)
        reply = dict(whole) if whole is not None else whole_reply(
            kind, answer.text, relay.reply.finish_reason, model, relay.reply.usage, relay.chunks
        )
        reply["percache"] = _about(answer)
        # the request's states are stored once the reply is sent (the slot saved, off its time)
        stored = BackgroundTask(self.pc.caller.finish_relay)
        return JSONResponse(reply, headers={SOURCE_HEADER: answer.source}, background=stored)

    def _prompt(self, kind: Kind, body: dict[str, Any]) -> tuple[str, list[str], str | None]:
        """The prompt the server lays out for *body*, the texts after which states are
        kept (the messages, and the cache's own passages that the prompt quotes), and the
        question it asks (a chat's last user message)."""
        try:
            prompt = self.server.apply_template(body) if kind == "chat" else str(body["prompt"])
        except ServerUnreachable as error:
            raise _server_fault(error) from None
        except ServerError as error:
            raise APIError(400, f"the server cannot lay out this request: {error}") from None
        if not prompt:
            raise APIError(400, "the request lays out an empty prompt")
        documents = message_texts(body) if kind == "chat" else []
        if self.pc.chunk_count:  # the cache's documents that the prompt quotes
            documents = self.pc.caller.quoted_passages(prompt) + documents
        return prompt, documents, last_user_text(body) if kind == "chat" else None

    async def _stream(
        self, kind: Kind, relay: RelayedRequest, laid_out: tuple[str, list[str], str | None], model: str, wants_usage: bool
    ) -> AsyncIterator[bytes]:
        """The reply's events: the server's chunks as they come (a stored answer's made
        here), the ``percache`` field on the last, then ``[DONE]``. A client that goes away
        stops the run: nothing of it is stored. *laid_out*: the prompt, its documents and
        its question (:meth:`_prompt`)."""
        prompt, documents, question = laid_out
        try:
            stream = await run_in_threadpool(
                self.pc.caller.relay, relay, prompt, documents=documents, stream=True, question=question
            )
        except (ServerError, ContextOverflowError) as error:
            yield sse(_server_fault(error).body())
            return
        sent = 0
        assert isinstance(stream, AnswerStream)
        try:
            try:
                async for _ in stream.pieces():  # (woken by the run's thread as each piece arrives)
                    for chunk in relay.chunks[sent:]:  # the server's, as they come, up to the last ones
                        if _is_last(chunk):
                            break
                        yield sse(chunk)
                        sent += 1
            except Exception as error:  # the reply has begun: the fault goes as an event
                yield sse(_server_fault(error).body())
                return
            answer = stream.answer  # type: ignore[union-attr]
            tail = relay.chunks[sent:] if relay.chunks else stored_chunks(
                kind, answer.text, relay.reply.finish_reason, model, relay.reply.usage if wants_usage else None
            )
            tail = [chunk for chunk in tail if chunk.get("choices") or wants_usage]
            for index, chunk in enumerate(tail):
                yield sse({**chunk, "percache": _about(answer)} if index == len(tail) - 1 else chunk)
            yield DONE
            await run_in_threadpool(self.pc.caller.finish_relay)  # its states, after the reply
        finally:
            stream.close()

    # -- passing through ---------------------------------------------------------------------

    async def _pass_through(self, kind: Kind, body: dict[str, Any], reason: str) -> Response:
        """Send *body* to the server as it is (its reply unchanged, ``X-PerCache-Source:
        passthrough`` and ``X-PerCache-Reason`` added), holding the server meanwhile."""
        forward = Forward("POST", self.server.url + PATHS[kind], json.dumps(body).encode(), {"Content-Type": "application/json"})
        return await self._relay_reply(forward, {SOURCE_HEADER: "passthrough", "X-PerCache-Reason": reason})

    async def _relay_reply(self, forward: Forward, about: dict[str, str], replies: Iterator[Any] | None = None) -> Response:
        """The server's reply to *forward* (as *replies* gives it: default :meth:`_forward`),
        streamed back with its status and headers (and *about*'s)."""
        stream = BackgroundStream(replies if replies is not None else self._forward(forward))
        pieces = iter(stream)
        head = await run_in_threadpool(next, pieces, _END)
        if not isinstance(head, tuple):
            stream.close()
            raise APIError(502, "the upstream server did not answer", type="upstream_error")
        status, headers = head

        async def rest() -> AsyncIterator[bytes]:
            try:
                while (piece := await run_in_threadpool(next, pieces, _END)) is not _END:
                    yield piece
            finally:
                stream.close()

        kept = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(rest(), status_code=status, headers={**kept, **about})

    def _forward(self, forward: Forward) -> Iterator[Any]:
        """The server's reply to *forward*: (status, headers), then its bytes; where
        ``forward.hold`` the server is held (no PerCache run on it meanwhile) until the
        reply ends."""
        headers = dict(forward.headers)
        if self.server.api_key:
            headers["Authorization"] = f"Bearer {self.server.api_key}"
        held = self.pc.caller.lend_engine() if forward.hold and self.holds_engine else nullcontext()
        with held, httpx.Client(timeout=None) as client:
            try:
                content = forward.content or None
                with client.stream(forward.method, forward.url, content=content, headers=headers) as reply:
                    yield reply.status_code, dict(reply.headers)
                    yield from reply.iter_raw()
            except httpx.HTTPError as error:
                logger.warning("a passed-through request failed: %s", error)

    # -- helpers ------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request is larger than {limit} bytes")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise APIError(413, f"the request is larger than {limit} bytes")
        return raw

    def _model_list(self) -> dict[str, Any]:
        if self._models is None:
            try:
                self._models = self.server.models()
            except ServerError as error:
                raise _server_fault(error) from None
        return self._models

    def _model_count(self) -> int:
        """How many models the upstream serves (one: it ignores a request's model name)."""
        return len(self._model_list().get("data", []))

    def _model_names(self) -> list[str]:
        names = [str(m.get("id")) for m in self._model_list().get("data", []) if m.get("id")]
        return [*names, self.server.model_name] if self.server.model_name not in names else names


def _server_fault(error: Exception) -> APIError:
    """The error body of a run that failed: a prompt too long, the server, or PerCache."""
    if isinstance(error, ContextOverflowError):
        return APIError(400, str(error), code="context_length_exceeded")
    if isinstance(error, ServerError):
        return APIError(502, f"the llama-server failed: {error}", type="upstream_error")
    logger.exception("a run failed", exc_info=error)
    return APIError(500, f"PerCache failed: {type(error).__name__}: {error}", type="server_error")


def _is_last(chunk: dict[str, Any]) -> bool:
    """Whether *chunk* is one of a reply's last: its finish, or its usage."""
    choices = chunk.get("choices") or [{}]
    return not chunk.get("choices") or bool(choices[0].get("finish_reason"))


def _about(answer: Answer) -> dict[str, Any]:
    """The ``percache`` field: where the answer came from and what it reused."""
    return {
        "source": answer.source,
        "reused_tokens": answer.reused_tokens,
        "prefilled_tokens": answer.prefilled_tokens,
        "ttft_ms": round(answer.ttft_s * 1000, 1),
    }
