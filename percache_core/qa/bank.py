"""The QA bank: stored questions with embeddings and answers, searched by cosine similarity.

:class:`QABank`'s verbs: ``find`` (the entry stored for exactly this question), ``nearest``
(the best servable entry at or above ``similarity_threshold``, counted as a hit),
``search`` (the top candidates), ``put`` (store an answer, or a pending question),
``correct`` (replace an answer), ``delete``, ``clear``, ``record_hit`` and ``sync`` (take in
other processes' writes). Entries persist in a :class:`~percache_core.storage.Store`; the
bank's bytes (the serialized size of its records) stay within a budget by evicting the
least frequently used entries.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..storage import Bookkeeping, Budget, Record, Store
from ..types import QAEntry, QAHit, live

_PREFIX = "qa:"
logger = logging.getLogger(__name__)


def _value(entry: QAEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "question": entry.question,
        "answer": entry.answer,
        "chunk_ids": list(entry.chunk_ids),
        "metadata": entry.metadata,
        "created_at": entry.created_at,
    }


def _entry(record: Record, dimension: int) -> QAEntry | None:
    """The entry of a stored record, or None when its shape is not this version's (or the
    embedding is another embedder's)."""
    value = record.value
    try:
        entry = QAEntry(
            id=str(value["id"]),
            question=str(value["question"]),
            embedding=np.asarray(record.vector, dtype=np.float32),
            answer=value["answer"] if isinstance(value["answer"], str) else None,
            chunk_ids=tuple(str(c) for c in value["chunk_ids"]),
            metadata=dict(value["metadata"]),
            hits=record.hits,
            created_at=float(value["created_at"]),
            last_used_at=record.last_used,
        )
    except (KeyError, TypeError, ValueError):
        return None
    if record.vector is None or entry.embedding.shape != (dimension,) or record.key != _PREFIX + entry.id:
        return None
    return entry


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
    if not metadata or (not metadata.get("scope") and not metadata.get("binding")):
        return _NO_PARTITION
    return partition_key(metadata.get("scope"), metadata.get("binding"))


_NO_PARTITION = partition_key(None, None)


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
    entry never replaces an answered one, the model's output never replaces an answer a
    caller gave (``remembered``), and idle work (predictions, follow-ups) never replaces
    the answer a user was given.

    >>> old = QAEntry("1", "q", np.zeros(2), "Friday", metadata={"remembered": True})
    >>> keeps_existing(old, "Monday", {}), keeps_existing(old, "Monday", {"remembered": True})
    (True, False)
    >>> asked = QAEntry("2", "q", np.zeros(2), "Friday", metadata={"origin": "user"})
    >>> keeps_existing(asked, "Friday", {"origin": "predicted-history"}), keeps_existing(asked, "Fri", {"origin": "user"})
    (True, False)
    """
    metadata = metadata or {}
    if old.answer is not None and answer is None:
        return True
    if old.remembered and not metadata.get("remembered"):
        return True
    return old.servable and old.origin == "user" and metadata.get("origin") not in ("user", None)


def new_entry(
    question: str, vector: np.ndarray, answer: str | None, chunk_ids: Sequence[str], metadata: Mapping[str, Any] | None
) -> QAEntry:
    """A QA entry for *question* (its id from its text and metadata), checked: a non-empty
    question, an answer that is a string or None (pending).

    >>> new_entry("When?", np.ones(2), "Friday.", ["c1"], None).chunk_ids
    ('c1',)
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    if answer is not None and not isinstance(answer, str):
        raise TypeError(f"answer must be a string or None, got {type(answer).__name__}")
    now = time.time()
    return QAEntry(
        id=question_key(question, metadata),
        question=question,
        embedding=vector.copy(),
        answer=answer,
        chunk_ids=tuple(str(c) for c in chunk_ids),
        metadata=dict(metadata or {}),
        created_at=now,
        last_used_at=now,
    )


