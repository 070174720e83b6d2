"""A Bloom filter over strings: no false negatives, a configurable false-positive rate."""

from __future__ import annotations

import hashlib
import math
import threading

import numpy as np


class BloomFilter:
    """Set membership with false positives only.

    >>> bloom = BloomFilter(capacity=1000, false_positive_rate=0.01)
    >>> bloom.add("node-1"); "node-1" in bloom, "node-2" in bloom
    (True, False)
    """

    def __init__(self, capacity: int = 100_000, false_positive_rate: float = 0.01) -> None:
        if capacity <= 0 or not 0 < false_positive_rate < 1:
            raise ValueError("capacity must be positive and false_positive_rate in (0, 1)")
        self.capacity = capacity
        self.false_positive_rate = false_positive_rate
        self.bits = max(64, int(math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2)))
        self.hashes = max(1, round(self.bits / capacity * math.log(2)))
        self._array = np.zeros((self.bits + 7) // 8, dtype=np.uint8)
        self._lock = threading.Lock()
        self.count = 0

    def _positions(self, item: str) -> list[int]:
        digest = hashlib.blake2b(item.encode("utf-8"), digest_size=16).digest()
        first, second = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1
        return [(first + i * second) % self.bits for i in range(self.hashes)]

    def add(self, item: str) -> None:
        with self._lock:
            for position in self._positions(item):
                self._array[position >> 3] |= 1 << (position & 7)
            self.count += 1

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, str):
            return False
        return all(self._array[p >> 3] & (1 << (p & 7)) for p in self._positions(item))

    def expected_false_positive_rate(self) -> float:
        """The false-positive rate for the items added so far."""
        return (1 - math.exp(-self.hashes * self.count / self.bits)) ** self.hashes
