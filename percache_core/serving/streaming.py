"""Streams that never keep the model from others.

A generator that holds the model's lock across its ``yield`` keeps it as long as the
caller keeps the generator: a caller that breaks out of its loop (and keeps the object)
would block every later question, its own thread's included. So a stream here is
produced by a thread of its own, which runs the generation to its end (bounded by the
answer's token limit; the answer is stored as usual) and hands the pieces over through
a queue: the lock is released whether or not anyone reads on. ``close()`` stops the
production at the next piece.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..types import Answer

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Finished(Generic[R]):
    value: R | None = None
    error: BaseException | None = None


_PRODUCER_THREADS = 16  # streams produced at once (one engine runs one at a time anyway)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _producers() -> ThreadPoolExecutor:
    """The threads that produce streams, started on first use and reused: llama.cpp's CPU
    backend (built with OpenMP, its default) keeps a team of worker threads per calling thread, so a new thread
    per stream would start a new team each time while the last one still spins on the
    cores (measured: LlamaIndex completions 12% slower than stock llama.cpp)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_PRODUCER_THREADS, thread_name_prefix="percache-stream")
        return _pool


class BackgroundStream(Generic[T, R]):
    """Items of *events* (a generator) produced by a thread of a shared pool; iterate it for the
    items, then read ``result`` (the generator's return value).

    >>> def count():
    ...     yield 1
    ...     yield 2
    ...     return "done"
    >>> stream = BackgroundStream(count())
    >>> list(stream), stream.result
    ([1, 2], 'done')
    """

    def __init__(self, events: Generator[T, None, R]) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._finished: _Finished[R] | None = None
        self._on_item: Callable[[], None] | None = None  # told after each item (watch)
        context = contextvars.copy_context()  # the caller's context variables hold in the thread
        _producers().submit(context.run, self._produce, events)

    def _produce(self, events: Generator[T, None, R]) -> None:
        try:
            while True:
                if self._cancelled.is_set():
                    events.close()
                    self._put(_Finished())
                    return
                self._put(next(events))
        except StopIteration as done:
            self._put(_Finished(value=done.value))
        except BaseException as error:  # handed to the reader
            self._put(_Finished(error=error))

    def _put(self, item: Any) -> None:
        self._queue.put(item)
        told = self._on_item
        if told is not None:
            try:
                told()
            except RuntimeError:  # the reader's event loop has closed: nobody reads on
                self._on_item = None

    async def items(self) -> AsyncIterator[T]:
        """The items, for an event loop: it is woken by the producer as each arrives (no
        thread waits for it), then takes every item there is."""
        import asyncio

        loop, arrived = asyncio.get_running_loop(), asyncio.Event()
        self._on_item = lambda: loop.call_soon_threadsafe(arrived.set)
        if not self._queue.empty():
            arrived.set()
        while self._finished is None:
            await arrived.wait()
            arrived.clear()
            while self._finished is None:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Finished):
                    self._finished = item
                else:
                    yield item
        if self._finished.error is not None:
            error, self._finished.error = self._finished.error, None
            raise error

    def __iter__(self) -> Iterator[T]:
        while self._finished is None:
            item = self._queue.get()
            if isinstance(item, _Finished):
                self._finished = item
                break
            yield item
        if self._finished.error is not None:
            error, self._finished.error = self._finished.error, None
            raise error

    @property
    def result(self) -> R | None:
        """The generator's return value once iteration ended (None before, or if closed)."""
        return None if self._finished is None else self._finished.value

    def close(self) -> None:
        """Stop producing at the next item (the generator is closed, releasing the model)."""
        self._cancelled.set()


class AnswerStream:
    """An answer arriving piece by piece; iterate it for text, then read ``answer``.

    It is produced by a thread of its own, so a loop that stops early never keeps the
    model from other questions (the answer is still completed and stored).

    >>> stream = pc.answer_stream("When is the rehearsal?")   # doctest: +SKIP
    >>> for piece in stream: print(piece, end="")              # doctest: +SKIP
    >>> stream.answer.source                                    # doctest: +SKIP
    'chunk_states'
    """

    def __init__(self, events: Generator[str, None, Answer]) -> None:
        self._stream: BackgroundStream[str, Answer] = BackgroundStream(events)

    @property
    def answer(self) -> Answer | None:
        """The finished answer (None until the stream is consumed)."""
        return self._stream.result

    def __iter__(self) -> Iterator[str]:
        return iter(self._stream)

    def pieces(self) -> AsyncIterator[str]:
        """The text pieces, for an event loop (``async for``; see :meth:`BackgroundStream.items`)."""
        return self._stream.items()

    def result(self) -> Answer:
        """Consume what is left and return the finished answer."""
        for _ in self:
            pass
        if self.answer is None:
            raise RuntimeError("the stream was closed before its answer was finished")
        return self.answer

    def close(self) -> None:
        """Abandon the stream: decoding stops at the next piece (nothing is stored)."""
        self._stream.close()


def drain(events: Generator[Any, None, R]) -> R:
    """Run a generator to its end and return its return value (for runs nobody streams)."""
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value


def delivered(events: Generator[str, None, Answer], stream: bool) -> Answer | AnswerStream:
    """The stream of *events* (produced by a thread of its own), or (not streaming) its
    answer, produced in the calling thread."""
    return AnswerStream(events) if stream else drain(events)
