"""Stored KV states of the chunk-state tree: node records and state blobs on disk.

Each fingerprint gets its own folder, so states of another model or configuration are
never even listed. Every record also carries its fingerprint and the blob's size and
digest; a blob that does not match (truncated, corrupt, foreign) is deleted, logged and
treated as a miss. A blob is written before its record, so a crash leaves at worst an
orphan blob, which is removed at the next open: a node is either absent or complete.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any

from ..storage import Store
from .tree import ChunkStateTree, StateNode

logger = logging.getLogger(__name__)

_NODE = "node:"
_BLOB = "blob:"


def blob_digest(data: bytes) -> str:
    """A checksum that detects damage to a state blob (CRC-32: about 6 GB/s, so checking
    a 6 MB state costs about 1 ms; it guards against corruption, not tampering).

    >>> blob_digest(b"state") == blob_digest(b"state"), blob_digest(b"state") == blob_digest(b"statf")
    (True, False)
    """
    return f"crc32:{zlib.crc32(data):08x}"


class StateStore:
    """Node records and state bytes of one fingerprint under *folder*."""

    def __init__(self, folder: str | Path, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._store = Store(Path(folder) / fingerprint[:24])
        self.corrupt_dropped = 0
        self._used: dict[str, StateNode] = {}  # hit counters not yet written

    def load_tree(self) -> ChunkStateTree:
        """Rebuild the tree from the stored records, dropping unusable leftovers."""
        tree = ChunkStateTree(self.fingerprint)
        records: list[dict[str, Any]] = []
        for key in list(self._store.keys(_NODE)):
            record = self._store.get(key)
            if not isinstance(record, dict) or record.get("fingerprint") != self.fingerprint:
                logger.warning("dropping chunk-state record %s of another fingerprint", key)
                self.delete(key.removeprefix(_NODE))
                continue
            records.append(record)
        for record in sorted(records, key=lambda r: r["depth"]):
            node = tree.insert(
                record["key"],
                record["parent_key"],
                depth=record["depth"],
                n_tokens=record["n_tokens"],
                label=record["label"],
                size=record["size"],
            )
            node.hits = record.get("hits", 0)
            node.last_used_at = record.get("last_used_at", node.last_used_at)
        for key in list(self._store.keys(_BLOB)):
            if key.removeprefix(_BLOB) not in tree:
                self._store.delete(key)  # orphan from an interrupted write
        return tree

    def put(self, node: StateNode, data: bytes) -> None:
        """Store *data* as the state of *node* (blob first, then its record)."""
        self._store.put(_BLOB + node.key, data)
        self._store.put(
            _NODE + node.key,
            {
                "key": node.key,
                "parent_key": node.parent_key,
                "depth": node.depth,
                "n_tokens": node.n_tokens,
                "label": node.label,
                "size": node.size,
                "digest": blob_digest(data),
                "fingerprint": self.fingerprint,
                "hits": node.hits,
                "last_used_at": node.last_used_at,
            },
        )

    def get(self, key: str) -> bytes | None:
        """The verified state bytes of node *key*, or None (a bad blob is deleted)."""
        record = self._store.get(_NODE + key)
        data = self._store.get(_BLOB + key)
        if record is None or data is None:
            return None
        problem = None
        if record.get("fingerprint") != self.fingerprint:
            problem = "another fingerprint"
        elif not isinstance(data, bytes) or len(data) != record["size"]:
            problem = f"size {len(data) if isinstance(data, bytes) else '?'} != {record['size']}"
        elif blob_digest(data) != record["digest"]:
            problem = "digest mismatch"
        if problem is not None:
            logger.warning("chunk state %s is unusable (%s): deleted", key, problem)
            self.corrupt_dropped += 1
            self.delete(key)
            return None
        return data

    def record_use(self, node: StateNode) -> None:
        """Note a node's new hit counter; it is written by ``flush`` (off the answer path)."""
        self._used[node.key] = node

    def flush(self) -> None:
        """Persist the hit counters noted since the last flush."""
        used, self._used = self._used, {}
        for node in used.values():
            record = self._store.get(_NODE + node.key)
            if record is not None:
                record["hits"], record["last_used_at"] = node.hits, node.last_used_at
                self._store.put(_NODE + node.key, record)

    def delete(self, key: str) -> None:
        """Remove node *key* (record first, so no record ever points to a missing blob)."""
        self._store.delete(_NODE + key)
        self._store.delete(_BLOB + key)

    def blob_path(self, key: str) -> Path | None:
        """Where diskcache keeps the blob of *key* on disk (for tests and tools)."""
        return self._store.file_path(_BLOB + key)

    def close(self) -> None:
        """Persist hit counters and close the store."""
        self.flush()
        self._store.close()
