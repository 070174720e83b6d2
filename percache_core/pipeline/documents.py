"""The knowledge verbs of :class:`~percache_core.pipeline.PerCache`: add documents, delete
them, and retrieve from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..answering.parts import CacheParts
from ..answering.request_path import RequestPath
from ..inputs import positive_override, validated_question
from ..knowledge.bank import DocumentInput, validated_document_ids
from ..prediction.scheduler import Scheduler
from ..prediction.worker import IdleWorker
from ..types import Chunk, RetrievedChunk


class DocumentVerbs:
    """``add_documents``, ``delete_documents`` and ``retrieve``."""

    _parts: CacheParts
    _request_path: RequestPath
    _scheduler: Scheduler
    _worker: IdleWorker | None
    _ensure_open: Callable[[], None]

    def add_documents(
        self, documents: Iterable[DocumentInput], *, split: bool = True, progress: bool = False
    ) -> list[Chunk]:
        """Add documents to the knowledge. Re-adding a document with the same text does
        nothing; with the same id and new text it replaces the old chunks (and the answers
        and states made from them).

        Args:
            documents: strings, or dicts with ``text`` and optional ``id`` and ``metadata``.
            split: cut long documents into chunks of about ``chunk_words`` words.
            progress: show a progress bar (long imports).

        Returns:
            The new chunks.

        Raises:
            TypeError: a single document instead of a list, or an item of another type.
            InvalidDocumentError: an empty text, a bad id or metadata that cannot be stored
                (nothing is added).

        >>> pc.add_documents([{"id": "mail-1", "text": "The review moved to Thursday."}])   # doctest: +SKIP
        [Chunk(id='mail-1#c000', ...)]
        """
        self._ensure_open()
        self._parts.activity.touch()
        chunks = self._parts.knowledge.add_documents(documents, split=split, progress=progress)
        if chunks and self.config.tiers.qa_bank:
            self._scheduler.invalidation.documents_added(chunks, self._parts.knowledge.last_replaced)
        return chunks

    def delete_documents(self, doc_ids: Iterable[str]) -> int:
        """Delete documents by id (ids this cache does not hold are skipped).

        Args:
            doc_ids: a list of document ids.

        Returns:
            The number of chunks removed.

        Raises:
            TypeError: a single string instead of a list.
            InvalidDocumentError: an empty id.

        Nothing made from their text stays: their chunks, the QA entries answered from
        them, every stored prompt answer (keys do not say which texts a prompt held), the chunk states that may hold them (only the system prompt's and the
        [system, chunk] states of other chunks are kept; the idle round prefills the rest
        again) and the knowledge abstract (summarised again from the remaining chunks).
        States and entries of a shared tier are not touched.

        >>> pc.delete_documents(["mail-2024-03-02"])   # doctest: +SKIP
        3
        """
        self._ensure_open()
        ids = validated_document_ids(doc_ids)
        with self._parts.activity.user_turn():  # an idle round stops first
            knowledge = self._parts.knowledge
            removing = [chunk for chunk in knowledge.chunks if chunk.doc_id in ids] + knowledge.deferred_chunks(ids)
            self._scheduler.invalidation.documents_deleted(removing, ids)
            if removing:
                self._parts.prompt_answers.clear()  # a key does not say which texts its prompt held
            # the chunks go last: a failure (or kill) before leaves the documents, so a
            # retry does the whole work again
            return len(knowledge.delete_documents(ids))

    def retrieve(self, question: str, k: int | None = None) -> list[RetrievedChunk]:
        """The chunks hybrid retrieval (embeddings and BM25, fused) gives for *question*.

        Args:
            question: the question.
            k: how many chunks (default: ``top_k``).

        Returns:
            The retrieved chunks with their scores, best first.

        Raises:
            InvalidQuestionError: an empty or over-long question.
            ValueError: *k* is not a positive integer.

        >>> [r.chunk.id for r in pc.retrieve("When is the review?", k=2)]   # doctest: +SKIP
        ['mail-1#c000', 'notes-3#c001']
        """
        self._ensure_open()
        return self._parts.knowledge.retrieve(
            validated_question(question), positive_override("k", k, self.config.retrieval.top_k)
        )

    # -- answering ------------------------------------------------------------------------
