"""Storing a run's new chunk states off the answer's time.

A run's new states are taken from the engine while it still holds the prompt (that part
must come before anything else changes the sequence), but writing them (a file and its
digest, a record, the eviction they cause) needs only the bytes. A runner hands that
work to its :class:`StateWriter`, so the answer reaches the app first; the runner's next
use of the stored states waits for it (:meth:`StateWriter.flush`), so no lookup ever
misses a state an earlier run took.

>>> writer = StateWriter("example")
>>> stored = []
>>> writer.submit(lambda: stored.append("state"))
>>> writer.flush(); stored
['state']
>>> writer.close()
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class StateWriter:
    """One writer thread (started on the first :meth:`submit`) that runs one store at a
    time; a store's error is raised by the :meth:`flush` that waits for it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def submit(self, store: Callable[[], None]) -> None:
        """Run *store* in the writer thread, after the stores handed before it."""
        self.flush()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        self._pending = self._executor.submit(store)

    def flush(self) -> None:
        """Wait until the stores handed so far have run (from any thread: each waits)."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if self._pending is pending:  # done with: forgotten
                self._pending = None

    def close(self) -> None:
        """Run what is pending and stop the thread (idempotent)."""
        self.flush()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
