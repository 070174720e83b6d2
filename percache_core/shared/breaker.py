"""A circuit breaker: after repeated failures, stop calling for a while (local-only mode)."""

from __future__ import annotations

import threading
import time


class CircuitBreaker:
    """Closed (calls go through) until ``threshold`` failures in a row; then open (calls
    are skipped) for ``cooldown_s``; then one trial call decides.

    >>> breaker = CircuitBreaker(threshold=2, cooldown_s=60)
    >>> breaker.failure(); breaker.failure(); breaker.allow()
    False
    """

    def __init__(self, *, threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._failures = 0
        self._opened_at: float | None = None
        self._lock = threading.Lock()
        self.trips = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "open" if time.monotonic() - self._opened_at < self.cooldown_s else "half-open"

    def allow(self) -> bool:
        return self.state != "open"

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures >= self.threshold and (
                self._opened_at is None or time.monotonic() - self._opened_at >= self.cooldown_s
            ):
                self._opened_at = time.monotonic()
                self.trips += 1
