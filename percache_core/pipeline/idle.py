"""The idle-work verbs of :class:`~percache_core.pipeline.PerCache`: one round now
(``warm``), and the background worker (``start_worker``, ``stop_worker``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..answering.parts import CacheParts
from ..answering.request_path import RequestPath
from ..prediction.idle_round import WarmOptions
from ..prediction.scheduler import Scheduler, WarmReport
from ..prediction.worker import IdleWorker


class IdleVerbs:
    """``warm``, ``start_worker`` and ``stop_worker``."""

    _parts: CacheParts
    _request_path: RequestPath
    _scheduler: Scheduler
    _worker: IdleWorker | None
    _ensure_open: Callable[[], None]

    def warm(
        self,
        *,
        max_seconds: float | None = None,
        max_predictions: int | None = None,
        knowledge_prediction: bool = True,
        progress: bool = True,
        should_stop: Callable[[], bool] | None = None,
        answer: Callable[[str], bool] | None = None,
    ) -> WarmReport:
        """Run one idle round now, its eight steps in order (see
        :mod:`percache_core.prediction.scheduler`): predicted paths, the knowledge
        abstract, stale answers refreshed, follow-ups answered, prediction and population
        (``max_predictions`` per view, default ``prediction_stride``), the bulk knowledge
        prefill, conversions, calibration.

        Args:
            max_seconds: the round stops after this long (between steps).
            max_predictions: questions predicted per view (knowledge, history).
            knowledge_prediction: also predict from the knowledge abstract (else from the
                recent questions only).
            progress: show a progress bar.
            should_stop: asked between segments and tokens; the round stops when it turns
                true.
            answer: question -> whether an answer was stored: the app's own pipeline
                answers the predicted questions.

        Returns:
            What the round did (:class:`~percache_core.prediction.scheduler.WarmReport`).

        A user question pre-empts it (``report.preempted``). With *answer* (question ->
        whether an answer was stored), predicted questions are answered by the caller's own
        pipeline and the round only summarises and predicts (see ``Scheduler.warm``).

        >>> report = pc.warm(max_seconds=60)   # doctest: +SKIP
        >>> report.predicted                   # doctest: +SKIP
        ['When is the launch talk?', ...]
        """
        self._ensure_open()
        return self._scheduler.warm(WarmOptions(max_seconds, max_predictions, knowledge_prediction, progress, should_stop, answer))

    def start_worker(
        self,
        *,
        idle_after_s: float | None = None,
        should_run: Callable[[], bool] | None = None,
        round_seconds: float | None = 60.0,
        answer: Callable[[str], bool] | None = None,
    ) -> IdleWorker:
        """Start the background worker: idle rounds (see :meth:`warm`) while no question
        is asked. One worker per cache; a user's question pre-empts a round at once.

        Args:
            idle_after_s: seconds without a question before a round (default:
                ``idle_after_s`` of the config).
            should_run: asked before each round (e.g. "on mains power").
            round_seconds: the longest round.
            answer: as in :meth:`warm` (an app's own pipeline answers the predictions).

        Returns:
            The running :class:`~percache_core.prediction.worker.IdleWorker`.

        >>> pc.start_worker(idle_after_s=30)   # doctest: +SKIP
        """
        self._ensure_open()
        if self._worker is not None and self._worker.running:
            return self._worker
        self._worker = IdleWorker(
            self._scheduler,
            idle_after_s=self.config.idle.idle_after_s if idle_after_s is None else idle_after_s,
            should_run=should_run,
            round_seconds=round_seconds,
            answer=answer,
        ).start()
        return self._worker

    def stop_worker(self) -> None:
        """Stop the background worker, if any (the round it runs ends first).

        >>> pc.stop_worker()   # doctest: +SKIP
        """
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
