"""What a llama-server's requests return: :class:`Completion` (filled in as a request
streams), :func:`completion_events` (``/completion``) and :class:`Relays` (a client's
OpenAI request, streamed or asked whole), each checking before any text that the server
reused what was planned (:class:`UnexpectedReuse`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...kv.engine import Completion
from .server_http import ServerError, ServerHTTP


class UnexpectedReuse(ServerError):
    """The server reused another number of prompt tokens than the request counted on (or,
    for a relayed request, laid out a prompt of another length)."""

    def __init__(self, expected: int, cached: int, expected_total: int = 0, total: int = 0) -> None:
        other_prompt = f" of a {total}-token prompt, not {expected_total}" if total != expected_total else ""
        super().__init__(f"the server reused {cached} prompt tokens{other_prompt}, not {expected}")
        self.expected, self.cached = expected, cached


class ReuseNotShown(UnexpectedReuse):
    """A whole reply without ``timings.cache_n`` (a server older than llama.cpp's September
    2025 one): what it reused is unknown, so the request runs again, streamed."""

    def __init__(self) -> None:
        ServerError.__init__(self, "the server's whole reply does not show what it reused (no timings.cache_n)")
        self.expected, self.cached = 0, -1


@dataclass(frozen=True)
class InSlot:
    """Where a request runs: slot *index*, and the :class:`Completion` it fills in.

    >>> InSlot(2).index, InSlot().completion.text
    (2, '')
    """

    index: int = 0
    completion: Completion = field(default_factory=Completion)


def completion_events(
    http: ServerHTTP, body: dict[str, Any], completion: Completion, expected_cached: int | None
) -> Iterator[str]:
    """Stream ``/completion`` with *body* on *http*, filling in *completion*; yields the
    text pieces. Raises :class:`UnexpectedReuse` when the server's first progress event
    shows another reuse than *expected_cached* (before any text)."""
    finished = False
    try:
        for event in http.event_stream("/completion", body):
            progress = event.get("prompt_progress")
            if progress is not None and completion.cached is None:
                completion.cached = int(progress.get("cache", 0))
                if expected_cached is not None and completion.cached != expected_cached:
                    raise UnexpectedReuse(expected_cached, completion.cached)
            _absorb(event, completion)
            if event.get("content"):
                yield event["content"]
            finished = finished or bool(event.get("stop"))  # (the stream ends after it)
        if not finished:
            raise ServerError("llama-server closed the stream before the end of the completion")
    finally:
        if not finished:
            http.drop_connection()  # the server cancels the request when the client goes


def _absorb(event: dict[str, Any], completion: Completion) -> None:
    """Note what one ``/completion`` event tells of the request on *completion*."""
    completion.text += event.get("content") or ""
    if event.get("prompt_progress") is None:  # progress events carry a placeholder token
        completion.tokens.extend(int(t) for t in event.get("tokens") or ())
    probabilities = event.get("completion_probabilities")
    if probabilities and not completion.top_logprobs:
        completion.top_logprobs = [(int(p["id"]), float(p["logprob"])) for p in probabilities[0]["top_logprobs"]]
    timings = event.get("timings")
    if timings:
        completion.timings = {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))}
        completion.prompt_tokens = int(timings.get("prompt_n", completion.prompt_tokens))
        if completion.cached is None:
            completion.cached = int(timings.get("cache_n", 0))
    if event.get("stop"):
        completion.stop_type = str(event.get("stop_type", ""))


class Relays:
    """A client's OpenAI requests run on the server's own endpoint (``LlamaServer.relay``)
    over *http*: one the client streams is streamed, with progress events (its reuse is
    checked before any text); one it asks whole (``stream`` off) is asked whole, as the
    server alone would be asked, and checked by its reply's timings before its text is
    passed on. A whole request reads no event per generated token (each costs a thread
    wake-up and a JSON parse beside the server's decode), and the client gets the server's
    own reply. A server whose whole replies do not show their reuse (no
    ``timings.cache_n``) is asked streamed from then on, the request that found it run
    again (:class:`ReuseNotShown`)."""

    def __init__(self, http: ServerHTTP) -> None:
        self.http = http
        self.whole_shows_reuse = True  # until a whole reply lacks timings.cache_n

    def run(
        self, path: str, body: dict[str, Any], settings: dict[str, Any], expected: tuple[int, int] | None,
        slot: InSlot, chunks: list[dict[str, Any]],
    ) -> Iterator[str]:
        """Run *body* with the server-side *settings* (``cache_prompt``, ``id_slot``) in
        *slot*; see :class:`Relays` and :meth:`LlamaServer.relay`."""
        request = {**body, **settings}
        if body.get("stream") or not self.whole_shows_reuse:
            request.update(stream=True, stream_options={"include_usage": True}, return_progress=True)
            yield from relay_events(self.http, path, request, slot.completion, expected, chunks)
            return
        request.pop("stream_options", None)  # (streaming only)
        try:
            yield from _relay_whole(self.http, path, request, slot.completion, expected, chunks)
        except ReuseNotShown:
            self.whole_shows_reuse = False
            raise


def _relay_whole(
    http: ServerHTTP, path: str, body: dict[str, Any], completion: Completion, expected: tuple[int, int] | None,
    chunks: list[dict[str, Any]],
) -> Iterator[str]:
    """Ask *body* (``stream`` off) whole on *http*: its reply, checked to show *expected*
    (tokens reused, prompt tokens) in its timings, is *completion*'s ``whole`` and *chunks*'
    one item; yields its text once. Raises :class:`UnexpectedReuse` (before any text) on
    another reuse, :class:`ReuseNotShown` where the timings do not say."""
    reply = http.call("POST", path, {**body, "stream": False})
    if not isinstance(reply, dict):
        raise ServerError(f"llama-server {path}: not a JSON object")
    timings = reply.get("timings") or {}
    if "cache_n" not in timings:
        raise ReuseNotShown()
    completion.cached = int(timings["cache_n"])
    total = completion.cached + int(timings.get("prompt_n", 0))
    if expected is not None and (completion.cached, total) != expected:
        raise UnexpectedReuse(expected[0], completion.cached, expected[1], total)
    completion.usage = dict(reply.get("usage") or {})
    completion.timings = _numbers(timings)
    completion.whole = reply
    text = _absorb_choice(reply, completion, part="message")
    chunks.append(reply)
    if text:
        yield text


def relay_events(
    http: ServerHTTP, path: str, body: dict[str, Any], completion: Completion, expected: tuple[int, int] | None,
    chunks: list[dict[str, Any]],
) -> Iterator[str]:
    """Stream a client's OpenAI request *body* to *path* on *http*, filling in *completion*
    and appending each chunk the client would get to *chunks*; yields the text each adds.
    Raises :class:`UnexpectedReuse` when the first progress event shows another (reuse,
    prompt length) than *expected* (None: any)."""
    finished = False
    try:
        for event in http.event_stream(path, body):
            progress = event.get("prompt_progress")
            if progress is not None:
                if completion.cached is None:
                    completion.cached = int(progress.get("cache", 0))
                    total = int(progress.get("total", 0))
                    if expected is not None and (completion.cached, total) != expected:
                        raise UnexpectedReuse(expected[0], completion.cached, expected[1], total)
                continue  # progress is PerCache's, not the client's
            if completion.cached is None:
                raise ServerError(f"llama-server {path} reported no prompt progress: its reuse is unknown")
            if event.get("usage"):
                completion.usage = dict(event["usage"])
            if event.get("timings"):
                completion.timings = _numbers(event["timings"])
                event = {k: v for k, v in event.items() if k != "timings"}
            chunks.append(event)
            text = _absorb_choice(event, completion)
            if text:
                yield text
        finished = True
    finally:
        if not finished:
            http.drop_connection()  # the server cancels the request when the client goes


def _numbers(timings: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a server's ``timings``."""
    return {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))}


def _absorb_choice(event: dict[str, Any], completion: Completion, part: str = "delta") -> str:
    """The text one OpenAI chunk adds (a chat *part*'s content: a chunk's ``delta``, a
    whole reply's ``message``; a completion's text); its finish reason and whether it
    holds more than text are noted on *completion*."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if choice.get("finish_reason"):
        completion.finish_reason = str(choice["finish_reason"])
    delta = choice.get(part)
    if delta is None:  # /v1/completions
        text = choice.get("text") or ""
    else:
        text = delta.get("content") or ""
        if any(value for key, value in delta.items() if key not in ("role", "content")):
            completion.plain = False  # reasoning or tool calls: relayed, not kept as an answer
    completion.text += text
    return text
