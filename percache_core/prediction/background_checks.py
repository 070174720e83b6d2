"""The engine's self-checks in the background, for flows that run no idle round.

Until the cut rule and the state layout are known, answers keep and restore no chunk state
(see :meth:`~percache_core.answering.runtime.ModelRuntime.runner`). An idle round
(``warm``, the worker) or ``preload()`` runs the checks first; an app that only asks
(``PerCache.open`` + ``answer``, a LlamaIndex or LangChain app without ``warm()``) would
never run them. So the first answer that finds them pending starts a
:class:`BackgroundChecks` thread: it waits until no question has been asked for
``QUIET_SECONDS`` and none waits, then runs the pending checks as idle work. A user's
question pre-empts the running check between two engine calls (at most one batch of the
check's prefill, under a second on 2 cores), nothing of it is kept, and the thread waits
for the next quiet period; once the verdicts are known (here, in an idle round or in
another process), it ends.
"""

from __future__ import annotations

import logging
import threading

from ..answering.runtime import ModelRuntime
from ..errors import Preempted
from ..serving.activity import UserActivity

logger = logging.getLogger(__name__)

QUIET_SECONDS = 2.0  # no question for this long (a script asking back to back is never pre-empted)


class BackgroundChecks:
    """A daemon thread that runs *runtime*'s pending self-checks in the quiet periods of
    *activity* (see the module).

    >>> checks = BackgroundChecks(runtime, activity)   # doctest: +SKIP
    >>> checks.start(); checks.wait(timeout=120)        # doctest: +SKIP
    True
    """

    def __init__(
        self, runtime: ModelRuntime, activity: UserActivity, *, quiet_seconds: float = QUIET_SECONDS, poll_s: float = 0.2
    ) -> None:
        self._runtime = runtime
        self._activity = activity
        self.quiet_seconds = quiet_seconds
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.preemptions = 0
        self.errors = 0

    def start(self) -> None:
        """Start the thread unless it runs, was stopped or gave up on an error (idempotent,
        cheap: the runtime calls it whenever it answers before the checks)."""
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._loop, name="percache-self-checks", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has ended (the checks known, or stopped); whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.running

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread (a running check is pre-empted) and wait for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout)

    def _should_stop(self) -> bool:
        return self._stop.is_set() or self._activity.waiting()

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            if not self._activity.quiet(self.quiet_seconds):
                continue
            try:
                self._runtime.self_check(self._should_stop)  # those known by now are skipped
                return
            except Preempted:
                self.preemptions += 1
            except Exception:  # keep answering as stock does; the error is logged, once
                self.errors += 1
                logger.exception("the engine's self-checks failed")
                self._stop.set()  # not started again by the next answer
                return
