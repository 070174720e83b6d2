"""A request on the request path, the keys that identify what it asks, and the
:class:`~percache_core.types.Answer` records built for it.

- :class:`Request`: one question (or a caller's prompt) with what is computed for it once:
  its embedding, its binding, its retrieval (run when first needed), the clock and the
  timings;
- :class:`IdleQuestion`: a question idle work answers with this cache's own prompt;
- :func:`asked_key` and :func:`prompt_answer_key`: the keys of a question's asked record
  and of a prompt's stored answer;
- :func:`stored_answer`, :func:`prompt_answered`, :func:`generated_answer`: the answer
  served from a QA entry, from an identical prompt's stored answer, or by the model.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..knowledge.bank import KnowledgeBank
from ..kv.engine import Decoding
from ..qa.prompt_answers import PromptAnswer, prompt_key
from ..serving.prompting import PromptLayout
from ..serving.state_runner import RelayedRequest, RunResult
from ..types import Answer, AnswerSource, QAEntry, QAHit, RetrievedChunk
from .parts import CacheParts

RELAY_STREAM_FIELDS = ("stream", "stream_options")  # how a reply is sent, not what it says


@dataclass(frozen=True)
class AskedKey:
    """The key of a question's asked record (see :func:`asked_key`) and the knowledge
    version it was taken at."""

    key: str
    knowledge_version: int


@dataclass
class Request:
    """One question on its way through the request path.

    Attributes:
        question: the question (or a caller's prompt).
        binding: the binding of the answers it may be served and stores.
        scope: the scope it was asked in.
        max_new_tokens: the longest answer.
        top_k: its retrieval depth.
        started: when the call began (``time.perf_counter``).
        embedding: its embedding, once computed (None before, and for a caller's prompt).
        timings: seconds per step.
        best_similarity: the best QA-bank similarity seen, when consulted.
        offered: the QA entries seen (same binding and scope), best first.
        asked: its asked record's key (this cache's own retrieval makes the prompt).
    """

    question: str
    binding: str = ""
    scope: dict[str, Any] | None = None
    max_new_tokens: int = 0
    top_k: int = 0
    started: float = field(default_factory=time.perf_counter)
    embedding: np.ndarray | None = None
    timings: dict[str, float] = field(default_factory=dict)
    best_similarity: float | None = None
    offered: list[QAHit] = field(default_factory=list)
    asked: AskedKey | None = None
    _retrieved: list[RetrievedChunk] | None = field(default=None, repr=False)

    def timed(self, name: str, since: float) -> float:
        """Add the seconds since *since* to timing *name*; returns now."""
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - since
        return now

    def retrieved(self, knowledge: KnowledgeBank) -> list[RetrievedChunk]:
        """The chunks the question retrieves from *knowledge* (hybrid, at its depth and
        scope): retrieval runs once, when first needed."""
        if self._retrieved is None:
            self._retrieved = knowledge.retrieve(
                self.question, self.top_k, question_embedding=self.embedding, where=self.scope
            )
        return self._retrieved


@dataclass(frozen=True)
class IdleQuestion:
    """A question idle work answers with this cache's own prompt (a predicted, stale,
    pending or follow-up one).

    Attributes:
        question: its text.
        embedding: its embedding.
        origin: why it is answered (``predicted-knowledge``, ``refresh``, ``follow-up``, ...).
        scope: the scope it is answered in.
        decode: decode the answer (False: prefill only, a pending entry).
        replacing: the QA entry the answer replaces (a refresh or a conversion).
        store: store the question in the QA bank.
    """

    question: str
    embedding: np.ndarray
    origin: str
    scope: dict[str, Any] | None = None
    decode: bool = True
    replacing: QAEntry | None = None
    store: bool = True


# -- keys -------------------------------------------------------------------------------


def asked_key(parts: CacheParts, question: str, scope: dict[str, Any] | None, binding: str) -> AskedKey | None:
    """The key of *question*'s asked record: a digest of the question text, its scope and
    everything else that decides the prompt this cache's own pipeline builds for it (the
    knowledge's version, the embedder, the fusion constant and the *binding*: model,
    template, retrieval depth, context policy, generation settings). The same key means the
    same retrieval, so the same prompt and the same answer. None when ``qa_bank=False``."""
    config = parts.config
    if not config.tiers.qa_bank:
        return None
    version = parts.knowledge.version
    payload = {
        "question": question,
        "scope": scope or None,
        "binding": binding,
        "knowledge": version,
        "embedder": parts.embedder.name,
        "rrf_k": config.retrieval.rrf_k,
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode("utf-8")).hexdigest()
    return AskedKey(digest, version)


def prompt_answer_key(
    parts: CacheParts, layout: PromptLayout, decoding: Decoding, relay: RelayedRequest | None = None
) -> str | None:
    """The key of a prompt's answer (:func:`~percache_core.qa.prompt_answers.prompt_key` of the
    engine, its pieces and the *decoding*, or a relayed request's path and body), or None
    when ``qa_bank=False``."""
    config = parts.config
    if not config.tiers.qa_bank:
        return None
    sampling = decoding.sampling or config.engine.sampling
    settings: dict[str, Any] = {
        "max_new_tokens": decoding.max_new_tokens,
        "sampling": [sampling.temperature, sampling.top_p, sampling.seed],
        "stop": list(config.engine.stop if decoding.stop is None else decoding.stop),
        "trim": decoding.trim,
    }
    if relay is not None:  # the server's endpoint decodes as the body says
        settings = {"relay": [relay.path, {k: v for k, v in relay.body.items() if k not in RELAY_STREAM_FIELDS}]}
    # a prompt in stock's calls gives the same output however it is cut (under the engine's
    # rule): one piece; other prompts are keyed by the calls they run in
    pieces = [layout.tokens] if layout.stock_calls else [s.tokens for s in layout.segments]
    return prompt_key(parts.runtime.model_id(), pieces, settings)


# -- answers ----------------------------------------------------------------------------


def stored_answer(
    request: Request,
    hit: QAHit,
    *,
    source: AnswerSource = "qa_bank",
    approximate: bool = True,
    estimated_accuracy: float | None = None,
) -> Answer:
    """An answer served from a QA entry without the model: semantic mode's hit
    (*approximate*), an exact-mode lookup of the same question, or a remembered answer."""
    elapsed = time.perf_counter() - request.started
    return Answer(
        text=hit.entry.answer or "",
        source=source,
        question=request.question,
        similarity=hit.similarity,
        chunk_ids=hit.entry.chunk_ids,
        ttft_s=elapsed,
        latency_s=elapsed,
        matched_question=hit.entry.question,
        entry_id=hit.entry.id,
        timings=request.timings,
        approximate=approximate,
        predicted=is_predicted(hit.entry),
        estimated_accuracy=estimated_accuracy if approximate else None,
    )


def prompt_answered(request: Request, stored: PromptAnswer) -> Answer:
    """An identical prompt's stored answer, served without the model (exact: the model
    gives this answer to this prompt)."""
    elapsed = time.perf_counter() - request.started
    return Answer(
        text=stored.text,
        source="prompt_answer",
        question=request.question,
        similarity=1.0,
        chunk_ids=stored.chunk_ids,
        generated_tokens=stored.generated_tokens,
        ttft_s=elapsed,
        latency_s=elapsed,
        matched_question=request.question,
        timings=request.timings,
        predicted=stored.idle,
    )


def generated_answer(
    request: Request, result: RunResult, served: QAHit | None = None, estimated_accuracy: float | None = None
) -> Answer:
    """An answer the model produced (through the chunk-state tree), built when the run is
    over: labelled ``qa_bank`` when it is the *served* candidate's answer token for token,
    else with the request's best QA-bank similarity."""
    # what the context kept of the previous prompt is stock llama.cpp's reuse, not the tier's
    restored = (result.reused_chunks > 0 and not result.live_tokens) or result.moved_tokens
    source: AnswerSource = "qa_bank" if served is not None else "chunk_states" if restored else "full"
    now = time.perf_counter()
    return Answer(
        text=result.text,
        source=source,
        question=request.question,
        similarity=served.similarity if served is not None else request.best_similarity,
        matched_question=served.entry.question if served is not None else None,
        entry_id=served.entry.id if served is not None else None,
        predicted=served is not None and is_predicted(served.entry),
        latency_s=now - request.started,
        chunk_ids=result.layout.chunk_ids,
        reused_tokens=result.reused_tokens + result.moved_tokens,
        prefilled_tokens=result.prefilled_tokens,
        generated_tokens=result.generated_tokens,
        reused_chunks=result.reused_chunks,
        ttft_s=result.ttft_s if result.ttft_s is not None else now - request.started,
        timings=request.timings,
        draft_tokens_accepted=result.drafts.accepted,
        approximate=result.approximate,
        idle_reused_chunks=result.idle_reused_chunks,
        idle_reused_tokens=result.idle_reused_tokens,
        estimated_accuracy=estimated_accuracy,
    )


def is_predicted(entry: QAEntry) -> bool:
    """Whether idle work stored *entry* before anyone asked its question (a predicted
    question, or a follow-up of a served one)."""
    origin = entry.origin or ""
    return origin.startswith("predicted") or origin == "follow-up"
