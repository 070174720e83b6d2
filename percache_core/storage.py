"""Persistent key-value storage on diskcache, shared by the tiers.

A :class:`Store` is one diskcache folder. Values are pickled records or raw ``bytes``
(large ``bytes`` land in their own files). diskcache commits each write atomically, so a
crash leaves an entry either absent or whole. PerCache enforces its own byte budgets, so
diskcache's own size limit and eviction are switched off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import CacheFolderError, missing_dependency


class Store:
    """A folder of keyed values.

    >>> import tempfile
    >>> store = Store(tempfile.mkdtemp())
    >>> store.put("qa:1", {"q": "hi"}); store.get("qa:1")
    {'q': 'hi'}
    >>> store.get("qa:2") is None
    True
    >>> sorted(store.keys("qa:"))
    ['qa:1']
    >>> store.close()
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        try:
            import diskcache
        except ImportError as error:
            raise missing_dependency("diskcache", "percache-core") from error
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not os.access(self.folder, os.R_OK | os.W_OK | os.X_OK):
                raise PermissionError(f"no read/write access to {self.folder}")
            self._cache = diskcache.Cache(
                str(self.folder),
                size_limit=2**62,
                eviction_policy="none",
                cull_limit=0,
                statistics=False,
            )
        except (OSError, diskcache.core.Timeout) as error:
            raise CacheFolderError(f"cannot open cache folder {self.folder}: {error}") from error
        except Exception as error:  # sqlite3.DatabaseError for a corrupt index
            raise CacheFolderError(f"cannot open cache folder {self.folder}: {error}") from error

    def put(self, key: str, value: Any) -> None:
        """Store *value* under *key* (replacing any previous value)."""
        self._cache.set(key, value)

    def get(self, key: str, default: Any = None) -> Any:
        """The value under *key*, or *default* when absent."""
        return self._cache.get(key, default)

    def delete(self, key: str) -> None:
        """Remove *key*; absent keys are ignored."""
        self._cache.delete(key)

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Every key starting with *prefix*."""
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith(prefix):
                yield key

    def clear(self, prefix: str = "") -> None:
        """Remove every key starting with *prefix*."""
        for key in list(self.keys(prefix)):
            self._cache.delete(key)

    def file_path(self, key: str) -> Path | None:
        """The file holding the value of *key*, when diskcache keeps it in a file of its own."""
        handle = self._cache.get(key, read=True)
        if handle is None:
            return None
        try:
            name = getattr(handle, "name", None)
        finally:
            handle.close()
        return Path(name) if isinstance(name, str) else None

    def close(self) -> None:
        """Close the underlying database."""
        self._cache.close()
