"""Prefixes that a run in one slot is computing now and will store soon, so that a run in
another slot whose prompt starts with the same tokens waits for that state and restores it
instead of prefilling the same tokens beside it (prefix-aware order on a batch-invariant
server, where what a batched run computes is kept).

The claims are read and changed under the runner's store lock; a waiter waits outside it.

>>> claims = PrefixClaims()
>>> claims.claim("k1", 640)
True
>>> claims.claim("k1", 640)   # one run computes a prefix
False
>>> claims.lengths(), claims.awaited({"k1": 640}, deeper_than=0) is not None
([640], True)
>>> claims.awaited({"k1": 640}, deeper_than=640) is None    # nothing deeper than a stored state
True
>>> claims.release(["k1"]); claims.lengths()
[]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

WAIT_POLL_S = 0.05  # how often a waiter checks whether its client went away


class PrefixClaims:
    """State keys that a run is computing, each with its length in tokens and the event
    set once its state is stored or the run gave up on it (see the module)."""

    def __init__(self) -> None:
        self._claims: dict[str, tuple[int, threading.Event]] = {}

    def claim(self, key: str, n_tokens: int) -> bool:
        """Say that a run computes the state *key* (*n_tokens* long) and stores it soon;
        False when another run already does."""
        if key in self._claims:
            return False
        self._claims[key] = (n_tokens, threading.Event())
        return True

    def lengths(self) -> list[int]:
        """The lengths of the prefixes claimed now, ascending."""
        return sorted({n for n, _ in self._claims.values()})

    def awaited(self, candidates: Mapping[str, int], *, deeper_than: int) -> threading.Event | None:
        """The event of the deepest claimed state among *candidates* (key -> tokens, the
        prefixes a prompt may go on from) that holds more than *deeper_than* tokens, or None."""
        found = [(n, self._claims[key][1]) for key, n in candidates.items() if key in self._claims and n > deeper_than]
        return max(found, key=lambda pair: pair[0])[1] if found else None

    def release(self, keys: Iterable[str]) -> None:
        """The states of *keys* are stored, or will not be: their waiters go on."""
        for key in keys:
            claimed = self._claims.pop(key, None)
            if claimed is not None:
                claimed[1].set()


def wait_for(event: threading.Event, should_stop: Callable[[], bool] | None, timeout_s: float) -> bool:
    """Wait until *event* is set (True), *should_stop* says stop, or *timeout_s* passed.

    >>> done = threading.Event(); done.set()
    >>> wait_for(done, None, 1.0), wait_for(threading.Event(), lambda: True, 5.0)
    (True, False)
    """
    deadline = time.monotonic() + timeout_s
    while not event.wait(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline or (should_stop is not None and should_stop()):
            return False
    return True
