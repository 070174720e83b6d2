"""A relayed request asked whole is checked by its reply's timings before its text is
passed on; a server whose replies do not show their reuse is asked streamed from then on."""

from typing import Any

import pytest

from percache_core.engines.llama_server.server_streams import InSlot, Relays, ReuseNotShown, UnexpectedReuse

PATH = "/v1/chat/completions"


class FakeHTTP:
    """Answers whole requests with *reply* and streamed ones with two events."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.sent: list[dict[str, Any]] = []

    def call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(body)
        return self.reply

    def event_stream(self, path: str, body: dict[str, Any]):
        self.sent.append(body)
        yield {"prompt_progress": {"cache": 0, "total": 9}}
        yield {"choices": [{"delta": {"content": "streamed"}, "finish_reason": "stop"}]}

    def drop_connection(self) -> None:
        pass


def reply(timings: dict[str, int], **message: Any) -> dict[str, Any]:
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi", **message}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1},
        "timings": timings,
    }


def run(relays: Relays, body: dict[str, Any], expected: tuple[int, int] | None) -> tuple[list[str], InSlot, list[Any]]:
    slot, chunks = InSlot(2), []
    pieces = list(relays.run(PATH, body, {"cache_prompt": True, "id_slot": 2}, expected, slot, chunks))
    return pieces, slot, chunks


def test_a_whole_request_is_asked_whole_and_its_reply_kept_as_the_server_sent_it() -> None:
    http = FakeHTTP(reply({"cache_n": 4, "prompt_n": 5}))
    pieces, slot, chunks = run(Relays(http), {"messages": [], "stream_options": {"include_usage": True}}, (4, 9))
    assert pieces == ["Hi"] and chunks == [http.reply] and slot.completion.whole is http.reply
    assert slot.completion.cached == 4 and slot.completion.finish_reason == "stop" and slot.completion.plain
    assert http.sent[0]["stream"] is False and "stream_options" not in http.sent[0] and http.sent[0]["id_slot"] == 2


def test_a_whole_reply_with_another_reuse_gives_no_text() -> None:
    relays = Relays(FakeHTTP(reply({"cache_n": 0, "prompt_n": 9})))
    with pytest.raises(UnexpectedReuse) as raised:
        run(relays, {"messages": []}, (4, 9))
    assert not isinstance(raised.value, ReuseNotShown) and relays.whole_shows_reuse


def test_a_reply_with_tool_calls_is_not_plain() -> None:
    pieces, slot, _ = run(Relays(FakeHTTP(reply({"cache_n": 0, "prompt_n": 9}, tool_calls=[{"id": "1"}]))), {}, None)
    assert pieces == ["Hi"] and not slot.completion.plain


def test_a_server_whose_replies_do_not_show_their_reuse_is_asked_streamed_from_then_on() -> None:
    http = FakeHTTP(reply({"prompt_n": 9}))
    relays = Relays(http)
    with pytest.raises(ReuseNotShown):
        run(relays, {"messages": []}, (0, 9))
    pieces, slot, chunks = run(relays, {"messages": []}, (0, 9))
    assert pieces == ["streamed"] and slot.completion.whole is None and len(chunks) == 1
    assert http.sent[-1]["stream"] is True and http.sent[-1]["return_progress"] is True
