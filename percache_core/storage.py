"""Persistent records in SQLite, shared safely by threads and processes.

A :class:`Store` is one SQLite database (``percache.sqlite3``) in a folder of its own,
with large byte values (chunk states) in files beside it. Everything read back is data,
never code: values are JSON, vectors are little-endian float32 bytes, blobs are bytes.

Several processes may open one folder (a web app with workers): every write is a
transaction, every change bumps a version number, and removals leave a tombstone, so
another process catches up with :meth:`Store.changes` (cheaply: :meth:`Store.version`
first). Byte budgets are enforced inside the writing transaction over what every
process stored (:meth:`Store.put` with ``budget``), least frequently used first.

The database keeps a write-ahead log with ``synchronous=NORMAL``: a commit does not wait
for the disk (0.06 ms against 2 ms for a small record, measured here; an answer writes
several). A crashed process loses nothing it committed; a power cut may lose the last
commits, never part of one, and a state file whose bytes do not match its record's digest
is dropped when read.

Folders are created ``0700`` and files ``0600``: a cache holds personal data.
A write that fails (disk full, read-only, locked too long) raises
:class:`~percache_core.errors.StorageWriteError`; a reader never sees half a write.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .errors import CacheFolderError, StorageWriteError
from .eviction import LFU, EvictionPolicy, UseCounts

DATABASE_NAME = "percache.sqlite3"
APPLICATION_ID = 0x50434348  # "PCCH": marks a database as PerCache's
SCHEMA_VERSION = 1
BLOB_FOLDER = "blobs"
logger = logging.getLogger(__name__)
_TOMBSTONES_KEPT = 5000
_LOCK_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    vector BLOB,
    parent TEXT,
    size INTEGER NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    last_used REAL NOT NULL,
    version INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS records_version ON records (version);
CREATE INDEX IF NOT EXISTS records_parent ON records (parent);
CREATE TABLE IF NOT EXISTS removed (key TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS removed_version ON removed (version);
CREATE TABLE IF NOT EXISTS counter (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL,
                                    floor INTEGER NOT NULL);
INSERT OR IGNORE INTO counter VALUES (0, 0, 0);
"""


@dataclass(frozen=True)
class Record:
    """One stored record: its JSON *value*, optional *vector*, and bookkeeping."""

    key: str
    value: Any
    vector: np.ndarray | None
    size: int
    hits: int
    last_used: float
    version: int


@dataclass(frozen=True)
class Bookkeeping:
    """What a write tells the eviction order beside the value: the record its record
    depends on (*parent*: evicted after it), its *size* in bytes (default: the value's
    JSON) and its use count *hits* (default: kept, or 0)."""

    parent: str | None = None
    size: int | None = None
    hits: int | None = None


@dataclass(frozen=True)
class Budget:
    """The bytes the records whose keys start with *prefix* may take: beyond *limit_bytes*
    the least frequently used are removed (leaves before the records they depend on),
    never the written key nor *protected* ones.

    >>> Budget("qa:", 1000).protected
    frozenset()
    """

    prefix: str
    limit_bytes: int
    protected: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Changes:
    """What changed since a version: records written and keys removed. ``complete`` is
    False when tombstones that old were pruned (then reload everything)."""

    version: int
    written: list[Record]
    removed: list[str]
    complete: bool = True


