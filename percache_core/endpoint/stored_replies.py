"""Stored replies of an upstream that is not a llama-server (see
:mod:`percache_core.endpoint.upstream`): without its tokenizer, template or slots the
cache cannot restore states, so it keeps what it can keep exactly, the reply to an
identical request.

- :func:`reply_key`: a request's key, its body but for how the reply is delivered
  (``stream``, ``stream_options``), so a streamed repeat of a whole request finds it;
- :class:`ReplyRecorder`: the text, finish reason, usage and model of the upstream's reply,
  read from its bytes as they pass (server-sent events or one JSON object).

>>> reply_key("chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}) == \\
...     reply_key("chat", {"messages": [{"role": "user", "content": "Hi"}]})
True
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .protocol import Kind

DELIVERY_FIELDS = ("stream", "stream_options")  # how a reply comes, not what it says
FINISHED = ("stop", "length")  # replies that are kept: a run that ended as runs end


def reply_key(kind: Kind, body: dict[str, Any]) -> str:
    """The key of a *kind* request with this *body* (its fields in any order)."""
    kept = {k: v for k, v in body.items() if k not in DELIVERY_FIELDS}
    text = json.dumps(kept, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return f"{kind}-request:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class ReplyRecorder:
    """Reads the bytes of a *kind* reply with HTTP *status* (:meth:`feed`; a reply that is
    not streamed is read when :meth:`finish` says it ended); ``complete`` says whether it
    is a whole, finished reply of one choice to keep (a stream is, from its ``[DONE]``).

    >>> recorder = ReplyRecorder("text", streamed=True, status=200)
    >>> recorder.feed(b'data: {"model": "m", "choices": [{"index": 0, "text": "Hi"}]}\\n\\n')
    >>> recorder.feed(b'data: {"choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}\\n\\ndata: [DONE]\\n\\n')
    >>> recorder.text, recorder.finish_reason, recorder.complete
    ('Hi!', 'stop', True)
    """

    kind: Kind
    streamed: bool
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str = ""
    _buffer: bytes = field(default=b"", repr=False)
    _done: bool = field(default=False, repr=False)  # [DONE] seen (streams) or the body read
    _odd: bool = field(default=False, repr=False)  # something a stored reply cannot give back

    def feed(self, piece: bytes) -> None:
        """Take the next bytes of the reply."""
        self._buffer += piece
        if not self.streamed:
            return
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._take_event(line[5:].strip())

    def finish(self) -> None:
        """The reply's bytes ended."""
        if self.status == 200 and not self.streamed and not self._done:
            try:
                reply = json.loads(self._buffer)
            except ValueError:
                self._odd = True
                return
            self._take(reply, whole=True)
            self._done = True

    @property
    def complete(self) -> bool:
        return self.status == 200 and self._done and not self._odd and self.finish_reason in FINISHED

    def _take_event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self._done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self._odd = True
            return
        self._take(chunk, whole=False)

    def _take(self, reply: Any, *, whole: bool) -> None:
        if not isinstance(reply, dict) or "error" in reply:
            self._odd = True
            return
        self.model = str(reply.get("model") or self.model)
        if isinstance(reply.get("usage"), dict):
            self.usage = reply["usage"]
        choices = reply.get("choices") or []
        if any(not isinstance(c, dict) or c.get("index", 0) != 0 for c in choices):
            self._odd = True  # more than one choice
            return
        for choice in choices:
            part = choice.get("message" if whole else "delta") if self.kind == "chat" else choice
            part = part if isinstance(part, dict) else {}
            if self.kind == "chat" and set(part) - {"role", "content", "refusal"} - _empty_fields(part):
                self._odd = True  # tool calls, reasoning, ...: more than text
            text = part.get("content" if self.kind == "chat" else "text")
            self.text += text if isinstance(text, str) else ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


def _empty_fields(part: dict[str, Any]) -> set[str]:
    """The fields of a message part that hold nothing (``"tool_calls": null``)."""
    return {k for k, v in part.items() if v in (None, "", [], {})}
