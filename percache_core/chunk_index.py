"""What hybrid retrieval reads: the chunks in rows, their embeddings as one matrix, BM25
postings and metadata lookups, all growing by appends (a personal corpus is mostly added to).

A question costs one matrix-vector product, the BM25 postings of its words and two
partial sorts; nothing scans the chunks in Python. Rankings are the ones of a full stable
sort (ties go to the earlier row), so the order does not depend on how the index was
built.

>>> from percache_core.types import Chunk
>>> index = ChunkIndex()
>>> index.append(
...     [Chunk("a#c000", "a", "Rehearsal on Thursday.", {"thread": "t1"}), Chunk("b#c000", "b", "Budget.", {})],
...     np.eye(2, dtype=np.float32),
... )
>>> [index.chunks[row].id for row, _ in index.search(["rehearsal"], np.array([1.0, 0.0]), 1)]
['a#c000']
>>> index.search(["budget"], np.array([0.0, 1.0]), 2, where={"thread": "t1"})[0][0]
0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .bm25 import BM25Index, bm25_tokens
from .types import Chunk


def top_rows(values: np.ndarray, count: int) -> np.ndarray:
    """The rows of the *count* largest *values*, largest first, ties in row order: the same
    as ``np.argsort(-values, kind="stable")[:count]`` without sorting every row.

    >>> top_rows(np.array([0.5, 0.9, 0.5, 0.1, 0.5]), 3).tolist()
    [1, 0, 2]
    """
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    if count >= values.shape[0]:
        return np.argsort(-values, kind="stable")
    threshold = values[np.argpartition(-values, count - 1)[count - 1]]
    above = np.flatnonzero(values > threshold)
    ties = np.flatnonzero(values == threshold)[: count - above.shape[0]]
    rows = np.concatenate([above, ties])
    return rows[np.lexsort((rows, -values[rows]))]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = 60) -> dict[int, float]:
    """Fuse rankings (lists of item indices, best first) into one score per item.

    >>> scores = reciprocal_rank_fusion([[2, 0], [0, 1]], k=1)
    >>> sorted(scores, key=lambda i: -scores[i])
    [0, 2, 1]
    """
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking):
            fused[item] = fused.get(item, 0.0) + 1.0 / (k + rank + 1)
    return fused


_UNHASHABLE = object()  # rows whose value of a field cannot be a dict key (lists, dicts)


class ChunkIndex:
    """Chunks in rows with their embeddings, BM25 postings and metadata lookups. Not
    thread-safe by itself (the knowledge bank holds its lock)."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self._rows: dict[str, int] = {}  # chunk id -> row
        self._matrix = np.zeros((0, 0), dtype=np.float32)
        self._bm25 = BM25Index()
        self._fields: dict[str, dict[Any, list[int]]] = {}  # metadata field -> value -> rows

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def dimension(self) -> int | None:
        return self._matrix.shape[1] if self.chunks else None

    @property
    def matrix(self) -> np.ndarray:
        """The embeddings, one row per chunk (a view: do not change it)."""
        return self._matrix[: len(self.chunks)]

    def row(self, chunk_id: str) -> int | None:
        return self._rows.get(chunk_id)

    def append(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> None:
        """Add *chunks* with their embedding rows (all of this index's dimension)."""
        if not chunks:
            return
        vectors = np.asarray(vectors, dtype=np.float32)
        count = len(self.chunks)
        if count == 0:
            self._matrix = np.zeros((max(16, len(chunks)), vectors.shape[1]), dtype=np.float32)
        elif vectors.shape[1] != self._matrix.shape[1]:
            raise ValueError(f"embeddings of {vectors.shape[1]} values, this index holds {self._matrix.shape[1]}")
        needed = count + len(chunks)
        if needed > self._matrix.shape[0]:
            grown = np.zeros((max(needed, 2 * self._matrix.shape[0]), self._matrix.shape[1]), dtype=np.float32)
            grown[:count] = self._matrix[:count]
            self._matrix = grown
        self._matrix[count:needed] = vectors
        for row, chunk in enumerate(chunks, start=count):
            self._rows[chunk.id] = row
            for field, values in self._fields.items():
                _index_value(values, chunk.metadata.get(field), row)
        self.chunks.extend(chunks)
        self._bm25.add([bm25_tokens(chunk.text) or ["_"] for chunk in chunks])

    def scope_rows(self, where: Mapping[str, Any]) -> set[int]:
        """The rows whose chunk metadata has every key/value pair of *where*."""
        keep: set[int] | None = None
        for field, value in where.items():
            rows = self._field_rows(field, value)
            keep = rows if keep is None else keep & rows
            if not keep:
                return set()
        return keep if keep is not None else set(range(len(self.chunks)))

    def _field_rows(self, field: str, value: Any) -> set[int]:
        """Rows whose metadata value of *field* equals *value* (a missing field is None)."""
        if not _hashable(value):
            return {row for row, chunk in enumerate(self.chunks) if chunk.metadata.get(field) == value}
        values = self._fields.get(field)
        if values is None:
            values = self._fields[field] = {}
            for row, chunk in enumerate(self.chunks):
                _index_value(values, chunk.metadata.get(field), row)
        found = set(values.get(value, ()))
        found.update(row for row in values.get(_UNHASHABLE, ()) if self.chunks[row].metadata.get(field) == value)
        return found

    def search(
        self,
        words: Sequence[str],
        embedding: np.ndarray,
        k: int,
        *,
        where: Mapping[str, Any] | None = None,
        rrf_k: int = 60,
    ) -> list[tuple[int, float]]:
        """The *k* best rows for a question with BM25 *words* and *embedding* (a unit
        vector), and their fused scores, best first: the dense and BM25 rankings of the
        best ``max(4k, 20)`` rows each, restricted to *where*, fused by reciprocal rank."""
        count = len(self.chunks)
        if count == 0:
            return []
        pool = min(count, max(4 * k, 20))
        dense = self.matrix @ np.asarray(embedding, dtype=np.float32)
        rankings = [top_rows(dense, pool).tolist()]
        if words:
            sparse = self._bm25.scores(words)
            rankings.append([row for row in top_rows(sparse, pool).tolist() if sparse[row] > 0])
        if where:
            keep = self.scope_rows(where)
            rankings = [[row for row in ranking if row in keep] for ranking in rankings]
            if not rankings[0]:  # none of the pool matched: rank every matching chunk
                rankings = [sorted(keep, key=lambda row: -dense[row])]
        fused = reciprocal_rank_fusion(rankings, k=rrf_k)
        best = sorted(fused, key=lambda row: (-fused[row], row))[:k]
        return [(row, fused[row]) for row in best]



def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _index_value(values: dict[Any, list[int]], value: Any, row: int) -> None:
    values.setdefault(value if _hashable(value) else _UNHASHABLE, []).append(row)
