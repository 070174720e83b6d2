"""``percache serve --documents``: folders (or globs) of documents ingested at start and
watched while serving (:class:`WatchedDocuments`): a new or changed file is added again,
a removed one is deleted from the cache, so the endpoint's idle work predicts over what
the user keeps there without an extra step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from ..document_files import document_files, read_documents
from ..pipeline import PerCache

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 5.0


class WatchedDocuments:
    """The documents of *patterns* (folders or globs) in *pc*: :meth:`sync` once, then
    :meth:`start` a thread that syncs every *interval_s* seconds until :meth:`stop`.

    >>> watched = WatchedDocuments(pc, ["~/notes"])   # doctest: +SKIP
    >>> watched.sync(); watched.start()                # doctest: +SKIP
    """

    def __init__(self, pc: PerCache, patterns: Sequence[str], *, interval_s: float = WATCH_INTERVAL_S) -> None:
        self._pc = pc
        self._patterns = list(patterns)
        self._interval = interval_s
        self._seen: dict[Path, tuple[float, int, list[str]]] = {}  # file -> (mtime, size, document ids)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def files(self) -> list[Path]:
        """The document files the patterns name now."""
        return sorted({f for pattern in self._patterns for f in document_files(pattern)})

    def sync(self) -> tuple[int, int]:
        """Add new and changed files' documents, delete removed files' documents:
        (documents added, documents deleted)."""
        files = self.files()
        added = deleted = 0
        for path in files:
            try:
                stat = path.stat()
            except OSError:
                continue
            known = self._seen.get(path)
            if known is not None and known[:2] == (stat.st_mtime, stat.st_size):
                continue
            documents = read_documents([path])
            if known is not None:
                gone = set(known[2]) - {str(d["id"]) for d in documents}
                deleted += self._pc.delete_documents(gone) if gone else 0
            if documents:
                self._pc.add_documents(documents, progress=False)
            added += len(documents)
            self._seen[path] = (stat.st_mtime, stat.st_size, [str(d["id"]) for d in documents])
        for path in set(self._seen) - set(files):
            ids = self._seen.pop(path)[2]
            deleted += self._pc.delete_documents(ids) if ids else 0
        return added, deleted

    def start(self) -> WatchedDocuments:
        """Sync every *interval_s* seconds from a thread of its own (a failed sync is logged)."""
        self._thread = threading.Thread(target=self._watch, name="percache-documents", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sync()
            except Exception as error:  # a file half written, a full disk: tried again next time
                logger.warning("documents not synced (%s); tried again in %.0f s", error, self._interval)

    def stop(self) -> None:
        """Stop watching (the sync under way ends first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
