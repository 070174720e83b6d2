"""Cutting a streamed answer at stop strings without ever showing part of one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """Stop strings as a tuple: one string is one stop string (not one per character).

    >>> stop_strings("abc"), stop_strings(["\\n", "Q:"]), stop_strings(None)
    (('abc',), ('\\n', 'Q:'), ())
    >>> stop_strings([""])
    Traceback (most recent call last):
    ...
    ValueError: stop strings must be non-empty strings, got ''
    """
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop strings must be non-empty strings, got {item!r}")
    return items


class StopStringFilter:
    """Feed text as it is generated; get back the text that is safe to show.

    Text that might be the start of a stop string is held back until it is known not
    to be one. Leading whitespace of the answer, and whitespace before a stop string or at
    the end, is dropped, unless ``strip=False`` (llama.cpp's own completion: the text as
    decoded, up to the first stop string; a stop string at the start gives "").

    >>> stop = StopStringFilter(["\\n\\n"])
    >>> stop.feed(" Friday"), stop.feed(" at 3.\\n"), stop.feed("\\nQuestion"), stop.stopped
    ('Friday', ' at 3.', '', True)
    >>> stop.text
    'Friday at 3.'
    >>> raw = StopStringFilter(["\\n"], strip=False)
    >>> raw.feed(" Friday "), raw.feed("\\nQuestion"), raw.text
    (' Friday ', '', ' Friday ')
    """

    def __init__(self, stop: str | Sequence[str], *, strip: bool = True) -> None:
        self._stop = list(stop_strings([s for s in ((stop,) if isinstance(stop, str) else stop) if s]))
        self._strip = strip
        self._held = ""
        self._started = not strip
        self.text = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add generated text; return what may be shown now."""
        if self.stopped:
            return ""
        held = self._held + piece
        if not self._started:
            held = held.lstrip()
            self._started = bool(held)
        cut = min((held.find(s) for s in self._stop if s in held), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(held[:cut].rstrip() if self._strip else held[:cut])
        keep = 0
        for s in self._stop:
            for length in range(min(len(s) - 1, len(held)), 0, -1):
                if held.endswith(s[:length]):
                    keep = max(keep, length)
                    break
        self._held = held[len(held) - keep :] if keep else ""
        return self._emit(held[: len(held) - keep])

    def finish(self) -> str:
        """End of generation: release anything held back."""
        if self.stopped:
            return ""
        rest, self._held = (self._held.rstrip() if self._strip else self._held), ""
        return self._emit(rest)

    def _emit(self, text: str) -> str:
        self.text += text
        return text
