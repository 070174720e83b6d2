"""How a stored answer may be served: :class:`ExactAnswers` (the default: stored answers of
similar questions are drafts the model verifies, so every answer is the cache-off answer)
or :class:`SemanticAnswers` (``qa_mode="semantic"``, approximate: the best entry the bound,
the verifier and its sources allow is served without the model). :func:`answer_policy`
picks one from a configuration, with the bank, the calibration labels and the usage
counters it decides over.

Each policy answers the same questions: whether a question's asked record may answer it
before anything is embedded (:attr:`AnswerPolicy.asks_records`), which stored answers are
drafts (:meth:`AnswerPolicy.drafts`), which one is served without the model
(:meth:`AnswerPolicy.served`), what a caller's lookup finds (:meth:`AnswerPolicy.caller_hit`),
how sure a served answer is (:meth:`AnswerPolicy.estimated_accuracy`) and whether the
model's answers should label what was offered (:attr:`AnswerPolicy.labels_offers`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import BoundSettings, PerCacheConfig, QAMode, TierSettings
from ..qa.bank import QABank
from ..qa.calibration import Calibration
from ..qa.verifier import HitVerifier, make_verifier
from ..types import QAEntry, QAHit
from ..usage import UsageCounters

logger = logging.getLogger(__name__)


@dataclass
class AnswerLookup:
    """One question looked up in the QA bank.

    Attributes:
        question: the question's text.
        embedding: its embedding.
        binding: the binding of the answers it may be served (None: any).
        scope: the scope it was asked in.
        threshold: the least similarity at which an answer may be served.
        context_of: whether the question retrieves an entry's chunks (see
            :func:`~percache_core.qa.calibration.retrieval_context`); "unknown" without it.
        sources_unchanged: whether an entry's sources are still what its question
            retrieves (semantic mode drops an entry whose sources changed).
    """

    question: str
    embedding: np.ndarray
    binding: str | None
    scope: dict[str, Any] | None
    threshold: float
    context_of: Callable[[QAEntry], str] | None = None
    sources_unchanged: Callable[[QAEntry], bool] = field(default=lambda entry: True)

    def context(self, entry: QAEntry) -> str:
        """The retrieval context of *entry* for this question."""
        return self.context_of(entry) if self.context_of is not None else "unknown"


class AnswerPolicy:
    """The decisions about stored answers that a mode makes; see the module docstring.
    Built by :func:`answer_policy` with its collaborators."""

    mode: QAMode = "exact"
    approximate = False  # whether an answer it serves may differ from the model's own

    def __init__(
        self, config: PerCacheConfig, bank: QABank, calibration: Calibration, usage: UsageCounters
    ) -> None:
        self.tiers: TierSettings = config.tiers
        self.bound: BoundSettings = config.bound
        self.bank = bank
        self.calibration = calibration
        self.usage = usage
        self.verifier: HitVerifier = make_verifier(config.tiers.verifier)

    @property
    def asks_records(self) -> bool:
        """Whether the same question asked before is answered from its asked record (the
        prompt it made) before anything is embedded."""
        return False

    def drafts(self, lookup: AnswerLookup) -> list[QAHit]:
        """The stored answers offered as drafts to the model's decoding (best first)."""
        return []

    def served(self, lookup: AnswerLookup) -> tuple[QAHit | None, list[QAHit]]:
        """The entry served without the model, and the entries seen (best first).

        Args:
            lookup: the question and what decides whether an entry may serve it.

        Returns:
            (the served hit or None, the entries considered).
        """
        return None, []

    def caller_hit(self, lookup: AnswerLookup) -> tuple[QAHit | None, list[QAHit]]:
        """What a caller's ``lookup`` finds: the hit and the entries seen."""
        entry = self.bank.find(lookup.question, scope=lookup.scope, binding=lookup.binding)
        if entry is None or entry.from_shared_tier:
            return None, []
        self.bank.record_hit(entry.id)
        return QAHit(entry, 1.0), []  # the very text

    def estimated_accuracy(self, hit: QAHit, context: str = "unknown") -> float | None:
        """The estimated probability that a served *hit* is right (None: exact, or no bound)."""
        return None

    @property
    def labels_offers(self) -> bool:
        """Whether the model's own answers label the entries offered for a question (they
        serve only a bounded semantic mode)."""
        return False

    @property
    def calibrates(self) -> bool:
        """Whether idle work should buy labels (variants of stored questions)."""
        return False


