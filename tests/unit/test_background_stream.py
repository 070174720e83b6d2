"""A background stream read by an event loop: every item in order, the result, and errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator

import pytest

from percache_core.serving.streaming import BackgroundStream


def slow_count(n: int, fail: bool = False) -> Generator[int, None, str]:
    for i in range(n):
        time.sleep(0.01 if i % 3 else 0)  # some arrive together, some apart
        yield i
    if fail:
        raise RuntimeError("the server went away")
    return "done"


async def collect(stream: BackgroundStream[int, str]) -> list[int]:
    return [item async for item in stream.items()]


def test_an_event_loop_gets_every_item_in_order_then_the_result() -> None:
    stream = BackgroundStream(slow_count(20))
    assert asyncio.run(collect(stream)) == list(range(20))
    assert stream.result == "done"


def test_items_that_arrived_before_the_loop_looked_are_not_lost() -> None:
    stream = BackgroundStream(slow_count(3))
    time.sleep(0.1)  # all three and the end are queued before anyone watches
    assert asyncio.run(collect(stream)) == [0, 1, 2] and stream.result == "done"


def test_an_error_reaches_the_loop_after_the_items_before_it() -> None:
    got: list[int] = []

    async def read() -> None:
        async for item in BackgroundStream(slow_count(4, fail=True)).items():
            got.append(item)

    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(read())
    assert got == [0, 1, 2, 3]
