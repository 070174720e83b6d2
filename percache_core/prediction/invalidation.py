"""What document writes invalidate: answered QA entries that a new chunk now outranks
(marked stale, refreshed in an idle round) and, before a deletion, the QA entries, chunk
states and knowledge abstract built from the removed chunks."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from ..answering.parts import CacheParts
from ..types import Chunk
from .abstract import KnowledgeAbstract

_STALE_CHECK_ROWS = 128  # QA entries scored against every chunk at once in documents_added


class Invalidation:
    """Invalidation on document writes over one cache's *parts*; *round_lock* is the idle
    rounds' lock (a deletion waits for a running round), *abstract* the knowledge abstract."""

    def __init__(self, parts: CacheParts, abstract: KnowledgeAbstract, round_lock: threading.RLock) -> None:
        self.parts = parts
        self.abstract = abstract
        self._lock = round_lock

    def documents_added(
        self, new_chunks: Sequence[Chunk], replaced_documents: set[str] | frozenset[str] = frozenset()
    ) -> int:
        """Mark answered entries for which new information now ranks in the top-k as stale.

        New information is a new chunk that is not one of the entry's own sources, or a
        chunk of a document whose text was replaced. (A document that is new to this cache
        but was the source of an entry, as with entries shared by another device, is not.)
        Answers a caller remembered are the caller's: documents never make them stale.
        """
        parts = self.parts
        if not new_chunks:
            return 0
        entries = [e for e in parts.qa_bank.entries if e.state == "answered" and not e.remembered]
        if not entries:
            return 0
        chunks, matrix = parts.knowledge.embedding_matrix()
        if matrix.size == 0:
            return 0
        new_ids = {c.id for c in new_chunks}
        new_columns = [i for i, c in enumerate(chunks) if c.id in new_ids]
        k = min(parts.config.retrieval.top_k, matrix.shape[0])
        marked = 0
        for start in range(0, len(entries), _STALE_CHECK_ROWS):  # bounded memory at any bank size
            block = entries[start : start + _STALE_CHECK_ROWS]
            scores = np.stack([e.embedding for e in block]) @ matrix.T
            kth_best = -np.partition(-scores, k - 1, axis=1)[:, k - 1]
            for row, entry in enumerate(block):
                sources = set(entry.chunk_ids)
                for column in new_columns:
                    chunk = chunks[column]
                    is_new_information = chunk.id not in sources or chunk.doc_id in replaced_documents
                    if is_new_information and scores[row, column] >= kth_best[row]:
                        parts.qa_bank.correct(entry.id, entry.answer, stale=True)
                        marked += 1
                        break
        return marked

    def documents_deleted(self, removed: Sequence[Chunk], doc_ids: set[str]) -> tuple[int, int]:
        """Before documents are deleted (their chunks *removed*): drop the QA entries
        answered from them, the chunk states that may hold their text, and the knowledge
        abstract (its facts are not traced to chunks, so it is summarised again from the
        chunks that stay). Returns (entries dropped, states dropped). Waits for a running
        idle round to finish."""
        parts = self.parts
        gone = {c.id for c in removed} | doc_ids
        with self._lock:
            entries = 0
            for entry in parts.qa_bank.entries:
                if gone.intersection(entry.chunk_ids):
                    entries += parts.qa_bank.delete(entry.id)
            states = 0
            if removed:
                states = parts.runtime.delete_chunk_states({c.id for c in removed})
                self.abstract.clear()
        return entries, states