class ExactAnswers(AnswerPolicy):
    """Stored answers of similar questions are drafts that greedy decoding verifies on the
    new question's own prompt: the output is always the cache-off output. A caller's lookup
    finds only the entry stored for the very question text."""

    @property
    def asks_records(self) -> bool:
        return self.tiers.qa_bank

    def drafts(self, lookup: AnswerLookup) -> list[QAHit]:
        if not self.tiers.qa_bank:
            return []
        return self.bank.search(
            lookup.embedding,
            top_n=self.tiers.verifier_candidates,
            similarity_threshold=self.tiers.draft_similarity,
            scope=lookup.scope,
            binding=lookup.binding,
        )


class SemanticAnswers(AnswerPolicy):
    """The paper's approximate behaviour: the best entry at or above the threshold is
    served without the model where, under ``max_error_rate``, the labels of its context
    support its similarity and it is above its own floor; the verifier accepts it; and
    its sources are unchanged (an entry whose sources changed is dropped)."""

    mode: QAMode = "semantic"
    approximate = True

    def served(self, lookup: AnswerLookup) -> tuple[QAHit | None, list[QAHit]]:
        ranked = self.bank.search(
            lookup.embedding,
            top_n=self.tiers.verifier_candidates,
            similarity_threshold=-1.0,
            scope=lookup.scope,
            binding=lookup.binding,
        )
        for candidate in (c for c in ranked if c.similarity >= lookup.threshold):
            if not self._within_bound(candidate, lookup.context(candidate.entry)):
                continue
            verdict = self.verifier.verify(lookup.question, candidate.entry, candidate.similarity)
            if not verdict.accepted:
                self.usage.count_rejection()
                logger.debug("verifier rejected %r for %r: %s", candidate.entry.question, lookup.question, verdict.reason)
                continue
            if not lookup.sources_unchanged(candidate.entry):
                self.bank.delete(candidate.entry.id)
                self.usage.count_stale_drop()
                continue
            self.bank.record_hit(candidate.entry.id)
            return candidate, ranked
        return None, ranked

    def _within_bound(self, candidate: QAHit, context: str) -> bool:
        """Whether the labels of *context* support serving *candidate* at its similarity
        under ``max_error_rate``, above its entry's own floor (always, with no bound)."""
        if not self.bound.bounded:
            return True
        calibrated = self.calibration.threshold(self.bound.max_error_rate, context=context)
        if calibrated is None or candidate.similarity < calibrated:
            return False
        return candidate.similarity > self.calibration.floor(candidate.entry.id)

    def caller_hit(self, lookup: AnswerLookup) -> tuple[QAHit | None, list[QAHit]]:
        if not lookup.embedding.any():  # a whole prompt as the key (CacheParts.embed_key): its very text only
            return super().caller_hit(lookup)
        return self.served(lookup)

    def estimated_accuracy(self, hit: QAHit, context: str = "unknown") -> float | None:
        if not self.bound.bounded:
            return None
        threshold = self.calibration.threshold(self.bound.max_error_rate, context=context)
        at = hit.similarity if threshold is None else min(hit.similarity, threshold)
        return self.calibration.accuracy(at, context=context)

    @property
    def labels_offers(self) -> bool:
        return self.tiers.qa_bank and self.bound.bounded

    @property
    def calibrates(self) -> bool:
        return self.tiers.qa_bank and self.bound.bounded


def answer_policy(
    config: PerCacheConfig, bank: QABank, calibration: Calibration, usage: UsageCounters
) -> AnswerPolicy:
    """The stored-answer policy *config* names (``qa_mode``), deciding over *bank* with
    *calibration*'s labels and counting in *usage*."""
    kind = SemanticAnswers if config.tiers.qa_mode == "semantic" else ExactAnswers
    return kind(config, bank, calibration, usage)
