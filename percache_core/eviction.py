"""One eviction policy for both tiers: least frequently used, ties to least recently used.

The policy keeps the items that may be evicted now in a set (leaves of the chunk-state
tree that no query pins; any QA entry but the one being written), so choosing a victim
looks at those only and never rescans the whole tier. Items are the tiers' own records
(:class:`~percache_core.kv.tree.StateNode`, :class:`~percache_core.types.QAEntry`); the
policy reads and counts their ``hits`` and ``last_used_at``.

>>> from dataclasses import dataclass
>>> @dataclass
... class Item:
...     hits: int = 0
...     last_used_at: float = 0.0
>>> policy = LFUPolicy()
>>> policy.add("a", Item()); policy.add("b", Item())
>>> policy.touch("a")
>>> policy.victim()
'b'
>>> policy.set_evictable("b", False)
>>> policy.victim()
'a'
"""

from __future__ import annotations

import time
from typing import Generic, Protocol, TypeVar


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
            self._evictable.add(key)
        else:
            self._evictable.discard(key)

    def touch(self, key: str) -> None:
        """Count one use of *key* now."""
        item = self._items.get(key)
        if item is not None:
            item.hits += 1
            item.last_used_at = time.time()

    def victim(self) -> str | None:
        """The evictable key used least often (least recently among equals), or None."""
        if not self._evictable:
            return None
        items = self._items
        return min(self._evictable, key=lambda k: (items[k].hits, items[k].last_used_at, k))
