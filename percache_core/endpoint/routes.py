"""The endpoint's web application: :func:`create_app` serves the routes of
:class:`~percache_core.endpoint.app.Endpoint` (a llama-server upstream) or of
:class:`~percache_core.endpoint.plain.PlainEndpoint` (any other OpenAI-compatible one)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import Route

from ..engines.llama_server.server import LlamaServer
from ..pipeline import PerCache
from .app import PASSED_METHODS, Endpoint, EndpointSettings, error_response
from .plain import PlainEndpoint
from .protocol import APIError
from .upstream import PlainUpstream


def create_app(
    pc: PerCache, server: LlamaServer | PlainUpstream, settings: EndpointSettings = EndpointSettings()
) -> Starlette:
    """The endpoint's application over *pc*: opened with *server* as its engine where it is
    a llama-server; over a :class:`PlainUpstream`, *pc* only keeps its stored replies.

    >>> app = create_app(PerCache.open("cache", engine=server), server)   # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8080)                     # doctest: +SKIP
    """
    pc.caller.serves_app()  # its clients bring their own prompts
    if isinstance(server, PlainUpstream):
        endpoint: Endpoint = PlainEndpoint(pc, server, settings)
    else:
        endpoint = Endpoint(pc, server, settings)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", endpoint.chat, methods=["POST"]),
            Route("/v1/completions", endpoint.text, methods=["POST"]),
            Route("/v1/models", endpoint.models, methods=["GET"]),
            Route("/v1/percache/documents", endpoint.add_documents, methods=["POST"]),
            Route("/v1/percache/documents/{doc_id:path}", endpoint.delete_document, methods=["DELETE"]),
            Route("/v1/percache/stats", endpoint.stats, methods=["GET"]),
            Route("/{path:path}", endpoint.other, methods=PASSED_METHODS),
        ],
        exception_handlers={APIError: error_response, Exception: error_response},  # type: ignore[dict-item]
    )
