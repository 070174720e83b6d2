"""The stored-answer verbs of ``pc.caller``: :meth:`~StoredAnswerVerbs.lookup` (a stored
answer the caller may serve, counted as a hit), :meth:`~StoredAnswerVerbs.find`,
:meth:`~StoredAnswerVerbs.entry`, :meth:`~StoredAnswerVerbs.remember` (the caller's own
answer) and :meth:`~StoredAnswerVerbs.forget`. Which stored answer a lookup may serve is
the answer policy's to say (:mod:`percache_core.policies.answers`).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..answering.parts import CacheParts
from ..answering.request import Request, stored_answer
from ..answering.request_path import RequestPath
from ..inputs import similarity_override, validated_question, validated_scope
from ..types import Answer, QAEntry, QAHit

OFFERS_KEPT = 64


def _offer_key(question: str, binding: str, scope: dict[str, Any] | None) -> tuple[str, str, str]:
    return question, binding, json.dumps(scope or {}, sort_keys=True, default=str)


class StoredAnswerVerbs:
    """``pc.caller``'s verbs over the QA bank (see the module docstring)."""

    _parts: CacheParts
    _path: RequestPath
    _ensure_open: Callable[[], None]
    _offered: OrderedDict[tuple[str, str, str], list[QAHit]]

    # -- serving stored answers -------------------------------------------------------------

    def lookup(
        self,
        question: str,
        *,
        binding: str | None = None,
        scope: Mapping[str, Any] | None = None,
        similarity_threshold: float | None = None,
        asked: str | None = None,
    ) -> Answer | None:
        """The stored answer for *question* under *binding* (default: this cache's own
        pipeline's) and *scope*, or None; a hit is counted. When *question* is a key of
        the caller's (a whole prompt), give the user's question as *asked*: it is what idle
        prediction learns from.

        Exact mode (the default) only returns the answer stored for the same question
        text: the same inputs give the same output. Semantic mode returns the best entry at
        or above tau (*similarity_threshold* overrides it) that the verifier accepts
        (approximate).

        Args:
            question: the question, or a key of the caller's (a whole prompt).
            binding: what the answer is bound to (default: this cache's own pipeline's).
            scope: metadata the entry must have been stored with.
            similarity_threshold: semantic mode's tau for this call.
            asked: the user's question when *question* is a key of the caller's.

        Returns:
            The stored :class:`Answer` (a hit, counted), or None.

        Raises:
            InvalidQuestionError: an empty or over-long question.

        >>> hit = pc.caller.lookup("When is the review?", binding="my-app-v1")   # doctest: +SKIP
        """
        self._ensure_open()
        question = validated_question(question)
        config = self._parts.config
        threshold = similarity_override(similarity_threshold, config.tiers.similarity_threshold)
        scope_dict = validated_scope(scope)
        started = time.perf_counter()
        binding = binding or self._parts.binding()
        request = Request(question, binding, scope_dict, config.engine.max_new_tokens, config.retrieval.top_k, started)
        with self._parts.activity.user_turn():
            hit = self._hit(request, threshold, asked)
        if hit is None:
            return None
        policy = self._parts.answers
        accuracy = policy.estimated_accuracy(hit)
        answer = stored_answer(request, hit, approximate=policy.approximate, estimated_accuracy=accuracy)
        self._path.count(answer)
        return answer

    def _hit(self, request: Request, similarity_threshold: float, asked: str | None) -> QAHit | None:
        """In exact mode the entry stored for this very question text (not one taken in
        from the shared tier: see :mod:`percache_core.shared.redis_tier`), in semantic mode
        the best verified one at or above *similarity_threshold*; counted as a hit, and
        *asked* (default *question*) recorded for history prediction."""
        parts, question, scope = self._parts, request.question, request.scope
        embedding = request.embedding = parts.embed_key(question)
        hit, offered = parts.answers.caller_hit(self._path.lookup(request, similarity_threshold))
        if hit is None and offered:  # the caller's answer, when it remembers one, labels them
            self._offered[_offer_key(question, request.binding, scope)] = offered
            while len(self._offered) > OFFERS_KEPT:
                self._offered.popitem(last=False)
        parts.activity.record_question(asked or question, embedding, hit, scope)
        return hit

    def find(
        self, question: str, *, binding: str | None = None, scope: Mapping[str, Any] | None = None
    ) -> QAEntry | None:
        """The entry stored for exactly *question* under *binding* and *scope*, not counted
        as a hit (for checking, e.g. whether a predicted question still needs an answer).

        Args:
            question: the question text (or the caller's key).
            binding: what the answer is bound to (default: this cache's own pipeline's).
            scope: the metadata it was stored with.

        Returns:
            The :class:`QAEntry`, or None.

        Raises:
            InvalidQuestionError: an empty or over-long question.

        >>> pc.caller.find("When is the review?") is None   # doctest: +SKIP
        True
        """
        self._ensure_open()
        binding = binding or self._parts.binding()
        return self._parts.qa_bank.find(validated_question(question), scope=validated_scope(scope), binding=binding)

    def entry(self, entry_id: str) -> QAEntry | None:
        """The QA entry with this id.

        Args:
            entry_id: an entry's id (``Answer.entry_id``).

        Returns:
            The :class:`QAEntry`, or None.

        >>> pc.caller.entry(pc.answer("When?").entry_id)   # doctest: +SKIP
        """
        self._ensure_open()
        return self._parts.qa_bank.get(entry_id)

    # -- running the caller's prompts -------------------------------------------------------

    def remember(
        self,
        question: str,
        answer: str,
        *,
        binding: str | None = None,
        scope: Mapping[str, Any] | None = None,
        chunk_ids: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
    ) -> QAEntry:
        """Store *answer* (the caller's own) for *question* under *binding* (default: this
        cache's own pipeline's) and *scope*; it replaces an earlier answer to the same
        question there. The model's own answers never replace a remembered one, and new
        documents never make it stale: ``pc.answer()`` of the same question (same scope,
        default settings) returns it as given, ``source="remembered"``, without the model.
        It goes with :meth:`forget`, and with ``delete_documents`` of a document in
        *chunk_ids*.

        Args:
            question: the question (or the caller's key).
            answer: the caller's answer text.
            binding, scope: where it is stored (default binding: this cache's own pipeline's).
            chunk_ids: the chunks it came from (deleting their document deletes it).
            metadata: kept with the entry (``origin`` names it for :meth:`forget`).

        Returns:
            The stored :class:`QAEntry`.

        Raises:
            InvalidQuestionError: an empty or over-long question.
            TypeError: an answer that is not a string.

        >>> pc.caller.remember("When is the review?", "Monday.")   # doctest: +SKIP
        """
        self._ensure_open()
        question = validated_question(question)
        if not isinstance(answer, str):
            raise TypeError(f"answer must be a string, got {type(answer).__name__}")
        scope_dict = validated_scope(scope)
        extra = dict(metadata or {})
        extra["remembered"] = True  # never made stale, never replaced by the model's output
        if scope_dict:
            extra["scope"] = scope_dict
        extra["binding"] = binding or self._parts.binding()
        embedding = self._parts.embed_key(question)
        offered = self._offered.pop(_offer_key(question, extra["binding"], scope_dict), [])
        self._parts.calibration.add_many(  # the stored answers a lookup offered, against the caller's own
            self._path.records.label(question, hit, answer, "asked")
            for hit in offered
            if hit.entry.answer is not None and hit.entry.question != question
        )
        return self._parts.qa_bank.put(question, embedding, answer, chunk_ids=chunk_ids, metadata=extra)

    def forget(self, *, entry_ids: Sequence[str] = (), origin: str | None = None) -> int:
        """Delete QA entries: those with these ids, and every entry whose ``origin`` is
        *origin* (the ``metadata["origin"]`` the caller gave :meth:`remember`).

        Args:
            entry_ids: ids of entries (``Answer.entry_id``).
            origin: delete every entry remembered with this origin.

        Returns:
            How many entries were deleted.

        Raises:
            TypeError: one string instead of a sequence of ids.

        >>> pc.caller.forget(origin="my-app")   # doctest: +SKIP
        3
        """
        self._ensure_open()
        if isinstance(entry_ids, str):
            raise TypeError("entry_ids must be a sequence of ids, not one string")
        bank = self._parts.qa_bank
        doomed = set(entry_ids)
        if origin is not None:
            doomed |= {entry.id for entry in bank.entries if entry.origin == origin}
        return sum(bank.delete(entry_id) for entry_id in doomed)
