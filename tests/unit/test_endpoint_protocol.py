"""The endpoint's protocol logic without a model: which requests are bound, which pass
through and why, the error statuses, and the replies built from stored answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from percache_core.cli import main
from percache_core.endpoint.protocol import (
    APIError,
    ServerDefaults,
    message_texts,
    pass_reason,
    read_request,
    stored_chunks,
    whole_reply,
)

GREEDY = ServerDefaults(temperature=0.0, seed=-1)
SAMPLING = ServerDefaults(temperature=0.8, seed=0xFFFFFFFF)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    ("body", "defaults", "reason"),
    [
        ({"messages": HELLO}, GREEDY, None),  # the server's own default is greedy
        ({"messages": HELLO}, SAMPLING, "sampling at temperature 0.8 with no seed is random"),
        ({"messages": HELLO, "temperature": 0.7, "seed": 5}, SAMPLING, None),  # seeded: reproducible
        ({"messages": HELLO, "temperature": 0.7, "seed": -1}, GREEDY, "sampling at temperature 0.7 with no seed is random"),
        ({"messages": HELLO, "temperature": 0, "tools": [{"type": "function"}]}, SAMPLING, "tools"),
        ({"messages": HELLO, "temperature": 0, "logprobs": True}, SAMPLING, "log-probabilities"),
        ({"messages": HELLO, "temperature": 0, "n": 2}, SAMPLING, "more than one choice"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
          "temperature": 0}, SAMPLING, "content that is not text"),
    ],
)
def test_what_passes_through_and_why(body: dict, defaults: ServerDefaults, reason: str | None) -> None:
    assert pass_reason(body, "chat", defaults) == reason


def test_a_completion_of_several_prompts_passes_through() -> None:
    assert pass_reason({"prompt": ["a", "b"], "temperature": 0}, "text", SAMPLING) == "a prompt that is not one string"
    assert pass_reason({"prompt": "a", "temperature": 0}, "text", SAMPLING) is None


@pytest.mark.parametrize(
    ("raw", "kind", "status", "param"),
    [
        (b"not json", "chat", 400, None),
        (b"[1, 2]", "chat", 400, None),
        (b'{"messages": "hi"}', "chat", 400, "messages"),
        (b'{"messages": [{"content": "hi"}]}', "chat", 400, "messages"),
        (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}', "chat", 404, "model"),  # not listed by a multi-model upstream
        (b'{"prompt": ""}', "text", 400, "prompt"),
        (b'{"prompt": "hi", "max_tokens": -3}', "text", 400, "max_tokens"),
        (b'{"prompt": "hi", "stream": "yes"}', "text", 400, "stream"),
    ],
)
def test_bad_requests_get_openai_error_bodies(raw: bytes, kind: str, status: int, param: str | None) -> None:
    with pytest.raises(APIError) as refused:
        read_request(raw, kind, ["served-model"])  # type: ignore[arg-type]
    error = refused.value
    assert error.status == status and error.param == param
    body = error.body()["error"]
    assert body["message"] and body["type"] == "invalid_request_error"
    json.dumps(body)


def test_a_stored_answer_streams_and_returns_as_the_server_shapes_a_reply() -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 9}}
    chunks = stored_chunks("chat", "Noon.", "stop", "m", usage)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Noon."}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[2]["choices"] == []
    assert chunks[2]["usage"] == usage and len({c["id"] for c in chunks}) == 1
    assert len(stored_chunks("chat", "Noon.", "stop", "m", None)) == 2  # no usage unless asked for
    server_chunks = [{"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": "b1",
                      "choices": [{"index": 0, "delta": {"reasoning_content": "think"}, "finish_reason": None}]}]
    reply = whole_reply("chat", "Noon.", "stop", "m", usage, server_chunks)
    assert reply["id"] == "chatcmpl-1" and reply["system_fingerprint"] == "b1" and reply["usage"] == usage
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Noon.", "reasoning_content": "think"}
    text = whole_reply("text", " Noon.", "length", "m", usage)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == " Noon."


def test_message_texts_are_where_states_are_kept() -> None:
    body = {"messages": [{"role": "system", "content": "Notes"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert message_texts(body) == ["Notes", "a\nb"]
    assert message_texts({"prompt": "Q: when?"}) == ["Q: when?"]


def test_serve_refuses_an_open_address_without_a_key_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERCACHE_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9"]) == 2
    assert "needs --api-key" in capsys.readouterr().err
    assert main(["serve", "--cache", "x", "--upstream", "http://127.0.0.1:9", "--model", "m.gguf"]) == 2  # both
    assert "not both" in capsys.readouterr().err
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--wait-upstream", "-1"]) == 2
    assert "--wait-upstream" in capsys.readouterr().err
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--slots", "2"]) == 2  # the upstream runs its own
    assert "--slots" in capsys.readouterr().err
    assert main(["serve", "--model", "m.gguf", "--slots", "0"]) == 2
    assert "--slots" in capsys.readouterr().err
    monkeypatch.delenv("PERCACHE_SHARED_SECRET", raising=False)
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--shared-url", "redis://127.0.0.1:9/0"]) == 2
    assert "PERCACHE_SHARED_SECRET" in capsys.readouterr().err


def test_read_only_and_serve_options_are_checked_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "no-cache"
    assert main(["stats", "--cache", str(missing)]) == 2
    assert "no cache here" in capsys.readouterr().err and not missing.exists()  # nothing created
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--documents", str(tmp_path / "none/*.txt")]) == 2
    assert "no folder and no .txt" in capsys.readouterr().err
