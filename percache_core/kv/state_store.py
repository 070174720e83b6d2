"""Stored KV states of the chunk-state tree: node records and state files on disk.

Each fingerprint gets its own folder, so states of another model or configuration are
never even listed. A node's state is a file (written whole, then renamed into place)
and its record (in the folder's SQLite store) carries its fingerprint and the file's
size and digest; a file that does not match (truncated, corrupt, foreign) is deleted,
logged and treated as a miss. The file is written before its record, so a crash leaves
at worst an orphan file, removed at a later open: a node is either absent or complete.

Several processes may share the folder: each :meth:`StateStore.put` enforces the byte
budget over every process's nodes in the same transaction, and :meth:`StateStore.changes`
tells a process what the others stored or removed. Writes keep a free-space reserve on
the disk: below it a state is not stored (:class:`~percache_core.errors.StorageWriteError`).
"""

from __future__ import annotations

import logging
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StorageWriteError
from ..storage import DATABASE_NAME, Bookkeeping, Budget, Changes, Store
from ..types import live
from .tree import ChunkStateTree, StateNode

logger = logging.getLogger(__name__)

_NODE = "node:"
_ORPHAN_AGE_S = 300.0  # a younger file without a record may be another process's write in progress


def blob_digest(data: bytes) -> str:
    """A checksum that detects damage to a state blob (CRC-32: about 6 GB/s, so checking
    a 6 MB state costs about 1 ms; it guards against corruption, not tampering).

    >>> blob_digest(b"state") == blob_digest(b"state"), blob_digest(b"state") == blob_digest(b"statf")
    (True, False)
    """
    return f"crc32:{zlib.crc32(data):08x}"


class StateStore:
    """Node records and state files of one fingerprint under *folder*."""

    def __init__(
        self, folder: str | Path, fingerprint: str, *, min_free_bytes: int | Callable[[], int] = 0
    ) -> None:
        self.fingerprint = fingerprint
        self._min_free_bytes = live(min_free_bytes)
        self._store = Store(Path(folder) / fingerprint[:24])
        self.corrupt_dropped = 0

    def delete_orphans(self, tree: ChunkStateTree) -> None:
        """Delete state files that no record names (left by a crash between the two writes);
        files younger than a few minutes may be another process's write in progress."""
        try:
            for name in self._store.files.names(older_than_s=_ORPHAN_AGE_S):
                if name not in tree and self._store.get_record(_NODE + name) is None:
                    self._store.files.delete(name)
        except (OSError, StorageWriteError):
            pass

    def changes(self, since: int) -> Changes:
        """Nodes stored or removed (by any process) after version *since*."""
        return self._store.changes(since, _NODE)

    def version(self) -> int:
        return self._store.version()

    def apply(self, tree: ChunkStateTree, changes: Changes) -> None:
        """Bring *tree* up to *changes* (nodes another process stored or evicted; with
        incomplete changes, every stored node, and nodes not among them are removed)."""
        if not changes.complete:
            changes = self.changes(0)
            stored = {record.key.removeprefix(_NODE) for record in changes.written}
            for node in tree.nodes:
                if node.key not in stored:
                    tree.remove(node.key)
        for key in changes.removed:
            tree.remove(key.removeprefix(_NODE))
        for record in sorted(changes.written, key=lambda r: _depth(r.value)):
            value = record.value
            if not _valid_node(value, self.fingerprint):
                continue
            node = tree.insert(
                StateNode(
                    value["key"],
                    value["parent_key"],
                    depth=value["depth"],
                    n_tokens=value["n_tokens"],
                    label=value["label"],
                    size=record.size,
                    idle=bool(value.get("idle", False)),
                )
            )
            node.hits = max(node.hits, record.hits)
            node.last_used_at = max(node.last_used_at, record.last_used)

    def put(self, node: StateNode, data: bytes, *, budget_bytes: int, protected: set[str]) -> list[str]:
        """Store *data* as the state of *node* (file first, then its record) and evict down
        to *budget_bytes* (never *protected* keys); returns the evicted keys. Raises
        :class:`StorageWriteError` when the disk's free-space reserve would be crossed or
        the write fails (then nothing is stored)."""
        try:
            free = shutil.disk_usage(self._store.folder).free
        except OSError as error:
            raise StorageWriteError(f"cannot check free space: {error}") from error
        min_free = self._min_free_bytes()
        if free - len(data) < min_free:
            raise StorageWriteError(
                f"not storing a {len(data):,}-byte chunk state: {free:,} bytes free, reserve {min_free:,}"
            )
        self._store.files.write(node.key, data, durable=False)  # its digest is checked on each read
        value = {
            "key": node.key,
            "parent_key": node.parent_key,
            "depth": node.depth,
            "n_tokens": node.n_tokens,
            "label": node.label,
            "digest": blob_digest(data),
            "fingerprint": self.fingerprint,
            "idle": node.idle,
        }
        try:
            evicted = self._store.put(
                _NODE + node.key,
                value,
                bookkeeping=Bookkeeping(parent=_NODE + node.parent_key, size=len(data)),
                budget=Budget(_NODE, budget_bytes, frozenset(_NODE + key for key in protected)),
            )
        except (StorageWriteError, TypeError):
            self._store.files.delete(node.key)
            raise
        keys = [key.removeprefix(_NODE) for key in evicted or ()]
        for key in keys:
            self._store.files.delete(key)
        return keys

    def trim(self, budget_bytes: int, protected: set[str]) -> list[str]:
        """Evict down to *budget_bytes* (e.g. after the budget was lowered); the keys."""
        keys = [key.removeprefix(_NODE) for key in self._store.trim(_NODE, budget_bytes, {_NODE + k for k in protected})]
        for key in keys:
            self._store.files.delete(key)
        return keys

    def get(self, key: str) -> bytes | None:
        """The verified state bytes of node *key*, or None (a bad file is deleted)."""
        record = self._store.get_record(_NODE + key)
        if record is None:
            return None
        data = self._store.files.read(key)
        value = record.value
        problem = None
        if not _valid_node(value, self.fingerprint):
            problem = "not a node record of this fingerprint"
        elif data is None:
            problem = "file missing"
        elif len(data) != record.size:
            problem = f"size {len(data)} != {record.size}"
        elif blob_digest(data) != value.get("digest"):
            problem = "digest mismatch"
        if problem is not None:
            logger.warning("chunk state %s is unusable (%s): deleted", key, problem)
            self.corrupt_dropped += 1
            self.delete(key)
            return None
        return data

    def record_use(self, node: StateNode) -> None:
        """Note one restore of *node* (for eviction: :mod:`percache_core.eviction`)."""
        self._store.note_use(_NODE + node.key, node.last_used_at)

    def delete(self, key: str) -> None:
        """Remove node *key* (record first, so no record ever points to a missing file)."""
        _delete_node(self._store, key)

    def blob_path(self, key: str) -> Path | None:
        """Where the state file of *key* is (for tests and tools), or None."""
        path = self._store.files.path(key)
        return path if path.exists() else None

    def close(self) -> None:
        """Write restore counters and close the store."""
        self._store.close()


