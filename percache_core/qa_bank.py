"""The QA bank: stored questions with embeddings and answers, searched by cosine similarity.

Vocabulary (the facade's): ``lookup`` (the best servable entry at or above
``similarity_threshold``, counted as a hit), ``search`` (the top candidates), ``remember``
(store an answer, or a pending question), ``drop``, ``correct`` (replace an answer),
``clear``. Entries
persist in a :class:`~percache_core.storage.Store`; the bank's bytes (the serialized size of
its records) stay within a budget by evicting the least frequently used entries.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .eviction import LFUPolicy
from .storage import Store
from .types import QAEntry, QAHit

_PREFIX = "qa:"


def _record(entry: QAEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "question": entry.question,
        "embedding": entry.embedding,
        "answer": entry.answer,
        "chunk_ids": tuple(entry.chunk_ids),
        "metadata": dict(entry.metadata),
        "hits": entry.hits,
        "created_at": entry.created_at,
        "last_used_at": entry.last_used_at,
    }


def _entry(record: Mapping[str, Any]) -> QAEntry:
    return QAEntry(
        id=record["id"],
        question=record["question"],
        embedding=np.asarray(record["embedding"], dtype=np.float32),
        answer=record["answer"],
        chunk_ids=tuple(record["chunk_ids"]),
        metadata=dict(record["metadata"]),
        hits=record["hits"],
        created_at=record["created_at"],
        last_used_at=record["last_used_at"],
    )


def normalized_question(question: str) -> str:
    """A question's text with case and spacing normalised.

    >>> normalized_question("  When is  it? ")
    'when is it?'
    """
    return " ".join(question.lower().split())


def scope_code_key(scope: Mapping[str, Any] | None) -> str:
    """A canonical text for a scope (an empty scope is no scope).

    >>> scope_code_key({"b": 1, "a": "x"}) == scope_code_key({"a": "x", "b": 1}), scope_code_key({})
    (True, '')
    """
    return "" if not scope else repr(sorted((str(k), str(v)) for k, v in scope.items()))


def partition_key(scope: Mapping[str, Any] | None, binding: str | None) -> str:
    """The part of the bank an entry lives in: its scope and its binding (what produced
    the answer: model, prompt template, settings). Searches see one partition only.

    >>> partition_key({"a": 1}, "m1") == partition_key({"a": 1}, "m2")
    False
    """
    return repr((binding or "", scope_code_key(scope)))


def entry_partition(metadata: Mapping[str, Any] | None) -> str:
    """The partition of an entry with this metadata (``scope`` and ``binding`` keys)."""
    metadata = metadata or {}
    return partition_key(metadata.get("scope"), metadata.get("binding"))


def question_key(question: str, metadata: Mapping[str, Any] | None = None) -> str:
    """The identity of a question: its normalised text and its partition.

    >>> question_key("When is it? ") == question_key("when is it?", {"origin": "predicted"})
    True
    >>> question_key("When is it?", {"scope": {"thread": "a"}}) == question_key("When is it?")
    False
    """
    return hashlib.sha1(repr((normalized_question(question), entry_partition(metadata))).encode("utf-8")).hexdigest()


def keeps_existing(old: QAEntry, answer: str | None, metadata: Mapping[str, Any] | None) -> bool:
    """Whether storing *answer* for *old*'s question must leave *old* in place: a pending
    entry never replaces an answered one, and the model's output never replaces an answer
    a caller gave (``remembered``).

    >>> old = QAEntry("1", "q", np.zeros(2), "Friday", metadata={"remembered": True})
    >>> keeps_existing(old, "Monday", {}), keeps_existing(old, "Monday", {"remembered": True})
    (True, False)
    """
    if old.answer is not None and answer is None:
        return True
    return bool(old.metadata.get("remembered")) and not (metadata or {}).get("remembered")


class QABank:
    """Questions with their embeddings and answers.

    >>> import tempfile
    >>> bank = QABank(Store(tempfile.mkdtemp()), dimension=2)
    >>> entry = bank.remember("When is the rehearsal?", np.array([1.0, 0.0]), "Friday at 3 pm")
    >>> hit = bank.lookup(np.array([0.96, 0.28]), similarity_threshold=0.9)
    >>> hit.entry.answer, round(hit.similarity, 2)
    ('Friday at 3 pm', 0.96)
    >>> bank.lookup(np.array([0.0, 1.0]), similarity_threshold=0.9) is None
    True
    """

    def __init__(self, store: Store, *, dimension: int, budget_bytes: int = 100 * 1024 * 1024):
        self._store = store
        self._dimension = dimension
        self.budget_bytes = budget_bytes
        self._lock = threading.RLock()
        self._entries: list[QAEntry] = []
        self._sizes: list[int] = []
        self._index: dict[str, int] = {}  # entry id -> row
        self._by_question: dict[str, str] = {}  # question key -> entry id
        self._matrix = np.zeros((16, dimension), dtype=np.float32)
        self._servable = np.zeros(16, dtype=bool)
        self._partition = np.zeros(16, dtype=np.int32)  # row -> partition code
        self._partition_codes: dict[str, int] = {partition_key(None, None): 0}
        self._dirty: set[str] = set()
        self._policy: LFUPolicy[QAEntry] = LFUPolicy()
        self.bytes = 0
        self.evictions = 0
        self.listener: Callable[[QAEntry], None] | None = None  # told of each stored answer
        for key in list(store.keys(_PREFIX)):
            record = store.get(key)
            if record is None or np.asarray(record["embedding"]).shape != (dimension,):
                store.delete(key)  # unreadable, or from another embedder
                continue
            self._append(_entry(record), len(pickle.dumps(record)))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._index

    def __getitem__(self, entry_id: str) -> QAEntry:
        with self._lock:
            return self._entries[self._index[entry_id]]

    def get(self, entry_id: str, default: QAEntry | None = None) -> QAEntry | None:
        """The entry with this id, or *default*."""
        with self._lock:
            row = self._index.get(entry_id)
            return default if row is None else self._entries[row]

    @property
    def entries(self) -> list[QAEntry]:
        """A snapshot of every entry."""
        with self._lock:
            return list(self._entries)

    def _append(self, entry: QAEntry, size: int) -> None:
        row = len(self._entries)
        if row == self._matrix.shape[0]:
            grown = max(16, 2 * row)
            self._matrix = np.resize(self._matrix, (grown, self._dimension))
            self._servable = np.resize(self._servable, grown)
            self._partition = np.resize(self._partition, grown)
        self._matrix[row] = entry.embedding
        self._servable[row] = entry.servable
        self._partition[row] = self._partition_code(entry_partition(entry.metadata))
        self._entries.append(entry)
        self._sizes.append(size)
        self._index[entry.id] = row
        self._by_question[question_key(entry.question, entry.metadata)] = entry.id
        self._policy.add(entry.id, entry)
        self.bytes += size

    def _remove_row(self, row: int) -> QAEntry:
        entry = self._entries[row]
        last = len(self._entries) - 1
        if row != last:  # move the last row into the hole
            moved = self._entries[last]
            self._entries[row] = moved
            self._sizes[row], self._sizes[last] = self._sizes[last], self._sizes[row]
            self._matrix[row] = self._matrix[last]
            self._servable[row] = self._servable[last]
            self._partition[row] = self._partition[last]
            self._index[moved.id] = row
        self._entries.pop()
        self.bytes -= self._sizes.pop()
        del self._index[entry.id]
        key = question_key(entry.question, entry.metadata)
        if self._by_question.get(key) == entry.id:
            del self._by_question[key]
        self._dirty.discard(entry.id)
        self._policy.remove(entry.id)
        return entry

    def _partition_code(self, key: str) -> int:
        if key not in self._partition_codes:
            self._partition_codes[key] = len(self._partition_codes)
        return self._partition_codes[key]

    def _write(self, entry: QAEntry) -> int:
        record = _record(entry)
        self._store.put(_PREFIX + entry.id, record)
        return len(pickle.dumps(record))

    def _check_embedding(self, embedding: np.ndarray) -> np.ndarray:
        vector = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vector.shape != (self._dimension,):
            raise ValueError(f"embedding must have {self._dimension} values, got {vector.shape[0]}")
        return vector

    def search(
        self,
        embedding: np.ndarray,
        *,
        top_n: int = 1,
        similarity_threshold: float = 0.0,
        servable_only: bool = True,
        scope: Mapping[str, Any] | None = None,
        binding: str | None = None,
    ) -> list[QAHit]:
        """The *top_n* most similar entries at or above *similarity_threshold*, best first.

        Only entries stored with exactly this *scope* (``metadata["scope"]``; None: entries
        without one) and *binding* (``metadata["binding"]``) are searched.
        """
        vector = self._check_embedding(embedding)
        with self._lock:
            count = len(self._entries)
            code = self._partition_codes.get(partition_key(scope, binding))
            if count == 0 or code is None:
                return []
            scores = self._matrix[:count] @ vector
            allowed = self._partition[:count] == code
            if servable_only:
                allowed &= self._servable[:count]
            scores = np.where(allowed, scores, -np.inf)
            if top_n == 1:
                rows = [int(np.argmax(scores))]
            else:
                top_n = min(top_n, count)
                rows = np.argpartition(-scores, top_n - 1)[:top_n]
                rows = sorted(rows.tolist(), key=lambda r: -scores[r])
            return [
                QAHit(self._entries[r], float(min(1.0, scores[r])))
                for r in rows
                if scores[r] >= similarity_threshold
            ]

    def find(
        self, question: str, *, scope: Mapping[str, Any] | None = None, binding: str | None = None
    ) -> QAEntry | None:
        """The servable entry stored for exactly this question text (surrounding spaces
        aside) under *scope* and *binding*, or None."""
        with self._lock:
            entry_id = self._by_question.get(question_key(question, {"scope": scope, "binding": binding}))
            entry = None if entry_id is None else self._entries[self._index[entry_id]]
        if entry is None or not entry.servable or entry.question.strip() != question.strip():
            return None
        return entry

    def lookup(
        self,
        embedding: np.ndarray,
        *,
        similarity_threshold: float,
        scope: Mapping[str, Any] | None = None,
        binding: str | None = None,
    ) -> QAHit | None:
        """The best servable entry whose similarity reaches *similarity_threshold*, counted
        as a hit."""
        hits = self.search(
            embedding, top_n=1, similarity_threshold=similarity_threshold, scope=scope, binding=binding
        )
        if not hits:
            return None
        self.record_hit(hits[0].entry.id)
        return hits[0]

    def record_hit(self, entry_id: str) -> None:
        """Count one use of an entry (for LFU eviction); persisted on ``flush``."""
        with self._lock:
            if entry_id in self._index:
                self._policy.touch(entry_id)
                self._dirty.add(entry_id)

    def remember(
        self,
        question: str,
        embedding: np.ndarray,
        answer: str | None,
        *,
        chunk_ids: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
    ) -> QAEntry:
        """Add an entry (``answer=None`` stores it as pending) and enforce the budget.

        Storing the same question (same text, scope and binding) again replaces it, except
        where :func:`keeps_existing` says the old entry stays (then it is returned).
        """
        vector = self._check_embedding(embedding)
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        now = time.time()
        with self._lock:
            existing = self._by_question.get(question_key(question, metadata))
            entry = QAEntry(
                id=existing or uuid.uuid4().hex,
                question=question,
                embedding=vector.copy(),
                answer=answer,
                chunk_ids=tuple(chunk_ids),
                metadata=dict(metadata or {}),
                created_at=now,
                last_used_at=now,
            )
            if existing is not None:
                old = self._entries[self._index[existing]]
                if keeps_existing(old, answer, metadata):
                    return old
                entry.hits, entry.created_at = old.hits, old.created_at
                self._remove_row(self._index[existing])
            size = self._write(entry)
            self._append(entry, size)
            self._enforce_budget(keep=entry.id)
        self._notify(entry)
        return entry

    def correct(
        self,
        entry_id: str,
        answer: str | None,
        *,
        chunk_ids: Sequence[str] | None = None,
        **metadata_changes: Any,
    ) -> QAEntry:
        """Replace an entry's answer (and its chunk ids, and update metadata keys); raise
        KeyError if absent. ``stale=True`` makes it unservable until corrected again."""
        with self._lock:
            row = self._index[entry_id]
            entry = self._entries[row]
            entry.answer = answer
            if chunk_ids is not None:
                entry.chunk_ids = tuple(chunk_ids)
            old_key = question_key(entry.question, entry.metadata)
            entry.metadata.update(metadata_changes)
            new_key = question_key(entry.question, entry.metadata)
            if new_key != old_key:
                if self._by_question.get(old_key) == entry_id:
                    del self._by_question[old_key]
                self._by_question[new_key] = entry_id
                self._partition[row] = self._partition_code(entry_partition(entry.metadata))
            self.bytes -= self._sizes[row]
            self._sizes[row] = self._write(entry)
            self.bytes += self._sizes[row]
            self._servable[row] = entry.servable
            self._dirty.discard(entry_id)
            self._enforce_budget(keep=entry_id)
        self._notify(entry)
        return entry

    def _notify(self, entry: QAEntry) -> None:
        if self.listener is not None:
            self.listener(entry)

    def drop(self, entry_id: str) -> bool:
        """Remove an entry; return whether it existed."""
        with self._lock:
            row = self._index.get(entry_id)
            if row is None:
                return False
            self._remove_row(row)
            self._store.delete(_PREFIX + entry_id)
            return True

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            for entry in list(self._entries):
                self.drop(entry.id)

    def _enforce_budget(self, keep: str) -> None:
        """Evict by the LFU policy until within budget, never the entry *keep*."""

        def evict(entry_id: str) -> None:
            self.drop(entry_id)
            self.evictions += 1

        self._policy.set_evictable(keep, False)
        try:
            self._policy.evict(lambda: self.bytes > self.budget_bytes, evict)
        finally:
            self._policy.set_evictable(keep, True)

    def flush(self) -> None:
        """Persist hit counters updated since the last write."""
        with self._lock:
            for entry_id in list(self._dirty):
                entry = self.get(entry_id)
                if entry is not None:
                    self._write(entry)
            self._dirty.clear()

    def close(self) -> None:
        """Persist counters and close the underlying store."""
        self.flush()
        self._store.close()