class QABank:
    """Questions with their embeddings and answers.

    The entries live in a :class:`~percache_core.storage.Store` that other processes may
    share: each search first takes in what others stored or removed since the last one
    (one version check when nothing changed), an entry's id is its question key (so one
    question is one record across processes), and the byte budget is enforced over the
    stored total, least frequently used first (hit counts of every process add up).

    >>> import tempfile
    >>> bank = QABank(Store(tempfile.mkdtemp()), dimension=2)
    >>> entry = bank.put("When is the rehearsal?", np.array([1.0, 0.0]), "Friday at 3 pm")
    >>> hit = bank.nearest(np.array([0.96, 0.28]), similarity_threshold=0.9)
    >>> hit.entry.answer, round(hit.similarity, 2)
    ('Friday at 3 pm', 0.96)
    >>> bank.nearest(np.array([0.0, 1.0]), similarity_threshold=0.9) is None
    True
    """

    def __init__(self, store: Store, *, dimension: int, budget_bytes: int | Callable[[], int] = 100 * 1024 * 1024):
        self._store = store
        self._dimension = dimension
        self._budget_bytes = live(budget_bytes)
        self._lock = threading.RLock()
        self._entries: list[QAEntry] = []
        self._sizes: list[int] = []
        self._index: dict[str, int] = {}  # entry id -> row
        self._matrix = np.zeros((16, dimension), dtype=np.float32)
        self._servable = np.zeros(16, dtype=bool)
        self._partition = np.zeros(16, dtype=np.int32)  # row -> partition code
        self._partition_rows: Counter[int] = Counter()  # partition code -> rows
        self._unservable_rows = 0
        self._partition_codes: dict[str, int] = {_NO_PARTITION: 0}
        self._version = -1
        self.bytes = 0
        self.evictions = 0
        self.listener: Callable[[QAEntry], None] | None = None  # told of each stored answer
        self.sync()

    @property
    def budget_bytes(self) -> int:
        """The byte budget in force (read from the configuration when it is a setting)."""
        return self._budget_bytes()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._index

    def __getitem__(self, entry_id: str) -> QAEntry:
        with self._lock:
            return self._entries[self._index[entry_id]]

    def entry_bytes(self, entry_id: str) -> int:
        """The bytes entry *entry_id* counts against the budget."""
        with self._lock:
            return self._sizes[self._index[entry_id]]

    def get(self, entry_id: str, default: QAEntry | None = None) -> QAEntry | None:
        """The entry with this id, or *default*."""
        with self._lock:
            row = self._index.get(entry_id)
            return default if row is None else self._entries[row]

    @property
    def entries(self) -> list[QAEntry]:
        """A snapshot of every entry."""
        with self._lock:
            self.sync()
            return list(self._entries)

    def sync(self) -> None:
        """Take in the entries other processes (or other banks on this folder) stored or
        removed since the last sync."""
        with self._lock:
            if self._store.version() == self._version:
                return
            changes = self._store.changes(self._version if self._version >= 0 else 0, _PREFIX)
            if not changes.complete:
                for entry in list(self._entries):
                    self._remove_row(self._index[entry.id])
                changes = self._store.changes(0, _PREFIX)
            for key in changes.removed:
                row = self._index.get(key.removeprefix(_PREFIX))
                if row is not None:
                    self._remove_row(row)
            self._reserve(len(self._entries) + len(changes.written))  # one allocation, not doublings
            for record in changes.written:
                self._take(record)
            self._version = changes.version

    def _take(self, record: Record) -> None:
        entry = _entry(record, self._dimension)
        if entry is None:
            logger.debug("QA entry %s is unreadable (another version or embedder wrote it): skipped", record.key)
            return
        row = self._index.get(entry.id)
        if row is not None:
            self._remove_row(row)
        self._append(entry, record.size)

    def _append(self, entry: QAEntry, size: int) -> None:
        row = len(self._entries)
        if row == self._matrix.shape[0]:
            self._reserve(max(16, 2 * row))
        self._matrix[row] = entry.embedding
        self._servable[row] = entry.servable
        self._partition[row] = self._partition_code(entry_partition(entry.metadata))
        self._partition_rows[int(self._partition[row])] += 1
        self._unservable_rows += not entry.servable
        self._entries.append(entry)
        self._sizes.append(size)
        self._index[entry.id] = row
        self.bytes += size

    def _reserve(self, rows: int) -> None:
        """Room for *rows* entries in the arrays (the rows in use are kept)."""
        if rows <= self._matrix.shape[0]:
            return
        used = len(self._entries)
        matrix = np.zeros((rows, self._dimension), dtype=np.float32)
        servable = np.zeros(rows, dtype=bool)
        partition = np.zeros(rows, dtype=np.int32)
        matrix[:used], servable[:used], partition[:used] = (
            self._matrix[:used], self._servable[:used], self._partition[:used]
        )
        self._matrix, self._servable, self._partition = matrix, servable, partition

    def _remove_row(self, row: int) -> QAEntry:
        entry = self._entries[row]
        last = len(self._entries) - 1
        self._partition_rows[int(self._partition[row])] -= 1
        self._unservable_rows -= not self._servable[row]
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
        return entry

    def _partition_code(self, key: str) -> int:
        if key not in self._partition_codes:
            self._partition_codes[key] = len(self._partition_codes)
        return self._partition_codes[key]

    def _check_embedding(self, embedding: np.ndarray) -> np.ndarray:
        vector = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vector.shape != (self._dimension,):
            raise ValueError(f"embedding must have {self._dimension} values, got {vector.shape[0]}")
        if not np.all(np.isfinite(vector)):
            raise ValueError("embedding has values that are not finite")
        return vector

    def search(
        self,
        embedding: np.ndarray,
        *,
        top_n: int = 1,
        similarity_threshold: float = 0.0,
        scope: Mapping[str, Any] | None = None,
        binding: str | None = None,
        everywhere: bool = False,
    ) -> list[QAHit]:
        """The *top_n* most similar entries at or above *similarity_threshold*, best first.

        Only servable entries stored with exactly this *scope* (``metadata["scope"]``; None:
        entries without one) and *binding* (``metadata["binding"]``) are searched, unless
        *everywhere*: then every entry, pending and stale ones too (for checks of what is
        known at all, never for serving).
        """
        vector = self._check_embedding(embedding)
        with self._lock:
            self.sync()
            count = len(self._entries)
            code = self._partition_codes.get(partition_key(scope, binding))
            if count == 0 or (code is None and not everywhere):
                return []
            scores = self._matrix[:count] @ vector
            allowed = None  # every row (no mask is built when one partition holds them all)
            if not everywhere and self._partition_rows[code] != count:
                allowed = self._partition[:count] == code
            if not everywhere and self._unservable_rows:
                allowed = self._servable[:count] if allowed is None else allowed & self._servable[:count]
            if allowed is not None:
                scores[~allowed] = -np.inf
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
            self.sync()
            entry = self.get(question_key(question, {"scope": scope, "binding": binding}))
        if entry is None or not entry.servable or entry.question.strip() != question.strip():
            return None
        return entry

    def nearest(
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
        """Count one use of an entry (for eviction: :mod:`percache_core.eviction`)."""
        with self._lock:
            entry = self.get(entry_id)
            if entry is not None:
                entry.hits += 1
                entry.last_used_at = time.time()
                self._store.note_use(_PREFIX + entry_id, entry.last_used_at)

    def put(
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
        where :func:`keeps_existing` says the stored entry stays (then it is returned). A
        failed write (:class:`~percache_core.errors.StorageWriteError`, or a TypeError for
        metadata that is not JSON) changes nothing.
        """
        entry = new_entry(question, self._check_embedding(embedding), answer, chunk_ids, metadata)
        with self._lock:
            self.sync()
            kept: list[QAEntry] = []

            def replaceable(stored: Record | None) -> bool:
                old = None if stored is None else _entry(stored, self._dimension)
                if old is not None and keeps_existing(old, answer, metadata):
                    kept.append(old)
                    return False
                return True

            evicted = self._store.put(
                _PREFIX + entry.id,
                _value(entry),
                vector=entry.embedding,
                keep_if=replaceable,
                budget=Budget(_PREFIX, self.budget_bytes),
            )
            self.sync()
            if evicted is None:
                return self.get(entry.id) or kept[0]
            self.evictions += len(evicted)
            entry = self.get(entry.id) or entry
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
            self.sync()
            old = self._entries[self._index[entry_id]]
            metadata = {**old.metadata, **metadata_changes}
            new_id = question_key(old.question, metadata)
            entry = QAEntry(
                id=new_id,
                question=old.question,
                embedding=old.embedding,
                answer=answer,
                chunk_ids=old.chunk_ids if chunk_ids is None else tuple(str(c) for c in chunk_ids),
                metadata=metadata,
                hits=old.hits,
                created_at=old.created_at,
                last_used_at=old.last_used_at,
            )
            with self._store.transaction():  # a failed write (e.g. TypeError) deletes nothing
                if new_id != entry_id:
                    self._store.delete(_PREFIX + entry_id)
                evicted = self._store.put(
                    _PREFIX + new_id,
                    _value(entry),
                    vector=entry.embedding,
                    bookkeeping=Bookkeeping(hits=old.hits if new_id != entry_id else None),
                    budget=Budget(_PREFIX, self.budget_bytes),
                )
            self.evictions += len(evicted or ())
            self.sync()
            entry = self.get(new_id) or entry
        self._notify(entry)
        return entry

    def _notify(self, entry: QAEntry) -> None:
        if self.listener is not None:
            self.listener(entry)

    def delete(self, entry_id: str) -> bool:
        """Remove an entry; return whether it existed."""
        with self._lock:
            existed = self._store.delete(_PREFIX + entry_id)
            row = self._index.get(entry_id)
            if row is not None:
                self._remove_row(row)
            return existed or row is not None

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            self._store.clear(_PREFIX)
            self.sync()

    def close(self) -> None:
        """Write use counters and close the underlying store (never rewrites entries)."""
        self._store.close()
