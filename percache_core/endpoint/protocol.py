"""The OpenAI protocol as ``percache serve`` speaks it: reading a request, deciding whether
the cache can bind it, and writing replies, chunks and error bodies.

- :func:`read_request` (:func:`json_object`): the JSON body of a request, checked (an :class:`APIError` with the
  status and body OpenAI gives for each fault, before any work);
- :func:`pass_reason`: why a request cannot be bound to a stored answer (then it passes
  through to the server uncached), or None;
- :func:`message_texts`: the texts of a chat's messages (where states are kept);
- :func:`stored_chunks` / :func:`whole_reply`: a reply as chunks (streaming) or as one
  object, from a stored answer or from the server's own chunks;
- :func:`sse`: one server-sent event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "text"]
PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """A request the endpoint refuses, with OpenAI's error body.

    >>> APIError(404, "no model x", code="model_not_found").body()["error"].get("code")
    'model_not_found'
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServerDefaults:
    """The sampling a server uses where a request sets none (its ``/props``)."""

    temperature: float
    seed: int  # -1: a new random seed per request

    @classmethod
    def from_props(cls, props: dict[str, Any]) -> ServerDefaults:
        params = props.get("default_generation_settings", {}).get("params", {})
        return cls(float(params.get("temperature", 0.8)), int(params.get("seed", -1)))


RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's "a new seed each time" (-1) as /props reports it


def read_request(raw: bytes, kind: Kind, models: Sequence[str] | None) -> dict[str, Any]:
    """The request body *raw* of a *kind* request, checked: JSON object, its messages or
    prompt present and well formed, its model (when given) one of *models* (None: any
    name, as a llama-server with one model serves every request whatever it names, and
    echoes the name in its reply).

    >>> read_request(b'{"prompt": "Hi"}', "text", ["m"])
    {'prompt': 'Hi'}
    >>> read_request(b'{"prompt": "Hi", "model": "gpt-3.5-turbo"}', "text", None)["model"]
    'gpt-3.5-turbo'
    >>> read_request(b'{"messages": []}', "chat", ["m"])
    Traceback (most recent call last):
    ...
    percache_core.endpoint.protocol.APIError: 'messages' must be a non-empty list
    """
    body = json_object(raw)
    model = body.get("model")
    if model is not None and models is not None and model not in models:
        raise APIError(404, f"The model '{model}' does not exist (this endpoint serves {', '.join(models)})",
                       param="model", code="model_not_found")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise APIError(400, f"messages[{index}] must be an object with a 'role'", param="messages")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise APIError(400, f"messages[{index}].content must be a string or a list", param="messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise APIError(400, "'prompt' must be a non-empty string or list", param="prompt")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise APIError(400, f"'{name}' must be a positive integer", param=name)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    return body


def json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object *raw* holds (400 for anything else)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def pass_reason(body: dict[str, Any], kind: Kind, defaults: ServerDefaults) -> str | None:
    """Why the reply to *body* cannot be bound to what the cache stores (the request then
    passes through to the server uncached), or None. The server lays out and decodes a
    bound request itself (the body is relayed), so only what makes its reply other than a
    function of the request, or holds parts a stored answer cannot give back, passes.

    >>> defaults = ServerDefaults(temperature=0.8, seed=-1)
    >>> pass_reason({"messages": [], "temperature": 0}, "chat", defaults) is None
    True
    >>> pass_reason({"messages": []}, "chat", defaults)
    'sampling at temperature 0.8 with no seed is random'
    """
    temperature = body.get("temperature", defaults.temperature)
    seed = body.get("seed", defaults.seed)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        return "a temperature that is not a number"
    if temperature > 0 and (not isinstance(seed, int) or seed < 0 or seed == RANDOM_SEED):
        return f"sampling at temperature {temperature:g} with no seed is random"
    if body.get("tools") or body.get("functions"):
        return "tools"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("n_probs"):
        return "log-probabilities"
    if body.get("n", 1) != 1 and kind == "chat":
        return "more than one choice"
    if kind == "text" and not isinstance(body.get("prompt"), str):
        return "a prompt that is not one string"
    if kind == "chat" and any(isinstance(m.get("content"), list) and not _text_parts(m["content"])
                              for m in body["messages"]):
        return "content that is not text"
    return None


def _text_parts(parts: list[Any]) -> bool:
    return all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts)


