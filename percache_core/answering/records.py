"""What a run leaves for later requests: the prompt's answer (an identical prompt needs no
model), the question's asked record (the same question needs no retrieval), the QA entry
(drafts, or semantic hits) and calibration labels (the bound).

:class:`RunRecords`' verbs: :meth:`~RunRecords.prompt_answer` (find), and
:meth:`~RunRecords.keep_prompt_answer`, :meth:`~RunRecords.keep_asked`,
:meth:`~RunRecords.keep_answer`, :meth:`~RunRecords.label_offered` and
:meth:`~RunRecords.label` (store). A failed write is logged (and counted where the usage
counters track it); the answer stands.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import StorageWriteError
from ..qa.calibration import Label, retrieval_context
from ..qa.prompt_answers import PromptAnswer
from ..serving.binding import answer_metadata
from ..serving.state_runner import RunResult
from ..types import Chunk, QAEntry, QAHit
from .parts import CacheParts
from .request import AskedKey, Request

logger = logging.getLogger(__name__)


class RunRecords:
    """Stores what runs over one cache's *parts* produced (see the module docstring)."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def prompt_answer(self, key: str | None) -> PromptAnswer | None:
        """The stored answer of the prompt with *key*, if any."""
        return None if key is None else self.parts.prompt_answers.find(key)

    def keep_prompt_answer(
        self, key: str | None, result: RunResult, *, idle: bool | None = None, finish_reason: str = ""
    ) -> bool:
        """Store what an exact run of a prompt produced under *key*, for the next identical
        prompt (not a run batched with another request on a server: its text is the server's
        under that batching only): a user's run with ``store_answers``, idle work's always (*idle*: idle work
        ran it; None: whether the run was in the background; *finish_reason*: a relayed
        request's). Returns whether it was stored."""
        parts = self.parts
        if idle is None:
            idle = parts.activity.background_stop() is not None
        if key is None or result.approximate or result.batched or not (parts.config.tiers.store_answers or idle):
            return False
        answer = PromptAnswer(
            result.text,
            tuple(result.tokens),
            prompt_tokens=result.layout.n_tokens,
            generated_tokens=result.generated_tokens,
            chunk_ids=result.layout.chunk_ids,
            idle=idle,
            finish_reason=finish_reason,
        )
        try:
            parts.prompt_answers.put(key, answer)
        except StorageWriteError as error:
            parts.usage.count_storage_failure()
            logger.warning("prompt answer not stored (%s); the answer is returned all the same", error)
            return False
        return True

    def keep_asked(self, asked: AskedKey | None, key: str | None) -> None:
        """Record that the question of *asked* is answered by the prompt with *key* (whose
        answer is stored), unless the knowledge changed since *asked* was taken (then the
        retrieval that made the prompt may have seen the change)."""
        if asked is None or key is None or self.parts.knowledge.version != asked.knowledge_version:
            return
        try:
            self.parts.prompt_answers.remember_asked(asked.key, key)
        except StorageWriteError as error:
            logger.warning("asked record not stored (%s)", error)

    def keep_answer(
        self, request: Request, result: RunResult, chunks: Sequence[Chunk], origin: str, replacing: QAEntry | None = None
    ) -> QAEntry:
        """Store what this cache's own prompt produced for *request* (its text, or a
        pending entry for a prefill-only run) in the QA bank under its binding and scope,
        with the metadata drafts and staleness checks need; *replacing* is the entry it
        supersedes (a refresh or a conversion). Whether an entry stored before stays is
        :func:`~percache_core.qa.bank.keeps_existing`'s to say.

        Raises:
            StorageWriteError: the bank could not write it.
        """
        assert request.embedding is not None
        text = result.text or None
        metadata = answer_metadata(result, chunks, binding=request.binding, scope=request.scope, origin=origin)
        bank = self.parts.qa_bank
        if replacing is not None and replacing.id in bank:
            return bank.correct(replacing.id, text, chunk_ids=result.layout.chunk_ids, stale=False, **metadata)
        return bank.put(request.question, request.embedding, text, chunk_ids=result.layout.chunk_ids, metadata=metadata)

    def label_offered(self, question: str, offered: Sequence[QAHit], result: RunResult, kind: str = "asked") -> int:
        """Compare the stored answers *offered* for *question* with the model's own answer
        to its prompt (*result*, exact): one calibration label each, at no model cost; the
        number of labels. Only where the answer policy wants them (a bounded semantic mode:
        they serve nothing else)."""
        if result.approximate or result.batched or not result.text or not self.parts.answers.labels_offers:
            return 0
        chunk_ids = result.layout.chunk_ids
        labels = [
            self.label(question, hit, result.text, kind, retrieval_context(chunk_ids, hit.entry.chunk_ids))
            for hit in offered
            if hit.entry.answer is not None and not hit.entry.remembered and not hit.entry.stale
        ]
        try:
            self.parts.calibration.add_many(labels)
        except StorageWriteError as error:
            logger.warning("calibration labels not stored (%s)", error)
        return len(labels)

    def label(self, question: str, hit: QAHit, own: str, kind: str, context: str = "unknown") -> Label:
        """The calibration label of stored answer *hit* offered for *question*, whose own
        answer is *own*: right or not, whether the verifier would let it through, and the
        *context* (see :mod:`percache_core.qa.calibration`)."""
        accepted = self.parts.answers.verifier.verify(question, hit.entry, hit.similarity).accepted
        right = self.parts.answers_agree(hit.entry.answer or "", own)
        return Label(hit.entry.id, hit.similarity, right, kind, accepted, context)
