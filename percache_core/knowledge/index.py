"""What hybrid retrieval reads: the chunks in rows, their embeddings in blocks of rows, BM25
postings and metadata lookups, all growing by appends (a personal corpus is mostly added to).

A question costs one matrix-vector product per block, the BM25 postings of its words and two
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

from ..types import Chunk
from .bm25 import BM25Index, bm25_tokens


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


BLOCK_ROWS = 8192  # embeddings per block
_UNHASHABLE = object()  # rows whose value of a field cannot be a dict key (lists, dicts)


class ChunkIndex:
    """Chunks in rows with their embeddings, BM25 postings and metadata lookups. Not
    thread-safe by itself (the knowledge bank holds its lock)."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self._rows: dict[str, int] = {}  # chunk id -> row
        self._blocks: list[np.ndarray] = []  # embeddings, BLOCK_ROWS rows each (the last one filling)
        self._dimension: int | None = None
        self._bm25 = BM25Index()
        self._fields: dict[str, dict[Any, list[int]]] = {}  # metadata field -> value -> rows

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def dimension(self) -> int | None:
        return self._dimension if self.chunks else None

    @property
    def matrix(self) -> np.ndarray:
        """The embeddings, one row per chunk (a copy)."""
        if not self.chunks:
            return np.zeros((0, self._dimension or 0), dtype=np.float32)
        return np.concatenate(self._filled_blocks())

    def vector(self, row: int) -> np.ndarray:
        """The embedding of *row* (a view: do not change it)."""
        return self._blocks[row // BLOCK_ROWS][row % BLOCK_ROWS]

    def dense_scores(self, embedding: np.ndarray) -> np.ndarray:
        """The dot product of every row's embedding with *embedding* (block by block:
        the embeddings grow without ever being copied whole)."""
        vector = np.asarray(embedding, dtype=np.float32)
        return np.concatenate([block @ vector for block in self._filled_blocks()])

    def _filled_blocks(self) -> list[np.ndarray]:
        used = len(self.chunks) - (len(self._blocks) - 1) * BLOCK_ROWS
        return [*self._blocks[:-1], self._blocks[-1][:used]] if self._blocks else []

    def row(self, chunk_id: str) -> int | None:
        return self._rows.get(chunk_id)

    def append(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> None:
        """Add *chunks* with their embedding rows (all of this index's dimension)."""
        if not chunks:
            return
        vectors = np.asarray(vectors, dtype=np.float32)
        count = len(self.chunks)
        if count == 0:
            self._dimension, self._blocks = vectors.shape[1], []
        elif vectors.shape[1] != self._dimension:
            raise ValueError(f"embeddings of {vectors.shape[1]} values, this index holds {self._dimension}")
        self._write_vectors(count, vectors)
        for row, chunk in enumerate(chunks, start=count):
            self._rows[chunk.id] = row
            for field, values in self._fields.items():
                _index_value(values, chunk.metadata.get(field), row)
        self.chunks.extend(chunks)
        self._bm25.add([bm25_tokens(chunk.text) or ["_"] for chunk in chunks])

    def _write_vectors(self, start: int, vectors: np.ndarray) -> None:
        """Put *vectors* at rows *start*... (adding blocks as needed; a small index keeps a
        small block)."""
        done = 0
        while done < len(vectors):
            row = start + done
            block, offset = divmod(row, BLOCK_ROWS)
            if block == len(self._blocks):
                self._blocks.append(np.zeros((0, self._dimension), dtype=np.float32))
            take = min(len(vectors) - done, BLOCK_ROWS - offset)
            current = self._blocks[block]
            if current.shape[0] < offset + take:  # a filling block grows up to BLOCK_ROWS rows
                grown = np.zeros((min(BLOCK_ROWS, max(offset + take, 2 * current.shape[0])), self._dimension), dtype=np.float32)
                grown[:offset] = current[:offset]
                current = self._blocks[block] = grown
            current[offset : offset + take] = vectors[done : done + take]
            done += take

    def packed(self) -> dict[str, Any]:
        """The whole index as arrays and plain lists (for :meth:`from_packed`)."""
        return {
            "chunks": [[c.id, c.doc_id, c.text, c.metadata] for c in self.chunks],
            "blocks": self._filled_blocks(),
            "bm25": self._bm25.packed(),
        }

    @classmethod
    def from_packed(
        cls, chunks: Sequence[Sequence[Any]], blocks: Sequence[np.ndarray], bm25: Mapping[str, Any]
    ) -> ChunkIndex:
        """The index :meth:`packed` described, without tokenizing the texts again
        (ValueError when the parts disagree)."""
        index = cls()
        index.chunks = [Chunk(str(i), str(d), str(t), dict(m or {})) for i, d, t, m in chunks]
        index._rows = {chunk.id: row for row, chunk in enumerate(index.chunks)}
        index._bm25 = BM25Index.from_packed(bm25["words"], bm25["offsets"], bm25["rows"], bm25["counts"], bm25["lengths"])
        rows = sum(block.shape[0] for block in blocks)
        dimensions = {block.shape[1] for block in blocks if block.ndim == 2}
        fits = len(dimensions) == 1 and all(block.ndim == 2 for block in blocks)
        if not fits or not rows == len(index.chunks) == len(index._bm25) == len(index._rows):
            raise ValueError("an index whose chunks, embeddings and postings do not fit together")
        index._dimension = dimensions.pop()
        start = 0
        for block in blocks:
            whole = start % BLOCK_ROWS == 0 and block.shape[0] == BLOCK_ROWS and block.dtype == np.float32
            if whole and block.flags.c_contiguous and block.flags.writeable:
                index._blocks.append(block)  # taken as it is, not copied
            else:
                index._write_vectors(start, np.asarray(block, dtype=np.float32))
            start += block.shape[0]
        return index

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
        dense_only: bool = False,
    ) -> list[tuple[int, float]]:
        """The *k* best rows for a question with BM25 *words* and *embedding* (a unit
        vector), and their fused scores, best first: the dense and BM25 rankings of the
        best ``max(4k, 20)`` rows each, restricted to *where*, fused by reciprocal rank.
        With *dense_only*, the dense ranking alone and its scores (a plain vector store's)."""
        count = len(self.chunks)
        if count == 0:
            return []
        pool = min(count, max(4 * k, 20))
        dense = self.dense_scores(embedding)
        if dense_only:
            keep = self.scope_rows(where) if where else None
            ranked = top_rows(dense, count if keep is not None else k).tolist()
            return [(row, float(dense[row])) for row in ranked if keep is None or row in keep][:k]
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
