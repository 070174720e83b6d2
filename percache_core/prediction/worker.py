"""The background worker: runs idle rounds when no question came for a while.

A round starts only after ``idle_after_s`` seconds without user activity, only while the
optional ``should_run()`` predicate allows (on a charger, say), and only when the
scheduler has work. A user's question pre-empts a running round between segments or
tokens; the worker then waits for the next quiet period.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .idle_round import WarmOptions
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


class IdleWorker:
    """A daemon thread that runs the scheduler's idle rounds in quiet periods.

    >>> worker = pc.start_worker(idle_after_s=30, should_run=lambda: on_charger())  # doctest: +SKIP
    >>> pc.stop_worker()                                                            # doctest: +SKIP
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        idle_after_s: float,
        should_run: Callable[[], bool] | None = None,
        poll_s: float = 0.2,
        round_seconds: float | None = 60.0,
        answer: Callable[[str], bool] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._answer = answer  # predicted questions go to the caller's pipeline (Scheduler.warm)
        self._activity = scheduler.activity  # the user's questions, which it waits out
        self.idle_after_s = idle_after_s
        self._should_run = should_run or (lambda: True)
        self._poll_s = poll_s
        self._round_seconds = round_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="percache-idle", daemon=True)
        self.rounds = 0
        self.errors = 0
        self._idle_since: float | None = None  # last activity before a round that did nothing
        self.busy = threading.Event()

    def start(self) -> IdleWorker:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Ask the worker to stop and wait for it (a running round stops at its next check)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                if self._idle_since == self._activity.last_activity:
                    continue  # the last round found nothing to do and nothing happened since
                if not (self._activity.quiet(self.idle_after_s) and self._should_run()):
                    continue
                if not self._scheduler.has_work(self._answer is None):
                    # nothing to do until something happens: has_work is not polled meanwhile
                    self._idle_since = self._activity.last_activity
                    continue
                self.busy.set()
                try:
                    report = self._scheduler.warm(WarmOptions(
                        max_seconds=self._round_seconds,
                        progress=False,
                        should_stop=lambda: (
                            self._stop.is_set() or self._activity.waiting() or not self._should_run()
                        ),
                        answer=self._answer,
                    ))
                finally:
                    self.busy.clear()
                self.rounds += 1
                did_nothing = not (report.prefill_tokens or report.decode_tokens or report.preempted)
                self._idle_since = self._activity.last_activity if did_nothing else None
            except Exception:  # keep the worker alive; the error is logged
                self.errors += 1
                logger.exception("idle round failed")
                self._stop.wait(max(self.idle_after_s, 1.0))
