"""The endpoint over an upstream that is not a llama-server
(:class:`~percache_core.endpoint.upstream.PlainUpstream`: llama-cpp-python's server,
Ollama, LM Studio, vLLM). Without the upstream's tokenizer, template and slots no state
can be restored, so it keeps what it can keep exactly: a completion request that binds
(:func:`~percache_core.endpoint.protocol.pass_reason`, with the upstream's sampling
defaults unknown: a request that sets no temperature samples, so it passes) is answered
from the reply the upstream gave to the identical request before (same body apart from
``stream``: :func:`~percache_core.endpoint.stored_replies.reply_key`), marked
``prompt_answer``, with that run's usage; its first ask goes to the upstream as it is and
its finished reply is kept. Every other request passes through unchanged. The stored
replies are bound to what the upstream lists in ``/v1/models``
(:meth:`~percache_core.endpoint.upstream.PlainUpstream.identity`).

Requests with a body go to the upstream one at a time, as on a llama-server:
llama-cpp-python's server (its ``interrupt_requests``, on by default) ends a streamed
completion early, with ``[DONE]`` and no finish reason, when another request waits, so
concurrent clients would cut each other's streams short. Such a reply is never stored
(it has no finish reason), but the client would get it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..pipeline import PerCache
from ..types import QAEntry
from .app import SOURCE_HEADER, Endpoint, EndpointSettings, Forward
from .protocol import (
    DONE,
    PATHS,
    APIError,
    Kind,
    ServerDefaults,
    pass_reason,
    read_request,
    sse,
    stored_chunks,
    whole_reply,
)
from .stored_replies import ReplyRecorder, reply_key
from .upstream import PlainUpstream

UNKNOWN_DEFAULTS = ServerDefaults(temperature=1.0, seed=-1)  # OpenAI's: a request that sets none samples
ORIGIN = "endpoint"


class PlainEndpoint(Endpoint):
    """The routes over a plain upstream (see the module docstring)."""

    holds_engine = False  # PerCache runs nothing on it (requests wait for each other here instead)

    def __init__(self, pc: PerCache, upstream: PlainUpstream, settings: EndpointSettings) -> None:
        self.pc, self.server, self.settings = pc, upstream, settings
        self.defaults = UNKNOWN_DEFAULTS
        self._models: dict[str, Any] | None = None
        self.binding = upstream.identity()
        self._one_at_a_time = threading.Lock()  # see the module docstring

    async def add_documents(self, request: Request) -> Response:
        self._authorize(request)
        raise APIError(400, "documents feed chunk states, which need a llama-server upstream; "
                       "this upstream gets stored replies of identical requests only")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        self._authorize(request)
        raw = await self._body(request)
        body = read_request(raw, kind, None)  # the upstream says which model names it serves
        reason = pass_reason(body, kind, self.defaults)
        if reason is None and body.get("n", 1) != 1:
            reason = "more than one choice"
        if reason is not None:
            return await self._pass_through(kind, body, reason)
        key = reply_key(kind, body)
        entry = await run_in_threadpool(self.pc.caller.find, key, binding=self.binding)
        if entry is not None and entry.answer is not None:
            return _stored_reply(kind, body, entry, self.server.model_name)
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}  # bytes the recorder reads
        forward = Forward("POST", self.server.url + PATHS[kind], raw, headers)
        recorder = ReplyRecorder(kind, streamed=bool(body.get("stream")))
        return await self._relay_reply(forward, {SOURCE_HEADER: "full"}, self._recorded(forward, recorder, key))

    def _forward(self, forward: Forward) -> Iterator[Any]:
        """The upstream's reply to *forward*, one request with a body at a time."""
        with self._one_at_a_time if forward.hold else nullcontext():
            yield from super()._forward(forward)

    def _recorded(self, forward: Forward, recorder: ReplyRecorder, key: str) -> Iterator[Any]:
        """The upstream's reply to *forward*, read by *recorder* as it passes; a finished
        reply of one choice is stored under *key* before the client has its end (a stream's
        ``[DONE]``, a whole reply's last bytes), so the client's next identical request
        finds it. A client that goes away earlier stores nothing."""
        last: bytes | None = None  # a whole reply's latest bytes, held until it is known whole
        stored = False
        for item in self._forward(forward):
            if isinstance(item, tuple):
                recorder.status = item[0]
                yield item
                continue
            recorder.feed(item)
            if recorder.streamed:
                if recorder.complete and not stored:
                    stored = True
                    self._store(recorder, key)
                yield item
                continue
            if last is not None:
                yield last
            last = item
        recorder.finish()
        if not recorder.streamed and recorder.complete:
            self._store(recorder, key)
        if last is not None:
            yield last

    def _store(self, recorder: ReplyRecorder, key: str) -> None:
        metadata = {"origin": ORIGIN, "finish_reason": recorder.finish_reason, "usage": recorder.usage or {},
                    "model": recorder.model}
        self.pc.caller.remember(key, recorder.text, binding=self.binding, metadata=metadata)


def _stored_reply(kind: Kind, body: dict[str, Any], entry: QAEntry, default_model: str) -> Response:
    """The stored reply *entry* as the request *body* asks for it (streamed or whole)."""
    meta = entry.metadata
    text, finish, usage = entry.answer or "", str(meta.get("finish_reason") or "stop"), dict(meta.get("usage") or {})
    model = str(meta.get("model") or body.get("model") or default_model)
    about = {"source": "prompt_answer", "reused_tokens": int(usage.get("prompt_tokens", 0)), "prefilled_tokens": 0}
    if not body.get("stream"):
        reply = whole_reply(kind, text, finish, model, usage)
        return JSONResponse({**reply, "percache": about}, headers={SOURCE_HEADER: "prompt_answer"})
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunks = stored_chunks(kind, text, finish, model, usage if wants_usage else None)
    events = [sse({**c, "percache": about} if i == len(chunks) - 1 else c) for i, c in enumerate(chunks)]
    return StreamingResponse(iter([*events, DONE]), media_type="text/event-stream")
