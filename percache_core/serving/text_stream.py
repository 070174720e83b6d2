"""The one loop every engine's generated text goes through: stop strings, pre-emption and
closing the source early (:func:`shown_text`).

An in-process engine's tokens become text pieces first (:func:`~percache_core.engines.
llama_cpp.answer_decoder.token_pieces`); a server's stream is text pieces already. Either
way the same filter decides what may be shown, and a user's question pre-empts idle work
between two pieces.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

from ..errors import Preempted
from ..kv.stopping import StopStringFilter
from .state_runner import StopCheck


def shown_text(
    pieces: Iterator[str], stop: StopStringFilter, should_stop: StopCheck | None, *, what: str = "decoding"
) -> Generator[str, None, None]:
    """Feed generated text *pieces* through *stop*, yielding what may be shown now (text
    that may begin a stop string is held back; the rest comes at the end). Ends at the
    first stop string; raises :class:`Preempted` (``"<what> pre-empted ..."``) when
    *should_stop* turns true after a piece. *pieces* is closed when the loop ends early.

    >>> stop = StopStringFilter(["\\n"], strip=False)
    >>> list(shown_text(iter([" Fri", "day\\nQ"]), stop, None)), stop.stopped
    ([' Fri', 'day'], True)
    """
    try:
        for piece in pieces:
            shown = stop.feed(piece)
            if shown:
                yield shown
            if stop.stopped:
                break
            if should_stop is not None and should_stop():
                raise Preempted(f"{what} pre-empted by a user question")
    finally:
        close_source(pieces)
    tail = stop.finish()
    if tail:
        yield tail


def close_source(source: Iterator[object]) -> None:
    """Close *source* where it can be closed (a generator, a server's stream): a run cut
    short ends the work behind it."""
    close = getattr(source, "close", None)
    if close is not None:
        close()
