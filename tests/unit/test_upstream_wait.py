"""``percache serve`` started beside its upstream: it waits for the upstream to answer (a
server loading its model answers 503, or nothing yet), within ``--wait-upstream``."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from percache_core.endpoint.upstream import detect_upstream
from percache_core.errors import PerCacheError


class Loading(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that answers 503 until ``ready_at`` (as llama-server while
    it loads its model), then lists one model."""

    ready_at = 0.0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if time.monotonic() < self.ready_at or self.path != "/v1/models":
            self.send_response(503 if time.monotonic() < self.ready_at else 404)
            self.end_headers()
            return
        body = json.dumps({"object": "list", "data": [{"id": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def loading_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_upstream_still_loading_is_waited_for(loading_server):
    url = f"http://127.0.0.1:{loading_server.server_address[1]}"
    Loading.ready_at = time.monotonic() + 1.5
    with pytest.raises(PerCacheError, match="no OpenAI-compatible server"):
        detect_upstream(url)  # no wait: it fails at once
    said: list[str] = []
    started = time.monotonic()
    assert detect_upstream(url, wait_s=20, waiting=lambda: said.append("waiting")) == "openai"
    assert said == ["waiting"] and 0.5 < time.monotonic() - started < 10


def test_an_upstream_that_never_answers_fails_after_the_wait(loading_server):
    url = f"http://127.0.0.1:{loading_server.server_address[1]}"
    Loading.ready_at = time.monotonic() + 60
    started = time.monotonic()
    with pytest.raises(PerCacheError, match="within 1 s"):
        detect_upstream(url, wait_s=1)
    assert time.monotonic() - started < 5
