"""``AnswerStream``: an answer that arrives piece by piece."""

from __future__ import annotations

from collections.abc import Generator, Iterator

from .types import Answer


class AnswerStream:
    """An answer arriving piece by piece; iterate it for text, then read ``answer``.

    >>> stream = pc.answer_stream("When is the rehearsal?")   # doctest: +SKIP
    >>> for piece in stream: print(piece, end="")              # doctest: +SKIP
    >>> stream.answer.source                                    # doctest: +SKIP
    'chunk_states'
    """

    def __init__(self, events: Generator[str, None, Answer]) -> None:
        self._events = events
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                piece = next(self._events)
            except StopIteration as done:
                self.answer = done.value
                return
            yield piece

    def result(self) -> Answer:
        """Consume what is left and return the finished answer."""
        for _ in self:
            pass
        assert self.answer is not None
        return self.answer

    def close(self) -> None:
        """Abandon the stream (releases the model for other questions)."""
        self._events.close()