def message_texts(body: dict[str, Any]) -> list[str]:
    """The texts of a chat's messages, in order (a message's text parts joined), or a
    completion's prompt: where the prompt's states are kept.

    >>> message_texts({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    ['Hi']
    """
    if "messages" not in body:
        prompt = body.get("prompt")
        return [prompt] if isinstance(prompt, str) else []
    return [text for message in body["messages"] if (text := _content_text(message)).strip()]


def last_user_text(body: dict[str, Any]) -> str | None:
    """A chat's last user message (the question it asks), or None.

    >>> last_user_text({"messages": [{"role": "system", "content": "Notes"}, {"role": "user", "content": "When?"}]})
    'When?'
    """
    users = [_content_text(m) for m in body.get("messages") or () if m.get("role") == "user"]
    return users[-1] if users and users[-1].strip() else None


def _content_text(message: dict[str, Any]) -> str:
    """A message's text (its text parts joined); "" for none."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event carrying *event*."""
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def _frame(kind: Kind, model: str, reply_id: str, created: int) -> dict[str, Any]:
    return {
        "id": reply_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
    }


def stored_chunks(
    kind: Kind, text: str, finish_reason: str, model: str, usage: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The chunks a stored answer streams as: its text, the finish, then *usage* (when the
    client asked for it), as the server streams a reply.

    >>> [c["choices"] for c in stored_chunks("text", "Hi", "stop", "m", None)]
    [[{'index': 0, 'text': 'Hi', 'logprobs': None, 'finish_reason': None}], \
[{'index': 0, 'text': '', 'logprobs': None, 'finish_reason': 'stop'}]]
    """
    frame = _frame(kind, model, _reply_id(kind), int(time.time()))
    if kind == "chat":
        pieces = [{"role": "assistant", "content": text}, {}]
        choices = [[{"index": 0, "delta": d, "finish_reason": f}] for d, f in zip(pieces, (None, finish_reason))]
    else:
        choices = [[{"index": 0, "text": t, "logprobs": None, "finish_reason": f}]
                   for t, f in ((text, None), ("", finish_reason))]
    chunks = [{**frame, "choices": c} for c in choices]
    if usage is not None:
        chunks.append({**frame, "choices": [], "usage": usage})
    return chunks


def whole_reply(
    kind: Kind, text: str, finish_reason: str, model: str, usage: dict[str, Any], chunks: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The reply as one object (a request with ``stream`` off): its text, finish reason and
    usage; the server's *chunks* (when it ran) give the id, time and fingerprint and any
    other text fields of the message (``reasoning_content``).

    >>> whole_reply("chat", "Hi", "stop", "m", {})["choices"][0]["message"]
    {'role': 'assistant', 'content': 'Hi'}
    """
    first = chunks[0] if chunks else {}
    reply: dict[str, Any] = {
        "id": first.get("id") or _reply_id(kind),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": first.get("created") or int(time.time()),
        "model": first.get("model") or model,
    }
    if "system_fingerprint" in first:
        reply["system_fingerprint"] = first["system_fingerprint"]
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        for chunk in chunks:
            for choice in chunk.get("choices") or ():
                for key, value in (choice.get("delta") or {}).items():
                    if key not in ("role", "content") and isinstance(value, str):
                        message[key] = message.get(key, "") + value
        reply["choices"] = [{"index": 0, "message": message, "finish_reason": finish_reason}]
    else:
        reply["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    reply["usage"] = usage
    return reply


def _reply_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