def private_folder(folder: Path) -> Path:
    """Create *folder* (and missing parents) readable by its owner only; tighten an existing
    one that this user owns. Returns the folder."""
    missing = [folder, *(p for p in folder.parents if not p.exists())] if not folder.exists() else []
    for path in reversed(missing):  # parents too (mkdir(parents=True) ignores the mode for them)
        path.mkdir(mode=0o700, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    try:
        if folder.stat().st_uid == os.getuid() and folder.stat().st_mode & 0o077:
            folder.chmod(0o700)
    except OSError:
        pass  # not ours to change; access is checked by the caller
    return folder


def json_text(value: Any) -> str:
    """*value* as compact JSON, or a TypeError naming what cannot be stored.

    >>> json_text({"a": [1, 2.5, None]})
    '{"a":[1,2.5,null]}'
    >>> json_text({"a": object()})
    Traceback (most recent call last):
    ...
    TypeError: cannot store a value of type object (JSON values only)
    """
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        bad = _first_unstorable(value)
        raise TypeError(f"cannot store a value of type {type(bad).__name__} (JSON values only)") from error


def _first_unstorable(value: Any) -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return key
            found = _first_unstorable(item)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_unstorable(item)
            if found is not None:
                return found
        return None
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else value
    return value


class Store:
    """A folder of keyed JSON records (with optional vectors) and byte files.

    >>> import tempfile
    >>> store = Store(tempfile.mkdtemp())
    >>> _ = store.put("qa:1", {"q": "hi"}); store.get("qa:1")
    {'q': 'hi'}
    >>> store.get("qa:2") is None
    True
    >>> sorted(store.keys("qa:"))
    ['qa:1']
    >>> store.close()
    """

    def __init__(self, folder: str | os.PathLike[str], *, policy: EvictionPolicy = LFU) -> None:
        self.folder = Path(folder)
        self.files = StoreFiles(self.folder / BLOB_FOLDER)  # byte files beside the records
        self.policy = policy  # the order in which records over a budget go
        self._uses = UseCounts()  # uses noted and not yet written
        self.path = self.folder / DATABASE_NAME
        self._lock = threading.RLock()
        try:
            private_folder(self.folder)
            if not os.access(self.folder, os.R_OK | os.W_OK | os.X_OK):
                raise PermissionError(f"no read/write access to {self.folder}")
            if (self.folder / "cache.db").exists():
                raise CacheFolderError(
                    f"{self.folder} was written by PerCache < 0.3 (pickled records, which are no "
                    "longer read because loading them can run code): delete it or use another folder"
                )
            created = not self.path.exists()
            self._db = sqlite3.connect(
                self.path, timeout=_LOCK_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            if created:
                self.path.chmod(0o600)
            # a commit appends to the write-ahead log without waiting for the disk (see above)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._prepare()
        except CacheFolderError:
            raise
        except (OSError, sqlite3.Error) as error:
            raise CacheFolderError(f"cannot open cache folder {self.folder}: {error}") from error

    def _prepare(self) -> None:
        application_id = self._db.execute("PRAGMA application_id").fetchone()[0]
        tables = self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if tables and application_id != APPLICATION_ID:
            raise CacheFolderError(f"{self.path} is not a PerCache database (another program's file?)")
        schema = self._db.execute("PRAGMA user_version").fetchone()[0]
        if schema > SCHEMA_VERSION:
            raise CacheFolderError(f"{self.path} was written by a newer PerCache (schema {schema})")
        if application_id != APPLICATION_ID or schema != SCHEMA_VERSION:
            with self.transaction():
                self._db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)

    # -- writing --------------------------------------------------------------------------

    def transaction(self) -> _Transaction:
        """Several writes as one: all or none (nested uses join the outer one).

        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> try:
        ...     with store.transaction():
        ...         _ = store.put("a", 1)
        ...         _ = store.put("b", object())
        ... except TypeError:
        ...     pass
        >>> store.get("a") is None
        True
        """
        return _Transaction(self)

    def _next_version(self) -> int:
        self._db.execute("UPDATE counter SET version = version + 1 WHERE id = 0")
        return int(self._db.execute("SELECT version FROM counter WHERE id = 0").fetchone()[0])

    def _upsert(
        self,
        key: str,
        value: Any,
        vector: np.ndarray | None,
        parent: str | None,
        size: int | None,
        hits: int | None,
    ) -> None:
        text = json_text(value)
        vector_bytes = None if vector is None else np.asarray(vector, dtype="<f4").reshape(-1).tobytes()
        total = size if size is not None else len(text) + len(vector_bytes or b"")
        version = self._next_version()
        old = self._db.execute("SELECT hits FROM records WHERE key = ?", (key,)).fetchone()
        kept_hits = hits if hits is not None else (old[0] if old else 0)
        self._db.execute(
            "INSERT OR REPLACE INTO records (key, value, vector, parent, size, hits, last_used, version) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key, text, vector_bytes, parent, total, kept_hits, time.time(), version),
        )
        self._db.execute("DELETE FROM removed WHERE key = ?", (key,))

    def _remove(self, key: str) -> bool:
        if self._db.execute("DELETE FROM records WHERE key = ?", (key,)).rowcount == 0:
            return False
        self._db.execute("INSERT OR REPLACE INTO removed VALUES (?, ?)", (key, self._next_version()))
        return True

    def put(
        self,
        key: str,
        value: Any,
        *,
        vector: np.ndarray | None = None,
        bookkeeping: Bookkeeping | None = None,
        keep_if: Callable[[Record | None], bool] | None = None,
        budget: Budget | None = None,
    ) -> list[str] | None:
        """Store *value* (JSON) under *key*, replacing what was there, in one transaction.

        Args:
            key: the record's key.
            value: a JSON value.
            vector: an embedding stored beside it.
            bookkeeping: its parent, size and use count for the eviction order.
            keep_if: sees the record stored now and may refuse the write.
            budget: the budget the write is held to (records evicted to fit it).

        Returns:
            The keys evicted to fit *budget* (``[]`` without one), or None when *keep_if*
            refused the write.

        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> store.put("r:a", 1, bookkeeping=Bookkeeping(size=10)), store.put("r:b", 2, budget=Budget("r:", 10))
        ([], ['r:a'])
        """
        info = bookkeeping or Bookkeeping()
        with self.transaction():
            if keep_if is not None and not keep_if(self._record(key)):
                return None
            self._upsert(key, value, vector, info.parent, info.size, info.hits)
            if budget is None:
                return []
            return self._enforce((budget.prefix, budget.limit_bytes), {key, *budget.protected})

    def trim(self, prefix: str, budget_bytes: int, protected: Iterable[str] = ()) -> list[str]:
        """Remove least frequently used records with *prefix* until their total fits
        *budget_bytes* (never *protected* keys); the removed keys."""
        with self.transaction():
            return self._enforce((prefix, budget_bytes), set(protected))

    def put_many(self, items: Sequence[tuple[str, Any, np.ndarray | None]], *, remove: Iterable[str] = ()) -> None:
        """Remove the keys *remove*, then store ``(key, value, vector)`` items: all or none."""
        with self.transaction():
            for key in remove:
                self._remove(key)
            for key, value, vector in items:
                self._upsert(key, value, vector, None, None, None)

    def _enforce(self, budget: tuple[str, int], protected: set[str]) -> list[str]:
        prefix, limit = budget
        pattern = _like(prefix)
        total = self._db.execute(
            "SELECT coalesce(sum(size), 0) FROM records WHERE key LIKE ? ESCAPE '\\'", (pattern,)
        ).fetchone()[0]
        removed: list[str] = []
        if total <= limit:
            return removed
        self._write_uses(self._uses.take())  # the order sees every use noted so far
        rows = self._db.execute(
            f"SELECT key, size FROM records AS r WHERE key LIKE ? ESCAPE '\\' ORDER BY {self.policy.order_by}",
            (pattern,),
        ).fetchall()
        for key, size in rows:
            if total <= limit:
                break
            if key in protected:
                continue
            self._remove(key)
            removed.append(key)
            total -= size
        return removed

    def delete(self, key: str) -> bool:
        """Remove *key*; return whether it existed."""
        with self.transaction():
            return self._remove(key)

    def clear(self, prefix: str = "") -> None:
        """Remove every key starting with *prefix*."""
        with self.transaction():
            for key in self.keys(prefix):
                self._remove(key)

    def note_use(self, key: str, when: float | None = None) -> None:
        """Count one use of *key* for eviction (see :mod:`percache_core.eviction`); written
        with the next eviction, :meth:`flush_uses` or :meth:`close`, added to what other
        processes counted."""
        self._uses.note(key, when)

    def flush_uses(self) -> None:
        """Write the uses noted since the last write."""
        uses = self._uses.take()
        if uses:
            with self.transaction():
                self._write_uses(uses)

    def _write_uses(self, uses: dict[str, tuple[int, float]]) -> None:
        self._db.executemany(
            "UPDATE records SET hits = hits + ?, last_used = max(last_used, ?) WHERE key = ?",
            [(hits, used, key) for key, (hits, used) in uses.items()],
        )

    # -- reading --------------------------------------------------------------------------

    def _record(self, key: str) -> Record | None:
        row = self._db.execute(
            "SELECT key, value, vector, size, hits, last_used, version FROM records WHERE key = ?", (key,)
        ).fetchone()
        return None if row is None else _as_record_or_none(row)

    def get_record(self, key: str) -> Record | None:
        """The record under *key*, or None."""
        with self._lock:
            return self._record(key)

    def get(self, key: str, default: Any = None) -> Any:
        """The value under *key*, or *default* when absent."""
        record = self.get_record(key)
        return default if record is None else record.value

    def keys(self, prefix: str = "") -> list[str]:
        """Every key starting with *prefix*."""
        with self._lock:
            rows = self._db.execute(
                "SELECT key FROM records WHERE key LIKE ? ESCAPE '\\' ORDER BY version", (_like(prefix),)
            ).fetchall()
        return [row[0] for row in rows]

    def records(self, prefix: str = "") -> list[Record]:
        """Every record whose key starts with *prefix*, oldest write first (unreadable
        rows are skipped)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT key, value, vector, size, hits, last_used, version FROM records "
                "WHERE key LIKE ? ESCAPE '\\' ORDER BY version",
                (_like(prefix),),
            ).fetchall()
        return [record for record in map(_as_record_or_none, rows) if record is not None]

    def version(self) -> int:
        """A number that grows with every write by any process."""
        with self._lock:
            return int(self._db.execute("SELECT version FROM counter WHERE id = 0").fetchone()[0])

    def changes(self, since: int, prefix: str = "") -> Changes:
        """Records written and keys removed after version *since* (by any process)."""
        version, complete, rows, removed = self._since(
            since, prefix, "key, value, vector, size, hits, last_used, version"
        )
        written = [record for record in map(_as_record_or_none, rows) if record is not None]
        return Changes(version, written, removed, complete=complete)

    def changed_keys(self, since: int) -> tuple[int, list[str], list[str], bool]:
        """Like :meth:`changes` without reading the values (cheaper): the version now, the
        keys written and the keys removed after version *since*, and whether the removals
        are complete (False when tombstones that old were pruned)."""
        version, complete, rows, removed = self._since(since, "", "key")
        return version, [row[0] for row in rows], removed, complete

    def _since(self, since: int, prefix: str, columns: str) -> tuple[int, bool, list[tuple[Any, ...]], list[str]]:
        """In one read transaction: the version now, whether removals since *since* are all
        known, the *columns* of the records written since (oldest first) and the keys removed."""
        pattern = _like(prefix)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                version, floor = self._db.execute("SELECT version, floor FROM counter WHERE id = 0").fetchone()
                rows = self._db.execute(
                    f"SELECT {columns} FROM records WHERE version > ? AND key LIKE ? ESCAPE '\\' ORDER BY version",
                    (since, pattern),
                ).fetchall()
                removed = self._db.execute(
                    "SELECT key FROM removed WHERE version > ? AND key LIKE ? ESCAPE '\\'", (since, pattern)
                ).fetchall()
            finally:
                self._db.execute("COMMIT")
        return int(version), since >= floor, rows, [row[0] for row in removed]

    def count(self, prefix: str = "") -> int:
        """How many records have keys starting with *prefix*."""
        with self._lock:
            return int(
                self._db.execute("SELECT count(*) FROM records WHERE key LIKE ? ESCAPE '\\'", (_like(prefix),)).fetchone()[0]
            )

    def total_size(self, prefix: str = "") -> int:
        """Bytes of every record with *prefix* (as accounted by its writer)."""
        with self._lock:
            return int(
                self._db.execute(
                    "SELECT coalesce(sum(size), 0) FROM records WHERE key LIKE ? ESCAPE '\\'", (_like(prefix),)
                ).fetchone()[0]
            )

    def prune_tombstones(self) -> None:
        """Forget the oldest removals when there are many (a process that synced before
        them reloads everything instead)."""
        with self.transaction():
            count = self._db.execute("SELECT count(*) FROM removed").fetchone()[0]
            if count <= _TOMBSTONES_KEPT:
                return
            cut = self._db.execute(
                "SELECT version FROM removed ORDER BY version LIMIT 1 OFFSET ?", (count - _TOMBSTONES_KEPT // 2,)
            ).fetchone()[0]
            self._db.execute("DELETE FROM removed WHERE version < ?", (cut,))
            self._db.execute("UPDATE counter SET floor = ? WHERE id = 0", (cut,))

    def close(self) -> None:
        """Write the uses noted, forget the oldest removals when there are many, and close
        the database. A failed write here is logged (the counters only order eviction)."""
        try:
            self.flush_uses()
            self.prune_tombstones()
        except StorageWriteError as error:
            logger.warning("use counters of %s not written: %s", self.folder, error)
        with self._lock:
            self._db.close()


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (rolled back on error), under the store's lock;
    nested uses join the outer transaction. Failures become StorageWriteError."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._outer = False

    def __enter__(self) -> None:
        store = self._store
        store._lock.acquire()
        self._outer = not store._db.in_transaction
        if self._outer:
            try:
                store._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                store._lock.release()
                raise StorageWriteError(f"cannot write to {store.path}: {error}") from error

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        db = self._store._db
        try:
            if not self._outer:
                return
            if error is None:
                try:
                    db.execute("COMMIT")
                    return
                except sqlite3.Error as failure:
                    if db.in_transaction:  # (a full disk may have rolled it back already)
                        db.execute("ROLLBACK")
                    raise StorageWriteError(f"cannot write to {self._store.path}: {failure}") from failure
            if db.in_transaction:
                db.execute("ROLLBACK")
            if isinstance(error, sqlite3.Error):
                raise StorageWriteError(f"cannot write to {self._store.path}: {error}") from error
        finally:
            self._store._lock.release()


def _like(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _as_record(row: tuple[Any, ...]) -> Record:
    key, value, vector, size, hits, last_used, version = row
    return Record(
        key=key,
        value=json.loads(value),
        vector=None if vector is None else np.frombuffer(vector, dtype="<f4").astype(np.float32),
        size=int(size),
        hits=int(hits),
        last_used=float(last_used),
        version=int(version),
    )


def _as_record_or_none(row: tuple[Any, ...]) -> Record | None:
    try:
        return _as_record(row)
    except (ValueError, TypeError):
        return None  # damaged row: skipped (readers treat it as absent)


class StoreFiles:
    """Byte files beside a store's records (chunk states, the index snapshot), in *folder*:
    :meth:`write` (whole or not at all), :meth:`read`, :meth:`delete`, :meth:`names` and
    :meth:`path`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, name: str) -> Path:
        """Where the file *name* (letters, digits, ``-`` and ``_``) lives."""
        if not name or not all(ch.isalnum() or ch in "-_" for ch in name):
            raise ValueError(f"bad file name {name!r}")
        return self.folder / f"{name}.bin"

    def write(self, name: str, data: bytes | Callable[[BinaryIO], None], *, durable: bool = True) -> None:
        """Write *data* to file *name* whole or not at all (temporary file, then rename);
        *data* may be a function that writes into the open file (large files). *durable*:
        on disk before the rename (fsync); a file whose reader checks a digest (a chunk
        state) may skip it: after a power cut it is caught as damaged and dropped, and the
        next request, which would otherwise wait for the disk, does not."""
        path = self.path(name)
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            private_folder(path.parent)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                if callable(data):
                    data(handle)
                else:
                    handle.write(data)
                if durable:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(temporary, path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise StorageWriteError(f"cannot write {path}: {error}") from error

    def read(self, name: str) -> bytes | None:
        """The bytes of file *name*, or None when absent or unreadable."""
        try:
            return self.path(name).read_bytes()
        except OSError:
            return None

    def delete(self, name: str) -> None:
        """Remove file *name* if present."""
        try:
            self.path(name).unlink(missing_ok=True)
        except OSError:
            pass

    def names(self, older_than_s: float = 0.0) -> list[str]:
        """Names of the files stored (those last written more than *older_than_s* ago);
        leftover temporary files of that age are removed."""
        folder = self.folder
        now = time.time()
        names: list[str] = []
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return names
        for entry in entries:
            try:
                old = now - entry.stat().st_mtime >= older_than_s
            except OSError:
                continue
            if entry.name.endswith(".tmp"):
                if old:
                    Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(".bin") and old:
                names.append(entry.name.removesuffix(".bin"))
        return names
