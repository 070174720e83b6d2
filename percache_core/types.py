"""Typed records that PerCache's parts hand to each other and to users."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

AnswerSource = Literal["qa_bank", "prompt_answer", "remembered", "chunk_states", "full"]
ANSWERED_BEFORE: frozenset[str] = frozenset({"qa_bank", "prompt_answer", "remembered"})


@dataclass(frozen=True)
class Chunk:
    """A piece of a document, the unit of retrieval and of the chunk-state tree.

    ``id`` is stable: ``"<doc_id>#c<index>"``, the same every time the same document is added.
    """

    id: str
    doc_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RetrievedChunk:
    """A chunk returned by hybrid retrieval, with its fused score (higher is better)."""

    chunk: Chunk
    score: float


@dataclass
class QAEntry:
    """One question of the QA bank with its answer (``None`` while pending)."""

    id: str
    question: str
    embedding: np.ndarray
    answer: str | None
    chunk_ids: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    hits: int = 0
    created_at: float = 0.0
    last_used_at: float = 0.0

    # The entry's life, kept in its metadata (stored as JSON with it), read through these.

    @property
    def origin(self) -> str | None:
        """Where the entry came from: ``"user"`` (a user's question),
        ``"predicted-knowledge"`` or ``"predicted-history"`` (a question idle work
        predicted from the knowledge abstract or from the user's questions; ``"predicted"``
        when an older pending entry had none), ``"follow-up"`` (the own answer of a
        question that was served another's), ``"refresh"`` (a stale answer made again
        without an origin of its own), ``"shared"`` (another client's, through Redis), a
        framework adapter's name, or None (a caller's own ``remember`` without one)."""
        return self.metadata.get("origin")

    @property
    def remembered(self) -> bool:
        """True for a caller's own answer (``remember``): never stale, never replaced by
        the model's."""
        return bool(self.metadata.get("remembered", False))

    @property
    def stale(self) -> bool:
        """True when new information may change the answer (a remembered one never is)."""
        return bool(self.metadata.get("stale", False)) and not self.remembered

    @property
    def state(self) -> str:
        """``"pending"`` (no answer yet), ``"stale"`` or ``"answered"``."""
        if self.answer is None:
            return "pending"
        return "stale" if self.stale else "answered"

    @property
    def scope(self) -> dict[str, Any] | None:
        """The scope the entry was stored under (None: the whole knowledge)."""
        return self.metadata.get("scope") or None

    @property
    def binding(self) -> str | None:
        """What the answer is bound to (model, template, settings), or None."""
        return self.metadata.get("binding")

    @property
    def servable(self) -> bool:
        """True when the entry holds an answer that may be returned to a user."""
        return self.state == "answered"

    @property
    def from_shared_tier(self) -> bool:
        """True when the entry was taken in from the shared tier: never served as it is
        without the model (an older signed envelope may have been put back in Redis)."""
        return self.origin == "shared"


@dataclass(frozen=True)
class QAHit:
    """The result of a successful QA-bank check: the entry and its cosine similarity."""

    entry: QAEntry
    similarity: float


@dataclass
class Answer:
    """What ``PerCache.answer`` returns.

    Attributes:
        text: the answer.
        source: where the text came from: ``"qa_bank"`` (a QA entry: served in semantic
            mode, verified as a draft in exact mode, or, from ``pc.caller.lookup`` in exact
            mode, the entry stored for this very question text), ``"prompt_answer"`` (the stored
            answer of an identical prompt, without the model), ``"remembered"`` (the answer
            a caller stored for this question with ``remember()``, returned as given),
            ``"chunk_states"`` (generated; at least one retrieved chunk's KV state was
            restored) or ``"full"`` (generated, prefilled from scratch).
        similarity: cosine similarity of the matched QA entry (QA-bank hits), else the best
            similarity seen in the QA bank (``None`` when the bank was not consulted).
        chunk_ids: the chunks the answer was generated from.
        reused_tokens: prompt tokens restored from stored states (with approximate reuse,
            the chunk tokens moved in from independent states too).
        prefilled_tokens: prompt tokens computed for this answer.
        generated_tokens: tokens decoded.
        ttft_s: seconds from the call to the first answer token.
        latency_s: seconds from the call to the full answer.
        matched_question: the stored question, for QA-bank hits.
        entry_id: the QA entry served, for QA-bank hits.
        approximate: True when the answer may differ from the cache-off answer (semantic
            mode's hits, and answers with chunks composed by ``reuse="approximate"``);
            exact answers, ``qa_bank`` ones included, never do.
        draft_tokens_accepted: answer tokens verified from drafts instead of decoded one
            at a time (stored answers and prompt lookup).
        predicted: served from what idle work stored before the question was asked (a
            predicted question's QA entry, or the stored answer of a prompt idle work ran).
        idle_reused_chunks: of the ``reused_chunks``, those whose states idle work stored
            (the knowledge prefill, predicted questions).
        idle_reused_tokens: the prompt tokens of those chunks.
        estimated_accuracy: for an approximate answer under ``max_error_rate``, the
            estimated probability that it is right (equivalent to the model's own answer to
            this question's prompt), from the calibration labels; None otherwise.
    """

    text: str
    source: AnswerSource
    question: str
    similarity: float | None = None
    chunk_ids: tuple[str, ...] = ()
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    reused_chunks: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    matched_question: str | None = None
    entry_id: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    approximate: bool = False
    draft_tokens_accepted: int = 0
    predicted: bool = False
    idle_reused_chunks: int = 0
    idle_reused_tokens: int = 0
    estimated_accuracy: float | None = None

    @property
    def answered_before(self) -> bool:
        """Whether the text is an answer stored before (``source`` ``"qa_bank"``,
        ``"prompt_answer"`` or ``"remembered"``), not one decoded for this call.

        >>> Answer(text="Friday.", source="prompt_answer", question="When?").answered_before
        True
        """
        return self.source in ANSWERED_BEFORE


def combined_source(answers: Sequence[Answer]) -> AnswerSource:
    """The source of a response made of several model calls (a framework's refine steps),
    in the words every :class:`Answer` uses: the stored answer's source when every call was
    answered before, else ``"chunk_states"`` when a call restored stored states, else
    ``"full"`` (also with no call). Tokens a call kept from the previous prompt in the
    context are not restored chunks: such a call is ``"full"``, as its answer says, and
    the usage counters count each call under its own source.

    >>> ask = lambda source: Answer(text="", source=source, question="q")
    >>> combined_source([ask("prompt_answer"), ask("prompt_answer")])
    'prompt_answer'
    >>> combined_source([ask("full"), ask("chunk_states")]), combined_source([])
    ('chunk_states', 'full')
    """
    if answers and all(a.answered_before for a in answers):
        return answers[0].source
    if any(a.source == "chunk_states" for a in answers):
        return "chunk_states"
    return "full"


T = TypeVar("T")


def live(setting: T | Callable[[], T]) -> Callable[[], T]:
    """A setting read when it is needed: *setting* itself when it is a function (a cache
    passes ``lambda: live_config.current.budgets.qa_bank_budget_bytes``), else a function
    that returns the fixed value (a part used on its own). Parts that read their settings
    this way need nothing pushed into them when the configuration changes.

    >>> live(3)(), live(lambda: 4)()
    (3, 4)
    """
    if callable(setting):
        return setting
    return lambda: setting
