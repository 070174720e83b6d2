"""The HTTP side of a llama-server: one kept-alive connection per thread, JSON requests and
server-sent event streams, and the errors a server gives (:class:`ServerError`,
:class:`ServerUnreachable`).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

from ...errors import PerCacheError


class ServerError(PerCacheError):
    """The llama-server answered with an error, or could not be reached or started."""


class ServerUnreachable(ServerError):
    """The llama-server could not be reached (stopped, or not there)."""


class ServerHTTP:
    """Requests to the server at *host*:*port* (its *url*), with *api_key* as a bearer
    token when given: :meth:`send`, :meth:`request`, :meth:`call`, :meth:`get`,
    :meth:`event_stream`; :meth:`drop_connection` closes this thread's connection (the
    server cancels a streamed request when its client goes)."""

    def __init__(self, host: str, port: int, *, api_key: str | None, timeout_s: float) -> None:
        self.url = f"http://{host}:{port}"
        self._host, self._port = host, port
        self.api_key = api_key
        self._timeout_s = timeout_s
        self._local = threading.local()

    def _connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s or self._timeout_s)
            self._local.connection = connection
        connection.timeout = timeout_s or self._timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(connection.timeout)
        return connection

    def drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
        self._local.connection = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def send(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> http.client.HTTPResponse:
        """Send one request on this thread's kept-alive connection (opened again once when
        the server had closed it); the response, its body not read."""
        payload = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):
            connection = self._connection(timeout_s)
            try:
                connection.request(method, path, body=payload, headers=self._headers())
                return connection.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self.drop_connection()
                if attempt:
                    raise
            except BaseException:
                self.drop_connection()
                raise
        raise AssertionError("unreachable")

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        """One request and its decoded JSON body: (status, body)."""
        response = self.send(method, path, body, timeout_s=timeout_s)
        try:
            raw = response.read()
        except BaseException:
            self.drop_connection()
            raise
        if response.will_close:
            self.drop_connection()
        return response.status, _json(raw) if raw else None

    def get(self, path: str) -> dict[str, Any]:
        """The JSON object the server answers a GET of *path* with."""
        decoded = self.call("GET", path)
        if not isinstance(decoded, dict):
            raise ServerError(f"llama-server {path}: not a JSON object")
        return decoded

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request's decoded JSON answer (:class:`ServerUnreachable` when the server
        cannot be reached, :class:`ServerError` on another status than 200)."""
        try:
            status, decoded = self.request(method, path, body)
        except (OSError, http.client.HTTPException) as error:
            raise ServerUnreachable(f"llama-server at {self.url} unreachable: {error}") from error
        if status != 200:
            raise ServerError(f"llama-server {path}: HTTP {status}: {error_text(decoded)}")
        return decoded

    def event_stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of a streamed POST to *path*, read on to the stream's end (so the
        connection can be reused) unless the caller stops early; an error event raised."""
        try:
            response = self.send("POST", path, body)
        except (OSError, http.client.HTTPException) as error:
            raise ServerUnreachable(f"llama-server at {self.url} unreachable: {error}") from error
        if response.status != 200:
            raise ServerError(f"llama-server {path}: HTTP {response.status}: {error_text(_json(response.read()))}")
        for event in _events(response):
            if "error" in event:
                raise ServerError(f"llama-server {path}: {error_text(event)}")
            yield event
        response.read()
        if response.will_close:
            self.drop_connection()


def _events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        event = _json(data)
        if isinstance(event, dict):
            yield event


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def error_text(decoded: Any) -> str:
    if isinstance(decoded, dict):
        error = decoded.get("error", decoded)
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(decoded)[:500]
