"""Eviction: which records a tier gives up first when it is over its byte budget.

Both tiers keep their records in a :class:`~percache_core.storage.Store` (QA entries and
prompt answers in the QA bank's, chunk-state nodes in the states'), and one policy object
orders them for eviction there, inside the writing transaction, over what every process
stored. Uses are counted where they happen (a QA hit, a restored state, an identical
prompt answered) with :class:`UseCounts` and added up in the store, so the counts of
several processes on one folder add up.

>>> LFU.name, LRU.name
('lfu', 'lru')
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

# a record that others name as their parent (a chunk state with deeper states) goes after
# every leaf: evicting it first would strand its children
_LEAVES_FIRST = "EXISTS (SELECT 1 FROM records AS c WHERE c.parent = r.key)"


@dataclass(frozen=True)
class EvictionPolicy:
    """An eviction order: *order_by* is SQL over the store's ``records`` table (aliased
    ``r``; columns ``key``, ``hits``, ``last_used``, ``size``), first evicted first."""

    name: str
    order_by: str


LFU = EvictionPolicy("lfu", f"{_LEAVES_FIRST}, hits, last_used, key")
"""Least frequently used first (ties: least recently used): the seeds' policy, the default."""

LRU = EvictionPolicy("lru", f"{_LEAVES_FIRST}, last_used, key")
"""Least recently used first."""


class UseCounts:
    """Uses noted since they were last written: key -> (uses, last use time).

    >>> counts = UseCounts()
    >>> counts.note("qa:1", when=5.0); counts.note("qa:1", when=7.0)
    >>> counts.take()
    {'qa:1': (2, 7.0)}
    >>> counts.take()
    {}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uses: dict[str, tuple[int, float]] = {}

    def note(self, key: str, when: float | None = None) -> None:
        """Count one use of *key* at *when* (default: now)."""
        moment = time.time() if when is None else when
        with self._lock:
            uses, last = self._uses.get(key, (0, 0.0))
            self._uses[key] = (uses + 1, max(last, moment))

    def take(self) -> dict[str, tuple[int, float]]:
        """The uses noted so far, and start counting afresh."""
        with self._lock:
            uses, self._uses = self._uses, {}
        return uses
