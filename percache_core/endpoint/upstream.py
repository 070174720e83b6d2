"""What ``percache serve --upstream URL`` serves over: :func:`detect_upstream` tells a
llama-server (its ``/props`` answers with its generation settings: chunk states, stored
answers, everything) from any other OpenAI-compatible server (llama-cpp-python's
``llama_cpp.server``, Ollama, LM Studio, vLLM: only ``/v1/models`` and the completion
routes are known, so only stored answers of identical requests), which
:class:`PlainUpstream` speaks to.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from ..errors import PerCacheError

UpstreamKind = Literal["llama-server", "openai"]
DETECT_TIMEOUT_S = 10.0


def _get(url: str, api_key: str | None) -> httpx.Response | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(url, headers=headers, timeout=DETECT_TIMEOUT_S)
    except httpx.HTTPError:
        return None


def _json(reply: httpx.Response | None) -> Any:
    if reply is None or reply.status_code != 200:
        return None
    try:
        return reply.json()
    except ValueError:
        return None


def detect_upstream(
    url: str, api_key: str | None = None, *, wait_s: float = 0.0, waiting: Callable[[], None] | None = None
) -> UpstreamKind:
    """``"llama-server"`` where ``/props`` gives llama-server's generation settings, else
    ``"openai"`` where ``/v1/models`` lists models; asked again every half second for up to
    *wait_s* seconds while neither answers (an upstream started at the same time is still
    loading its model: a llama-server answers 503 then), *waiting* called once when it starts
    to wait.

    Raises:
        PerCacheError: neither answers within *wait_s* (no server there, or not an
            OpenAI-compatible one).
    """
    base = url.rstrip("/")
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        props = _json(_get(base + "/props", api_key))
        if isinstance(props, dict) and "default_generation_settings" in props:
            return "llama-server"
        models = _json(_get(base + "/v1/models", api_key))
        if isinstance(models, dict) and isinstance(models.get("data"), list):
            return "openai"
        if time.monotonic() >= deadline:
            waited = f" within {wait_s:g} s" if wait_s > 0 else ""
            raise PerCacheError(f"no OpenAI-compatible server answers at {url}{waited} (neither /props nor /v1/models)")
        if waiting is not None:
            waiting()
            waiting = None
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


@dataclass
class PlainUpstream:
    """An OpenAI-compatible server that is not a llama-server, at *url* (without ``/v1``),
    with the *api_key* it asks for (sent as a bearer token)."""

    url: str
    api_key: str | None = None
    _models: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    def models(self) -> dict[str, Any]:
        """The upstream's ``/v1/models`` (read once).

        Raises:
            PerCacheError: the upstream does not list its models.
        """
        if self._models is None:
            listed = _json(_get(self.url + "/v1/models", self.api_key))
            if not isinstance(listed, dict) or not isinstance(listed.get("data"), list):
                raise PerCacheError(f"the upstream at {self.url} does not list its models (/v1/models)")
            self._models = listed
        return self._models

    @property
    def model_name(self) -> str:
        """The first model it lists."""
        data = self.models()["data"]
        return str(data[0].get("id")) if data else "model"

    def identity(self) -> str:
        """What the upstream serves, as stored answers are bound to it: every listed
        model's id, owner and description (``meta``), not the time it was listed."""
        served = [{k: v for k, v in m.items() if k != "created"} for m in self.models()["data"] if isinstance(m, dict)]
        text = json.dumps(served, sort_keys=True, default=str)
        return "openai-upstream:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