def delete_document_states(folder: str | Path, removed_chunk_ids: set[str]) -> int:
    """Delete, in every fingerprint's store under *folder*, the nodes that may hold the text
    of removed chunks; the count. A node's record names only its last segment, so only
    states known to hold none of them are kept: the system prompt alone, and [system, chunk]
    of a chunk that stays. Records go before files (as :meth:`StateStore.delete`); other
    processes see the removals at their next sync."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    excluded = removed_chunk_ids | {"text"}  # "text": a segment of a caller's prompt, its chunks unknown
    dropped = 0
    for sub in sorted(p for p in folder.iterdir() if (p / DATABASE_NAME).is_file()):
        store = Store(sub)
        try:
            nodes = {
                r.key.removeprefix(_NODE): r.value if isinstance(r.value, dict) else {} for r in store.records(_NODE)
            }
            labels = {value.get("key"): value.get("label") for value in nodes.values()}
            for key in [k for k, value in nodes.items() if not _free_of(value, labels, excluded)]:
                _delete_node(store, key)
                dropped += 1
        finally:
            store.close()
    return dropped


def _free_of(value: dict[str, Any], labels: dict[Any, Any], excluded: set[str]) -> bool:
    """Whether a node record is known to hold none of the removed chunks: the system prompt
    alone, or [system, chunk] of a chunk whose label is not *excluded* (*labels*: node key
    -> label)."""
    if value.get("depth") == 1:
        return value.get("label") == "system"
    return (
        value.get("depth") == 2
        and labels.get(value.get("parent_key")) == "system"
        and value.get("label") not in excluded
    )


def _delete_node(store: Store, key: str) -> None:
    """Remove node *key* from *store*: its record first, so no record ever points to a
    missing file."""
    try:
        store.delete(_NODE + key)
    finally:
        store.files.delete(key)


def _depth(value: Any) -> int:
    return value.get("depth", 0) if isinstance(value, dict) and isinstance(value.get("depth"), int) else 0


def _valid_node(value: Any, fingerprint: str) -> bool:
    """Whether a record has this version's node shape and this fingerprint."""
    return (
        isinstance(value, dict)
        and value.get("fingerprint") == fingerprint
        and isinstance(value.get("key"), str)
        and isinstance(value.get("parent_key"), str)
        and all(isinstance(value.get(name), int) for name in ("depth", "n_tokens"))
        and isinstance(value.get("label"), str)
    )
