"""The knowledge bank: the user's documents as chunks, with hybrid (BM25 + dense) retrieval.

Chunks, their embeddings and their documents persist in a :class:`~percache_core.storage.Store`.
Retrieval (:class:`~percache_core.knowledge.index.ChunkIndex`) fuses a BM25 ranking and a cosine
ranking of the chunk embeddings with reciprocal-rank fusion, and takes the question
embedding from the caller, so the embedding computed for the QA bank is computed once.
Chunks other processes add are taken in as changes since the last version seen (a full
reload only after removals), so adding to a large knowledge base does not reread it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidDocumentError, StorageWriteError
from ..storage import Record, Store, json_text
from ..types import Chunk, RetrievedChunk, live
from .bm25 import bm25_tokens
from .chunking import split_into_chunks
from .embedding import Embedder
from .index import ChunkIndex
from .snapshot import Snapshot, read_snapshot, write_snapshot

DocumentInput = str | Mapping[str, Any]

MAX_DOCUMENT_CHARS = 20_000_000
SNAPSHOT_MIN_CHUNKS = 5_000  # below this, reading the records is quick enough

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Document:
    id: str
    text: str
    metadata: dict[str, Any]


def _as_document(item: DocumentInput) -> _Document:
    if isinstance(item, str):
        text, doc_id, metadata = item, None, {}
    elif isinstance(item, Mapping):
        text = item.get("text")
        doc_id = item.get("id", item.get("doc_id"))
        metadata = dict(item.get("metadata") or {})
        if not isinstance(text, str):
            raise InvalidDocumentError(f"document {doc_id!r} has no 'text' string")
        if doc_id is not None and not isinstance(doc_id, str):
            raise InvalidDocumentError(f"document id must be a string, got {type(doc_id).__name__}")
    else:
        raise TypeError(f"a document must be a string or a dict with 'text', got {type(item).__name__}")
    if not text.strip():
        raise InvalidDocumentError(f"document {doc_id or ''!r} is empty")
    if len(text) > MAX_DOCUMENT_CHARS:
        raise InvalidDocumentError(
            f"document {doc_id or ''!r} has {len(text):,} characters; split it (max {MAX_DOCUMENT_CHARS:,})"
        )
    if doc_id is None:
        doc_id = "doc-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
    try:
        json_text(metadata)
    except TypeError as error:
        raise InvalidDocumentError(f"document {doc_id!r} has metadata that cannot be stored: {error}") from None
    return _Document(doc_id, text, metadata)


def validated_document_ids(doc_ids: Iterable[str]) -> set[str]:
    """The document ids of a deletion, checked before any work.

    >>> sorted(validated_document_ids(["b", "a"]))
    ['a', 'b']
    >>> validated_document_ids("a")
    Traceback (most recent call last):
    ...
    TypeError: give a list of document ids, not a single string
    """
    if isinstance(doc_ids, (str, bytes)):
        raise TypeError("give a list of document ids, not a single string")
    if not isinstance(doc_ids, Iterable):
        raise TypeError(f"document ids must be a list of strings, got {type(doc_ids).__name__}")
    ids = list(doc_ids)
    for doc_id in ids:
        if not isinstance(doc_id, str) or not doc_id:
            raise InvalidDocumentError(f"a document id must be a non-empty string, got {doc_id!r}")
    return set(ids)


def _parsed_documents(documents: Iterable[DocumentInput]) -> list[_Document]:
    """Every document of an ``add_documents`` call, checked before any work.

    Raises:
        TypeError: a single document instead of a list, or not a list.
        InvalidDocumentError: a bad document, or one id twice.
    """
    if isinstance(documents, (str, bytes, Mapping)):
        raise TypeError("add_documents takes a list of documents, not a single document")
    if not isinstance(documents, Iterable):
        raise TypeError(f"add_documents takes a list of documents, got {type(documents).__name__}")
    parsed = [_as_document(item) for item in documents]
    seen: set[str] = set()
    for document in parsed:
        if document.id in seen:
            raise InvalidDocumentError(f"document id {document.id!r} appears twice in one call")
        seen.add(document.id)
    return parsed


class KnowledgeBank:
    """Chunks of the user's documents with BM25 and dense retrieval.

    Args:
        store: where chunks and embeddings persist.
        embedder: embeds chunk texts (and the caller's questions).
        chunk_words: target chunk length when documents are split.
        rrf_k: reciprocal-rank-fusion constant.
    """

    def __init__(
        self,
        store: Store,
        embedder: Embedder,
        *,
        chunk_words: int | Callable[[], int] = 100,
        rrf_k: int | Callable[[], int] = 60,
        snapshot_min_chunks: int = SNAPSHOT_MIN_CHUNKS,
    ) -> None:
        self._store = store
        self._embedder = embedder
        self._chunk_words = live(chunk_words)
        self._rrf_k = live(rrf_k)
        self._lock = threading.RLock()
        self._index = ChunkIndex()
        self._documents: dict[str, dict[str, Any]] = {}  # doc id -> {"digest", "chunks"}
        self._neighbours: dict[tuple[str, tuple[str, ...], int, bool], list[Chunk]] = {}  # see neighbours()
        self._version = -1
        self._snapshot_min_chunks = snapshot_min_chunks
        self._snapshot_version = -1  # the store version of the snapshot on disk, when known
        self.last_replaced: set[str] = set()  # documents whose text changed in the last add
        self._deferred: dict[str, _Document] = {}  # see defer_documents()
        self.deferred_version = 0  # counts the changes of the queue (callers key their indexes on it)
        self.full_reads = 0  # times every record was read (no usable snapshot, or a removal)
        self.sync()

    def sync(self) -> None:
        """Take in what any process changed since the last sync: new chunks are appended;
        after a removal or a rewrite of a known chunk, everything is reloaded."""
        with self._lock:
            if self._version < 0:
                self._open()
                return
            version = self._store.version()
            if version == self._version:
                return
            taken = self._take_additions()
            if taken is None:
                self._reload()
            self._neighbours = {}
            self._version = version if taken is None else taken

    def _open(self) -> None:
        """The first sync: from the index snapshot beside the store and the chunks added
        after it (see :mod:`percache_core.knowledge.snapshot`), else from the records."""
        version = self._store.version()
        snapshot = read_snapshot(self._store) if self._snapshot_min_chunks > 0 else None
        if snapshot is not None and snapshot.version <= version:
            self._index, self._documents, self._version = snapshot.index, snapshot.documents, snapshot.version
            self._snapshot_version = snapshot.version
            taken = self._take_additions() if version != snapshot.version else version
            if taken is not None and len(self._index) == self._store.count("chunk:"):
                self._version = taken
                return
        self._reload()
        self._version = version

    def _take_additions(self) -> int | None:
        """Append the chunks and documents written since the last sync and return the
        version they reach; None (nothing taken) when a chunk or document was removed or a
        known chunk rewritten: then only a reload is right."""
        changes = self._store.changes(self._version)
        if not changes.complete or any(key.startswith(("chunk:", "doc:")) for key in changes.removed):
            return None
        chunks, vectors, documents = [], [], {}
        for record in changes.written:
            if record.key.startswith("doc:"):
                documents[record.key.removeprefix("doc:")] = record.value
                continue
            chunk = _chunk(record) if record.key.startswith("chunk:") else None
            if chunk is None:
                continue
            if self._index.row(chunk.id) is not None:
                return None
            if self._index.dimension is None or record.vector.shape == (self._index.dimension,):  # type: ignore[union-attr]
                chunks.append(chunk)
                vectors.append(record.vector)
        if vectors and self._index.dimension is None and len({v.shape for v in vectors}) > 1:
            return None  # a damaged record among the first: the reload keeps the common size
        self._index.append(chunks, np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32))
        self._documents.update({k: v for k, v in documents.items() if isinstance(v, dict)})
        return changes.version

    def _reload(self) -> None:
        self.full_reads += 1
        chunks: list[Chunk] = []
        vectors: list[np.ndarray] = []
        for record in self._store.records("chunk:"):
            chunk = _chunk(record)
            if chunk is not None:
                chunks.append(chunk)
                vectors.append(record.vector)  # type: ignore[arg-type]
        documents = {r.key.removeprefix("doc:"): r.value for r in self._store.records("doc:")}
        if vectors:  # a damaged record with another size is left out
            common = Counter(v.shape for v in vectors).most_common(1)[0][0]
            kept = [i for i, v in enumerate(vectors) if v.shape == common]
            chunks, vectors = [chunks[i] for i in kept], [vectors[i] for i in kept]
        self._index = ChunkIndex()
        self._index.append(chunks, np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32))
        self._documents = {k: v for k, v in documents.items() if isinstance(v, dict)}

    @property
    def version(self) -> int:
        """A number that changes with every change of the documents, by any process (read
        from the store: nothing is loaded). Retrieval gives the same chunks for the same
        question, settings and version."""
        return self._store.version()

    def __len__(self) -> int:
        with self._lock:
            self.sync()
            return len(self._index)

    @property
    def chunks(self) -> list[Chunk]:
        """Every chunk, in the order they were added."""
        with self._lock:
            self.sync()
            return list(self._index.chunks)

    def get_chunk(self, chunk_id: str) -> Chunk | None:
        """The chunk with this id, or ``None``."""
        with self._lock:
            self.sync()
            row = self._index.row(chunk_id)
            return None if row is None else self._index.chunks[row]

    def add_documents(
        self, documents: Iterable[DocumentInput], *, split: bool = True, progress: bool = False
    ) -> list[Chunk]:
        """Add documents; return the chunks that are new.

        A document seen before with the same text is skipped; one whose id is known but
        whose text changed replaces its old chunks. With ``split=False`` each document is
        one chunk (for pre-chunked data). Every document is checked before any work, and
        the new chunks are written in one transaction: a call that fails (or a process
        killed in it) leaves the bank as it was, so a retry does the whole work.
        """
        parsed = _parsed_documents(documents)  # validate all before writing
        with self._lock:
            self.sync()
            changed = [item for item in (self._chunked(document, split) for document in parsed) if item is not None]
            new_chunks = [chunk for _, _, chunks in changed for chunk in chunks]
            if not new_chunks:
                self.last_replaced = set()
                return []
            embeddings = self._embed_with_progress([c.text for c in new_chunks], progress)
            replaced = {document.id for document, _, _ in changed if document.id in self._documents}
            old_keys = [
                f"chunk:{chunk.id}" for chunk in self._index.chunks if chunk.doc_id in replaced
            ]
            items: list[tuple[str, Any, np.ndarray | None]] = [
                (
                    f"chunk:{chunk.id}",
                    {"id": chunk.id, "doc_id": chunk.doc_id, "text": chunk.text, "metadata": chunk.metadata},
                    embedding,
                )
                for chunk, embedding in zip(new_chunks, embeddings)
            ]
            items += [
                (f"doc:{document.id}", {"digest": digest, "chunks": len(chunks)}, None)
                for document, digest, chunks in changed
            ]
            version = self._version
            self._store.put_many(items, remove=old_keys)
            self.last_replaced = replaced
            if old_keys or not self._take_own_writes(version, items, new_chunks, embeddings):
                self.sync()
        return new_chunks

    def defer_documents(self, documents: Iterable[DocumentInput]) -> int:
        """Queue documents (each one chunk, as ``split=False``) for :meth:`add_deferred`:
        checked now, embedded and written when idle work adds them. One stored with the
        same text is not queued; a queued id queued again keeps the latest text. Returns
        how many documents wait."""
        parsed = _parsed_documents(documents)
        with self._lock:
            self.sync()
            for document in parsed:
                digest = hashlib.sha1(document.text.encode("utf-8")).hexdigest()
                if self._documents.get(document.id, {}).get("digest") == digest:
                    continue
                if self._deferred.get(document.id) != document:
                    self._deferred[document.id] = document
                    self.deferred_version += 1
            return len(self._deferred)

    @property
    def deferred_texts(self) -> list[str]:
        """The texts of the queued documents (:meth:`defer_documents`)."""
        with self._lock:
            return [document.text for document in self._deferred.values()]

    def deferred_chunks(self, doc_ids: Iterable[str]) -> list[Chunk]:
        """The chunks that the queued documents among *doc_ids* will be."""
        with self._lock:
            queued = [self._deferred[i] for i in doc_ids if i in self._deferred]
        return [Chunk(f"{d.id}#c000", d.id, d.text.strip(), d.metadata) for d in queued]

    def add_deferred(self, count: int) -> list[Chunk]:
        """Add up to *count* queued documents, oldest first (known ones with the same text
        are skipped, as in :meth:`add_documents`); return the new chunks."""
        with self._lock:
            batch = [self._deferred.pop(doc_id) for doc_id in list(self._deferred)[:count]]
            self.deferred_version += bool(batch)
            items = [{"id": d.id, "text": d.text, "metadata": d.metadata} for d in batch]
            return self.add_documents(items, split=False) if items else []

    def _chunked(self, document: _Document, split: bool) -> tuple[_Document, str, list[Chunk]] | None:
        """*document*, the digest of its text and its chunks; None when it is stored with
        the same text already."""
        digest = hashlib.sha1(document.text.encode("utf-8")).hexdigest()
        if self._documents.get(document.id, {}).get("digest") == digest:
            return None
        texts = split_into_chunks(document.text, self._chunk_words()) if split else [document.text.strip()]
        metadata = json.loads(json_text(document.metadata))  # as a reread record has it
        chunks = [Chunk(f"{document.id}#c{index:03d}", document.id, text, metadata) for index, text in enumerate(texts)]
        return document, digest, chunks

    def _take_own_writes(
        self, since: int, items: list[tuple[str, Any, np.ndarray | None]], chunks: list[Chunk], embeddings: np.ndarray
    ) -> bool:
        """Append what this bank just wrote without reading it back, when nothing else was
        written or removed since version *since* (one version per record written, so the
        count tells) and no chunk is one the index holds (else False: :meth:`sync` reads it)."""
        version, written, removed, complete = self._store.changed_keys(since)
        if removed or not complete or version != since + len(items) or sorted(written) != sorted(k for k, _, _ in items):
            return False
        if any(self._index.row(chunk.id) is not None for chunk in chunks):
            return False
        self._index.append(chunks, embeddings)
        self._documents.update({key.removeprefix("doc:"): value for key, value, _ in items if key.startswith("doc:")})
        self._neighbours = {}
        self._version = version
        return True

    def delete_documents(self, doc_ids: Iterable[str]) -> list[Chunk]:
        """Remove these documents' chunks (ids this bank does not hold are skipped); return
        the removed chunks. One transaction: all of them go, or none."""
        wanted = validated_document_ids(doc_ids)
        with self._lock:
            for doc_id in wanted:
                self.deferred_version += self._deferred.pop(doc_id, None) is not None
            self.sync()
            removed = [chunk for chunk in self._index.chunks if chunk.doc_id in wanted]
            known = [doc_id for doc_id in wanted if doc_id in self._documents]
            if not removed and not known:
                return []
            keys = [f"chunk:{chunk.id}" for chunk in removed] + [f"doc:{doc_id}" for doc_id in known]
            self._store.put_many([], remove=keys)
            self.sync()
        return removed

    def _embed_with_progress(self, texts: list[str], progress: bool) -> np.ndarray:
        batch = 64
        starts = range(0, len(texts), batch)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="embedding chunks", unit="batch")
        parts = [self._embedder.embed(texts[start : start + batch]) for start in starts]
        return np.concatenate(parts).astype(np.float32)

    def retrieve(
        self, question: str, k: int, *, question_embedding: np.ndarray | None = None,
        where: Mapping[str, Any] | None = None, dense: bool = False,
    ) -> list[RetrievedChunk]:
        """The *k* chunks most relevant to *question*, best first (hybrid BM25 + dense; with
        *dense*, by the embeddings' similarity alone, as a plain vector store ranks them).

        Pass *question_embedding* (a unit vector) to skip embedding the question again, and
        *where* to keep only chunks whose metadata has all these key/value pairs.
        """
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        with self._lock:
            self.sync()
            if not len(self._index):
                return []
            if question_embedding is None:
                question_embedding = self._embedder.embed([question])[0]
            words = [] if dense else bm25_tokens(question)
            best = self._index.search(words, question_embedding, k, where=where, rrf_k=self._rrf_k(), dense_only=dense)
            return [RetrievedChunk(self._index.chunks[row], score) for row, score in best]

    def similarities(
        self, embedding: np.ndarray, *, where: Mapping[str, Any] | None = None
    ) -> tuple[list[Chunk], np.ndarray]:
        """Every chunk within *where* (all without it) and its embedding's dot product with
        *embedding* (a unit vector: the cosine similarity), in knowledge order."""
        with self._lock:
            self.sync()
            if not len(self._index):
                return [], np.zeros(0, dtype=np.float32)
            scores = self._index.dense_scores(embedding)
            if not where:
                return list(self._index.chunks), scores
            rows = sorted(self._index.scope_rows(where))
            return [self._index.chunks[row] for row in rows], scores[rows]

    def neighbours(self, chunk: Chunk, count: int, *, scope_fields: Iterable[str] = (), dense: bool = False) -> list[Chunk]:
        """The *count* chunks that retrieval ranks first after *chunk* itself when its text
        is the question (its stored embedding; only chunks with its values of
        *scope_fields*; *dense*: as :meth:`retrieve`): the likeliest second chunks of a
        prompt that starts with *chunk*. Remembered until the knowledge changes; [] for a
        chunk that is not here."""
        fields = tuple(sorted(scope_fields))
        key = (chunk.id, fields, count, dense)
        with self._lock:
            self.sync()
            if key not in self._neighbours:
                row = self._index.row(chunk.id)
                if row is None:
                    return []
                where = {name: chunk.metadata[name] for name in fields if name in chunk.metadata} or None
                vector = self._index.vector(row)
                ranked = self.retrieve(chunk.text, count + 1, question_embedding=vector, where=where, dense=dense)
                self._neighbours[key] = [r.chunk for r in ranked if r.chunk.id != chunk.id][:count]
            return self._neighbours[key]

    def embedding_matrix(self) -> tuple[list[Chunk], np.ndarray]:
        """Every chunk and its embedding row (a copy)."""
        with self._lock:
            self.sync()
            return list(self._index.chunks), self._index.matrix

    def close(self) -> None:
        """Write the index snapshot when the knowledge is large and changed, and close the
        underlying store."""
        with self._lock:
            large = self._snapshot_min_chunks > 0 and len(self._index) >= self._snapshot_min_chunks
            if large and self._version >= 0 and self._version != self._snapshot_version:
                try:
                    write_snapshot(self._store, Snapshot(self._index, self._documents, self._version))
                except (StorageWriteError, OSError, ValueError) as error:  # only time is lost
                    logger.warning("knowledge index snapshot not written: %s", error)
            self._store.close()


def _chunk(record: Record) -> Chunk | None:
    """The chunk of a stored record, or None when damaged."""
    value = record.value
    try:
        chunk = Chunk(str(value["id"]), str(value["doc_id"]), str(value["text"]), dict(value["metadata"] or {}))
    except (KeyError, TypeError, ValueError):
        return None
    return chunk if record.vector is not None and record.vector.size else None


def matches_scope(chunk: Chunk, scope: Mapping[str, Any]) -> bool:
    """Whether the chunk's metadata has every key/value pair of *scope*.

    >>> matches_scope(Chunk("m1#c000", "m1", "Hi.", {"meeting_id": "m1"}), {"meeting_id": "m1"})
    True
    """
    return all(chunk.metadata.get(key) == value for key, value in scope.items())
