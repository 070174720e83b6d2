"""Small fakes for tests of pure logic (the real model and embedder are fixtures in conftest)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np


class HashingEmbedder:
    """Bag-of-words vectors (each lower-cased word hashed to one of ``dimension`` slots),
    unit length: texts sharing words are similar, others nearly orthogonal."""

    name = "test-hashing-embedder"

    def __init__(self, dimension: int = 64) -> None:
        self.dimension = dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, text in zip(rows, texts):
            for word in re.findall(r"\w+", text.lower()):
                slot = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little")
                row[slot % self.dimension] += 1.0
            norm = np.linalg.norm(row)
            row /= norm if norm else 1.0
            if not norm:
                row[0] = 1.0
        return rows
