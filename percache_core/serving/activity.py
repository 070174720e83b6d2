"""User activity: who is waiting for the model, when the last question came, and what
users asked (the history that idle prediction and follow-ups work from).

The request path records here; the scheduler and the idle worker read here. Neither side
needs the other.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..qa.bank import normalized_question
from ..types import QAHit

R = TypeVar("R")

FOLLOWUPS_KEPT = 256
ASKED_KEPT = 32  # retrieved paths of recent questions (what the demand estimate learns from)


MAX_HISTORY_CHARS = 600  # longer than any question a person types into an assistant


@dataclass(frozen=True)
class AskedQuestion:
    """A user's question as retrieval answered it: its text, embedding, scope and the
    chunk ids retrieved for its prompt, in prompt order."""

    text: str
    embedding: np.ndarray | None  # None: a repeat answered before embedding (idle work embeds it)
    scope: dict[str, Any] | None
    chunk_ids: tuple[str, ...]


@dataclass(frozen=True)
class FollowUp:
    """A user's question that was served another question's stored answer: idle work
    answers it on its own prompt (so it gets its own entry) and checks what was served."""

    question: str
    embedding: np.ndarray
    scope: dict[str, Any] | None
    served: QAHit  # the entry served and its similarity


class UserActivity:
    """Waiting users, the time of the last activity, and recent questions.

    >>> activity = UserActivity(history_size=8)
    >>> with activity.user_turn():
    ...     activity.waiting()
    True
    >>> activity.waiting()
    False
    """

    def __init__(self, *, history_size: int) -> None:
        self._lock = threading.Lock()
        self._waiting = 0
        self.last_activity = time.monotonic()
        self.history: deque[str] = deque(maxlen=history_size)
        self.new_history = 0  # questions recorded since history prediction last ran
        self.history_scope: dict[str, Any] | None = None  # scope of the latest question
        self.asked: deque[AskedQuestion] = deque(maxlen=ASKED_KEPT)
        self.asked_total = 0  # questions ever put in ``asked`` (to tell which are new)
        # questions that were served another question's answer: (question, embedding, scope)
        self.followups: deque[FollowUp] = deque(maxlen=FOLLOWUPS_KEPT)
        # the idle round's stop check while it runs a caller's pipeline (see background())
        self._background: ContextVar[Callable[[], bool] | None] = ContextVar(
            f"percache_background_{id(self)}", default=None
        )

    @contextmanager
    def background(self, should_stop: Callable[[], bool]) -> Iterator[None]:
        """Calls into this cache within this block (and streams started in it) are idle
        work, not a user's: they mark no activity, count as no answer, and their model runs
        raise ``Preempted`` when *should_stop()* turns true (a user's question waits).
        Idle rounds hand predicted questions to a caller's pipeline inside it.

        >>> activity = UserActivity(history_size=8)
        >>> with activity.background(lambda: False):
        ...     with activity.user_turn():
        ...         activity.waiting()
        False
        """
        token = self._background.set(should_stop)
        try:
            yield
        finally:
            self._background.reset(token)

    def background_stop(self) -> Callable[[], bool] | None:
        """Inside :meth:`background`, the idle round's stop check; None in a user's call."""
        return self._background.get()

    @contextmanager
    def user_turn(self) -> Iterator[None]:
        """Mark a user's question as waiting (idle work yields the model to it); nothing
        inside :meth:`background`."""
        if self.background_stop() is not None:
            yield
            return
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
            self.touch()

    def in_user_turn(self, events: Generator[str, None, R]) -> Generator[str, None, R]:
        """*events* (a lazily started answer) run as a user's turn (:meth:`user_turn`), from
        its first step to its end, in whichever thread consumes it."""
        with self.user_turn():
            return (yield from events)

    def waiting(self) -> bool:
        """True while a user's question is waiting for or using the model."""
        return self._waiting > 0

    def touch(self) -> None:
        """Note user activity now (idle work waits for a quiet period after it); nothing
        inside :meth:`background`."""
        if self.background_stop() is None:
            self.last_activity = time.monotonic()

    def quiet(self, seconds: float) -> bool:
        """Whether no user's question waits and none came for *seconds* (when idle work may
        start).

        >>> UserActivity(history_size=8).quiet(0.0)
        True
        """
        return not self.waiting() and self.quiet_for() >= seconds

    def quiet_for(self) -> float:
        """Seconds since the last user activity."""
        return time.monotonic() - self.last_activity

    def record_question(
        self,
        question: str,
        embedding: np.ndarray | None,
        hit: QAHit | None,
        scope: dict[str, Any] | None = None,
    ) -> None:
        """Remember a user question (for history prediction) and its scope; a question that
        was served another question's answer becomes a follow-up (answered in idle time).
        A text longer than ``MAX_HISTORY_CHARS`` is a whole prompt used as a key, not a
        question: it joins no history (the prediction prompt would not fit); neither does
        a predicted question inside :meth:`background`."""
        if self.background_stop() is not None:
            return
        if len(question) <= MAX_HISTORY_CHARS:
            self.history.append(question)
            self.new_history += 1
            self.history_scope = scope
        if (
            hit is not None
            and embedding is not None
            and normalized_question(hit.entry.question) != normalized_question(question)
        ):
            self.followups.append(FollowUp(question, embedding, scope, hit))

    def record_retrieval(
        self, question: str, embedding: np.ndarray | None, scope: dict[str, Any] | None, chunk_ids: Sequence[str]
    ) -> None:
        """Remember the chunks retrieved for a user's question (the demand estimate of
        :mod:`percache_core.prediction.demand` learns from them); nothing inside
        :meth:`background` (a predicted question is not the user's)."""
        if self.background_stop() is not None or len(question) > MAX_HISTORY_CHARS:
            return
        self.asked.append(AskedQuestion(question, embedding, dict(scope) if scope else None, tuple(chunk_ids)))
        self.asked_total += 1
