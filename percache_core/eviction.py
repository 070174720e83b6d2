"""One eviction policy for both tiers: least frequently used, ties to least recently used.

The policy keeps the items that may be evicted now in a set (leaves of the chunk-state
tree that no query pins; any QA entry but the one being written). An eviction round puts
that set in a heap once and pops victims from it; an item that becomes evictable during the
round (a parent whose last child went) joins the heap, so every victim is the least used
evictable item at its moment, as a rescan would find, without rescanning. Items are the tiers' own records
(:class:`~percache_core.kv.tree.StateNode`, :class:`~percache_core.types.QAEntry`); the
policy reads and counts their ``hits`` and ``last_used_at``.

>>> from dataclasses import dataclass
>>> @dataclass
... class Item:
...     hits: int = 0
...     last_used_at: float = 0.0
>>> policy = LFUPolicy()
>>> policy.add("a", Item()); policy.add("b", Item()); policy.add("c", Item())
>>> policy.touch("a"); policy.touch("a"); policy.touch("c")
>>> policy.set_evictable("b", False)
>>> evicted = []
>>> policy.evict(lambda: len(evicted) < 2, lambda key: (evicted.append(key), policy.remove(key)))
>>> evicted
['c', 'a']
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class Usage(Protocol):
    """What the policy reads and counts on an item."""

    hits: int
    last_used_at: float


ItemT = TypeVar("ItemT", bound=Usage)


class LFUPolicy(Generic[ItemT]):
    """Use counts and the evictable set of one tier (callers hold the tier's lock)."""

    def __init__(self) -> None:
        self._items: dict[str, ItemT] = {}
        self._evictable: set[str] = set()
        self._heap: list[tuple[Any, ...]] | None = None  # during an eviction round

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: str, item: ItemT, *, evictable: bool = True) -> None:
        """Track *item* under *key* (replacing what was there)."""
        self._items[key] = item
        self.set_evictable(key, evictable)

    def remove(self, key: str) -> None:
        self._items.pop(key, None)
        self._evictable.discard(key)

    def set_evictable(self, key: str, evictable: bool) -> None:
        """Whether *key* may be chosen as a victim now."""
        if evictable and key in self._items:
            if key not in self._evictable and self._heap is not None:
                heapq.heappush(self._heap, self._rank(key))
            self._evictable.add(key)
        else:
            self._evictable.discard(key)

    def touch(self, key: str) -> None:
        """Count one use of *key* now."""
        item = self._items.get(key)
        if item is not None:
            item.hits += 1
            item.last_used_at = time.time()

    def evict(self, over_budget: Callable[[], bool], remove: Callable[[str], None]) -> None:
        """While ``over_budget()``, call ``remove(key)`` on the evictable key used least
        often (least recently among equals); *remove* must take the key out of the policy
        (the tier's own removal does). Stops when nothing is evictable."""
        heap = [self._rank(key) for key in self._evictable]
        heapq.heapify(heap)
        self._heap = heap
        try:
            while heap and over_budget():
                key = heapq.heappop(heap)[-1]
                if key in self._evictable:  # else pinned or gone since it was pushed
                    remove(key)
        finally:
            self._heap = None

    def _rank(self, key: str) -> tuple[int, float, str]:
        item = self._items[key]
        return (item.hits, item.last_used_at, key)
