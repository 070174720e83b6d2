"""The request path: embed -> QA candidates -> retrieve -> lay out -> prompt answer, or
run (drafts verified) -> store. Every request to this cache's model takes it, whoever
asks (idle work's free-form LLM calls for the predictor and the abstract are not requests:
:mod:`percache_core.serving.completion`):

- :meth:`RequestPath.answer`: a user's question with this cache's own RAG prompt;
- :meth:`RequestPath.generate`: the same prompt over chunks a caller retrieved;
- :meth:`RequestPath.complete`: a caller's own finished prompt (no QA entry);
- :meth:`RequestPath.populate`: idle work's run of this cache's prompt for a predicted,
  stale, pending or follow-up question (the scheduler keeps no path of its own).

A prompt identical to one answered before (same pieces, engine and decoding settings) is
answered from the stored prompt answers without the model (:mod:`percache_core.qa.prompt_answers`):
the model gives that answer to that prompt, so this is exact in every mode. A question a
caller answered with ``pc.caller.remember()`` (the same text, scope and binding) gets the caller's
answer without the model (``source="remembered"``): the one case where an answer differs
from the model's, because the caller said so.

Two ways to reuse stored answers (``PerCacheConfig.qa_mode``):

- ``"exact"`` (default): the question is retrieved and laid out as usual, and the stored
  answers of similar questions (same binding and scope) are *drafts* that greedy decoding
  verifies on this prompt. The output is always the cache-off output; when it is a stored
  answer token for token, the answer is served as ``source="qa_bank"`` at the cost of one
  batched pass instead of a decode. A changed document changes the prompt, so an old
  answer is never served unverified.
- ``"semantic"`` (the paper's approximate behaviour): the best entry at or above tau that
  the verifier does not reject is served without the model, unless a chunk that its
  question now retrieves is new or changed (then the entry is dropped).

Entries are bound to what produced them (:func:`answer_binding`) and a lookup only sees
entries with the same binding and scope.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import PerCacheConfig
from ..errors import StorageWriteError
from ..kv.engine import Sampling
from ..kv.llama_server import Completion
from ..qa.calibration import Label, retrieval_context
from ..qa.prompt_answers import PromptAnswer, prompt_key
from ..qa.verifier import HitVerifier, make_verifier
from ..types import Answer, AnswerSource, Chunk, QAEntry, QAHit, RetrievedChunk
from .binding import answer_metadata, chunk_sources
from .context import context_chunks
from .parts import CacheParts
from .prompting import PromptLayout, TextPrompt
from .state_runner import RelayedRequest, RunOptions, RunResult, StopCheck
from .streaming import drain

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One question on its way through the request path: what the call asked, with what
    is computed for it once (its embedding and binding), the clock and the timings."""

    question: str
    embedding: np.ndarray
    binding: str  # of the answers this request may serve and stores
    scope: dict[str, Any] | None
    max_new_tokens: int
    top_k: int
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    best_similarity: float | None = None  # the best QA-bank similarity seen, when consulted
    offered: list[QAHit] = field(default_factory=list)  # QA entries seen (same binding and scope), best first
    asked: AskedKey | None = None  # this cache's own retrieval makes the prompt: its asked record

    def timed(self, name: str, since: float) -> float:
        """Add the seconds since *since* to timing *name*; returns now."""
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - since
        return now


class RequestPath:
    """Answers user questions over the cache's *parts*, with its current configuration."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts
        self._verifier_name = parts.config.verifier
        self._verifier = make_verifier(self._verifier_name)

    @property
    def config(self) -> PerCacheConfig:
        return self.parts.config

    @property
    def verifier(self) -> HitVerifier:
        """The semantic-mode verifier named by the current configuration."""
        if self.config.verifier != self._verifier_name:
            self._verifier_name = self.config.verifier
            self._verifier = make_verifier(self._verifier_name)
        return self._verifier

    # -- answering ------------------------------------------------------------------------

    def answer(
        self,
        question: str,
        *,
        similarity_threshold: float,
        top_k: int,
        max_new_tokens: int,
        scope: dict[str, Any] | None,
    ) -> Generator[str, None, Answer]:
        """Yield the answer's text as it is produced; return the :class:`Answer`.

        The same question asked before under the same knowledge, settings and model is
        answered from its asked record before anything is embedded or loaded."""
        parts, config = self.parts, self.config
        started = time.perf_counter()
        binding = parts.binding(top_k=top_k, max_new_tokens=max_new_tokens)
        remembered = self.remembered(question, scope, binding)
        if remembered is not None:  # the caller's own answer to this very question
            parts.activity.record_question(question, remembered.entry.embedding, remembered, scope)
            yield remembered.entry.answer or ""
            answer = stored_answer(question, remembered, started, {}, source="remembered", approximate=False)
            return self._finish(answer)
        # exact mode: semantic mode serves stored answers by similarity first, as before
        asked = asked_key(parts, question, scope, binding) if config.qa_mode == "exact" else None
        found = None if asked is None else parts.prompt_answers.find_asked(asked.key)
        if found is not None:  # this very question, answered before over the same knowledge
            stored = found[1]
            parts.activity.record_question(question, None, None, scope)
            parts.activity.record_retrieval(question, None, scope, stored.chunk_ids)
            yield stored.text
            timings = {"asked": time.perf_counter() - started}
            return self._finish(prompt_answered(question, stored, started, timings))
        embedding = parts.embed_question(question)
        request = Request(question, embedding, binding, scope, max_new_tokens, top_k, started, asked=asked)
        clock = request.timed("embed", started)
        retrieval: list[list[RetrievedChunk]] = []  # one retrieval, once it has run

        def retrieved_ids() -> tuple[str, ...]:  # retrieval runs once, when first needed
            if not retrieval:
                retrieval.append(parts.knowledge.retrieve(question, top_k, question_embedding=embedding, where=scope))
            return tuple(r.chunk.id for r in retrieval[0])

        def context_of(entry: QAEntry) -> str:  # whose prompt would hold the same chunks
            return retrieval_context(retrieved_ids(), entry.chunk_ids)

        if config.qa_bank and config.qa_mode == "semantic":
            hit, request.offered = self.semantic_hit(
                question, embedding, similarity_threshold, scope, binding, top_k, context_of=context_of
            )
            request.best_similarity = request.offered[0].similarity if request.offered else None
            clock = request.timed("qa_check", clock)
            if hit is not None:
                parts.activity.record_question(question, embedding, hit, scope)
                yield hit.entry.answer or ""
                accuracy = self.estimated_accuracy(hit, context_of(hit.entry))
                return self._finish(
                    stored_answer(question, hit, started, request.timings, estimated_accuracy=accuracy)
                )
        candidates = self.candidates(embedding, binding=binding, scope=scope)
        if candidates:
            request.best_similarity = candidates[0].similarity
            request.offered = candidates
        clock = request.timed("qa_check", clock)
        parts.activity.record_question(question, embedding, None, scope)

        retrieved_ids()
        chunks = [r.chunk for r in retrieval[0]]
        parts.activity.record_retrieval(question, embedding, scope, [c.id for c in chunks])
        request.timed("retrieve", clock)
        return (yield from self.run(request, chunks, candidates))

    def remembered(self, question: str, scope: dict[str, Any] | None, binding: str) -> QAHit | None:
        """The answer a caller stored with ``remember()`` for this question text, under
        this scope and binding (counted as a hit), or None."""
        if not self.config.qa_bank:
            return None
        entry = self.parts.qa_bank.find(question, scope=scope, binding=binding)
        if entry is None or not entry.remembered:
            return None
        self.parts.qa_bank.record_hit(entry.id)
        return QAHit(entry, 1.0)

    def complete(
        self,
        question: str,
        *,
        spec: TextPrompt,
        stop: Sequence[str] | None,
        max_new_tokens: int,
        sampling: Sampling | None,
        prompt_lookup: bool,
        trim: bool,
        relay: RelayedRequest | None = None,
    ) -> Generator[str, None, Answer]:
        """Run a caller's own prompt *spec* through the chunk states; an identical prompt
        run before (same pieces, engine and decoding) is answered from the prompt answers
        without the model. No QA-bank entry: the question's answers are the caller's to
        keep. With *relay* the last request is the client's own OpenAI request on a
        server's endpoint (its body is part of the key; a stored answer's finish reason is
        set on it). Yields text; returns the :class:`Answer`."""
        started = time.perf_counter()
        runner = self.parts.runtime.runner
        layout = runner.lay_out(question, [], spec=spec, max_new_tokens=max_new_tokens)
        sampling = sampling or self.config.sampling
        key = prompt_answer_key(self.parts, layout, max_new_tokens, sampling, stop, trim, relay)
        stored = self.stored_prompt_answer(key)
        if stored is not None and (relay is None or stored.finish_reason):
            if relay is not None:  # what the server said of the run that stored it
                usage = {
                    "completion_tokens": stored.generated_tokens,
                    "prompt_tokens": stored.prompt_tokens,
                    "total_tokens": stored.prompt_tokens + stored.generated_tokens,
                    "prompt_tokens_details": {"cached_tokens": stored.prompt_tokens},
                }
                relay.reply = Completion(text=stored.text, finish_reason=stored.finish_reason, usage=usage)
            yield stored.text
            return self._finish(prompt_answered(question, stored, started, {}))
        background = self.parts.activity.background_stop()  # idle work yields to users
        options = RunOptions(
            max_new_tokens,
            stop=stop,
            sampling=sampling,
            prompt_lookup=prompt_lookup,
            trim=trim,
            idle=background is not None,
            relay=relay,
        )
        result = yield from runner.run(layout, options, should_stop=background, started=started)
        if relay is None or (relay.reply.plain and relay.reply.finish_reason):  # reasoning, tool calls: not kept
            self.remember_prompt_answer(key, result, finish_reason=relay.reply.finish_reason if relay else "")
        return self._finish(generated_answer(question, result, started, dict(result.timings)))

    # -- prompt answers: an identical prompt needs no model --------------------------------

    def stored_prompt_answer(self, key: str | None) -> PromptAnswer | None:
        """The stored answer of the prompt with *key*, if any."""
        return None if key is None else self.parts.prompt_answers.find(key)

    def remember_prompt_answer(
        self, key: str | None, result: RunResult, *, idle: bool | None = None, finish_reason: str = ""
    ) -> bool:
        """Store what an exact run of a prompt produced under *key*, for the next identical
        prompt: a user's run with ``store_answers``, idle work's always (*idle*: idle work
        ran it; None: whether the run was in the background; *finish_reason*: a relayed
        request's). A failed write is logged and counted (the answer stands). Returns
        whether it was stored."""
        parts = self.parts
        if idle is None:
            idle = parts.activity.background_stop() is not None
        if key is None or result.approximate or not (self.config.store_answers or idle):
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

    def remember_asked(self, asked: AskedKey | None, key: str | None) -> None:
        """Record that the question of *asked* is answered by the prompt with *key* (whose
        answer is stored), unless the knowledge changed since *asked* was taken (then the
        retrieval that made the prompt may have seen the change)."""
        if asked is None or key is None or self.parts.knowledge.version != asked.knowledge_version:
            return
        try:
            self.parts.prompt_answers.remember_asked(asked.key, key)
        except StorageWriteError as error:
            logger.warning("asked record not stored (%s)", error)

    def candidates(self, embedding: np.ndarray, *, binding: str, scope: dict[str, Any] | None) -> list[QAHit]:
        """Exact mode: the stored answers offered as drafts (same binding and scope)."""
        config = self.config
        if not config.qa_bank or config.qa_mode != "exact":
            return []
        return self.parts.qa_bank.search(
            embedding,
            top_n=config.verifier_candidates,
            similarity_threshold=config.draft_similarity,
            scope=scope,
            binding=binding,
        )

    def generate(
        self, question: str, chunks: list[Chunk], *, binding: str, scope: dict[str, Any] | None, max_new_tokens: int
    ) -> Generator[str, None, Answer]:
        """:meth:`run` for chunks a caller retrieved (``pc.caller.generate``): the question
        is embedded when the run starts."""
        started = time.perf_counter()
        embedding = self.parts.embed_question(question)
        request = Request(question, embedding, binding, scope, max_new_tokens, self.config.top_k, started)
        return (yield from self.run(request, chunks))

    def run(
        self, request: Request, chunks: list[Chunk], candidates: list[QAHit] | None = None
    ) -> Generator[str, None, Answer]:
        """Generate the answer to *request* from *chunks* with the stored answers of similar
        questions (*candidates*, found here when None) as drafts; label it ``qa_bank`` when
        it is one of them token for token, else store it under the request's binding and
        scope. Yields text; returns the :class:`Answer`. Callers hold the user's turn (idle
        work yields the model to it)."""
        parts, config = self.parts, self.config
        question, tokens = request.question, request.max_new_tokens
        if candidates is None:
            candidates = self.candidates(request.embedding, binding=request.binding, scope=request.scope)
        # stored answers are drafts only where the engine verifies them (in the process)
        drafts = [self.draft_tokens(c.entry) for c in candidates] if parts.runtime.features.token_level else []
        runner = parts.runtime.runner
        if config.context != "fixed":
            clock = time.perf_counter()
            chunks = context_chunks(runner, question, chunks, max_new_tokens=tokens)
            request.timed("adaptive_context", clock)
        clock = time.perf_counter()
        layout = runner.lay_out(question, chunks, max_new_tokens=tokens)
        key = prompt_answer_key(parts, layout, tokens, config.sampling, None)
        stored = self.stored_prompt_answer(key)
        request.timed("prompt_answer", clock)
        if stored is not None:
            self.remember_asked(request.asked, key)
            yield stored.text
            return self._finish(prompt_answered(question, stored, request.started, request.timings))
        background = parts.activity.background_stop()  # idle work yields to users
        recompute = self.recompute_tokens()
        options = RunOptions(
            tokens,
            answer_drafts=drafts,
            approximate=recompute is not None,
            recompute_tokens=recompute,
            idle=background is not None,
        )
        result = yield from runner.run(layout, options, should_stop=background, started=request.started)
        request.timings.update(result.timings)
        if self.remember_prompt_answer(key, result):
            self.remember_asked(request.asked, key)
        served = next((c for c, d in zip(candidates, drafts) if d and result.tokens == d), None)
        if served is not None:
            parts.qa_bank.record_hit(served.entry.id)
        elif config.qa_bank and config.store_answers and result.text and not result.approximate:
            clock = time.perf_counter()
            try:
                self.remember_answer(
                    question, request.embedding, result, chunks, binding=request.binding, scope=request.scope, origin="user"
                )
            except StorageWriteError as error:
                parts.usage.count_storage_failure()
                logger.warning("answer not stored in the QA bank (%s); it is returned all the same", error)
            request.timed("store_qa", clock)
        accuracy = None
        if result.approximate and config.bounded and recompute is not None:
            accuracy = parts.calibration.composed_accuracy(recompute)
        answer = generated_answer(question, result, request.started, request.timings, request, served, accuracy)
        self.label_offered(question, request.offered or candidates, result)
        return self._finish(answer)

    # -- approximate answers within the bound ---------------------------------------------

    def recompute_tokens(self) -> int | None:
        """With ``reuse="approximate"``: the recompute tokens of composed chunks (the fewest
        of :func:`recompute_ladder` that meet ``max_error_rate``, or the configured ones
        without a bound); None: compose nothing (the run is exact)."""
        config = self.config
        if config.reuse != "approximate":
            return None
        if not config.bounded:
            return config.recompute_tokens
        return self.parts.calibration.recompute_choice(recompute_ladder(config), config.max_error_rate)

    def estimated_accuracy(self, hit: QAHit, context: str = "unknown") -> float | None:
        """The estimated probability that a served semantic hit is right (None: no bound):
        the right share of the labels of its *context* at or above the calibrated threshold
        it was served under (or its own similarity, if lower)."""
        config = self.config
        if not config.bounded:
            return None
        calibration = self.parts.calibration
        threshold = calibration.threshold(config.max_error_rate, context=context)
        at = hit.similarity if threshold is None else min(hit.similarity, threshold)
        return calibration.accuracy(at, context=context)

    def label_offered(self, question: str, offered: Sequence[QAHit], result: RunResult, kind: str = "asked") -> int:
        """Compare the stored answers *offered* for *question* with the model's own answer
        to its prompt (*result*, exact): one calibration label each, at no model cost; the
        number of labels. Only where semantic mode is held to a bound (they serve nothing
        else)."""
        config = self.config
        if result.approximate or not result.text or not config.qa_bank:
            return 0
        if config.qa_mode != "semantic" or not config.bounded:
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
        accepted = self.verifier.verify(question, hit.entry, hit.similarity).accepted
        right = self.parts.answers_agree(hit.entry.answer or "", own)
        return Label(hit.entry.id, hit.similarity, right, kind, accepted, context)

    def populate(
        self,
        question: str,
        embedding: np.ndarray,
        *,
        scope: dict[str, Any] | None,
        decode: bool,
        origin: str,
        should_stop: StopCheck,
        replacing: QAEntry | None = None,
        store: bool = True,
    ) -> RunResult:
        """Idle work's run of this cache's own prompt for *question* (a predicted, stale,
        pending or follow-up question): retrieve as :meth:`answer` does, prefill through the
        chunk states and, with *decode*, decode; keep the prompt's answer for an identical
        prompt later, and (with *store*) store the question in the QA bank (pending without
        *decode*), *replacing* the entry it refreshes. Pre-empted by *should_stop* (a user
        waits)."""
        parts, config = self.parts, self.config
        runner = parts.runtime.runner
        retrieved = parts.knowledge.retrieve(question, config.top_k, question_embedding=embedding, where=scope)
        chunks = context_chunks(
            runner, question, [r.chunk for r in retrieved], max_new_tokens=config.max_new_tokens, should_stop=should_stop
        )
        layout = runner.lay_out(question, chunks, max_new_tokens=config.max_new_tokens)
        options = RunOptions(config.max_new_tokens, decode=decode, idle=True)
        result = drain(runner.run(layout, options, should_stop=should_stop))
        if decode:  # the same prompt asked later is answered without the model
            key = prompt_answer_key(parts, result.layout, config.max_new_tokens, config.sampling, None)
            self.remember_prompt_answer(key, result, idle=True)
        if store and config.qa_bank and (result.text or not decode):
            self.remember_answer(
                question,
                embedding,
                result,
                chunks,
                binding=parts.binding(),
                scope=scope,
                origin=origin,
                replacing=replacing,
            )
        return result

    def remember_answer(
        self,
        question: str,
        embedding: np.ndarray,
        result: RunResult,
        chunks: Sequence[Chunk],
        *,
        binding: str,
        scope: dict[str, Any] | None,
        origin: str,
        replacing: QAEntry | None = None,
    ) -> QAEntry:
        """Store what this cache's own prompt produced for *question* (its text, or a
        pending entry for a prefill-only run) in the QA bank, with the metadata drafts and
        staleness checks need; *replacing* is the entry it supersedes (a refresh or a
        conversion). Whether an entry stored before stays is
        :func:`~percache_core.qa.bank.keeps_existing`'s to say."""
        text = result.text or None
        metadata = answer_metadata(result, chunks, binding=binding, scope=scope, origin=origin)
        bank = self.parts.qa_bank
        if replacing is not None and replacing.id in bank:
            return bank.correct(replacing.id, text, chunk_ids=result.layout.chunk_ids, stale=False, **metadata)
        return bank.put(question, embedding, text, chunk_ids=result.layout.chunk_ids, metadata=metadata)

    def draft_tokens(self, entry: QAEntry) -> list[int]:
        """The token ids of an entry's answer: as decoded (model entries), else the
        answer's text tokenized (a guess; verification decides)."""
        tokens = entry.metadata.get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return list(tokens)
        if not entry.answer:
            return []
        return self.parts.runtime.engine.tokenize(" " + entry.answer)

    def semantic_hit(
        self,
        question: str,
        embedding: np.ndarray,
        similarity_threshold: float,
        scope: dict[str, Any] | None,
        binding: str | None,
        top_k: int | None = None,
        *,
        context_of: Callable[[QAEntry], str] | None = None,
    ) -> tuple[QAHit | None, list[QAHit]]:
        """The best entry that may be served without the model, and the entries seen (best
        first). Served: at or above *similarity_threshold* and, under ``max_error_rate``,
        at or above the calibrated threshold of its context (*context_of*: whether the
        question retrieves the entry's chunks; "unknown" without it) and above the entry's
        own floor (see :mod:`percache_core.qa.calibration`); accepted by the verifier;
        sources unchanged."""
        config, calibration = self.config, self.parts.calibration
        ranked = self.parts.qa_bank.search(
            embedding,
            top_n=config.verifier_candidates,
            similarity_threshold=-1.0,
            scope=scope,
            binding=binding,
        )
        for candidate in (c for c in ranked if c.similarity >= similarity_threshold):
            if config.bounded:
                context = context_of(candidate.entry) if context_of is not None else "unknown"
                calibrated = calibration.threshold(config.max_error_rate, context=context)
                if calibrated is None or candidate.similarity < calibrated:
                    continue  # its labels do not support the bound at this similarity
                if candidate.similarity <= calibration.floor(candidate.entry.id):
                    continue
            verdict = self.verifier.verify(question, candidate.entry, candidate.similarity)
            if not verdict.accepted:
                self.parts.usage.count_rejection()
                logger.debug(
                    "verifier rejected %r for %r: %s", candidate.entry.question, question, verdict.reason
                )
                continue
            if not self.sources_unchanged(candidate.entry, scope, top_k or self.config.top_k):
                self.parts.qa_bank.delete(candidate.entry.id)
                self.parts.usage.count_stale_drop()
                continue
            self.parts.qa_bank.record_hit(candidate.entry.id)
            return candidate, ranked
        return None, ranked

    def sources_unchanged(self, entry: QAEntry, scope: dict[str, Any] | None, top_k: int) -> bool:
        """Whether the chunks the entry's question retrieves now (hybrid, as the request
        path does) are the ones its answer came from, unchanged. Entries that do not
        record their sources (caller-remembered answers) are judged by their caller."""
        sources = entry.metadata.get("sources")
        if sources is None:
            return entry.remembered
        retrieved = self.parts.knowledge.retrieve(
            entry.question, top_k, question_embedding=entry.embedding, where=scope
        )
        return chunk_sources([r.chunk for r in retrieved]) == [list(s) for s in sources]

    def _finish(self, answer: Answer) -> Answer:
        self.count(answer)
        return answer

    def count(self, answer: Answer) -> None:
        """Count *answer* in the usage counters, unless it is idle work (a caller's
        pipeline answering a predicted question: see ``UserActivity.background``)."""
        if self.parts.activity.background_stop() is None:
            self.parts.usage.record(answer)


def stored_answer(
    question: str,
    hit: QAHit,
    started: float,
    timings: dict[str, float],
    *,
    source: AnswerSource = "qa_bank",
    approximate: bool = True,
    estimated_accuracy: float | None = None,
) -> Answer:
    """An answer served from a QA entry without the model: semantic mode's hit
    (*approximate*), an exact-mode lookup of the same question, or a remembered answer."""
    elapsed = time.perf_counter() - started
    return Answer(
        text=hit.entry.answer or "",
        source=source,
        question=question,
        similarity=hit.similarity,
        chunk_ids=hit.entry.chunk_ids,
        ttft_s=elapsed,
        latency_s=elapsed,
        matched_question=hit.entry.question,
        entry_id=hit.entry.id,
        timings=timings,
        approximate=approximate,
        predicted=is_predicted(hit.entry),
        estimated_accuracy=estimated_accuracy if approximate else None,
    )


def prompt_answer_key(
    parts: CacheParts,
    layout: PromptLayout,
    max_new_tokens: int,
    sampling: Sampling,
    stop: Sequence[str] | None,
    trim: bool = True,
    relay: RelayedRequest | None = None,
) -> str | None:
    """The key of a prompt's answer (:func:`~percache_core.qa.prompt_answers.prompt_key` of the
    engine, its pieces and the decoding settings, or a relayed request's path and body), or
    None when ``qa_bank=False``."""
    config = parts.config
    if not config.qa_bank:
        return None
    decoding: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "sampling": [sampling.temperature, sampling.top_p, sampling.seed],
        "stop": list(config.stop if stop is None else stop),
        "trim": trim,
    }
    if relay is not None:  # the server's endpoint decodes as the body says
        decoding = {"relay": [relay.path, {k: v for k, v in relay.body.items() if k not in RELAY_STREAM_FIELDS}]}
    # PerCache's own prompt in stock's calls gives the same output however it is cut (under
    # the engine's rule): one piece; other prompts are keyed by the calls they run in
    pieces = [layout.tokens] if layout.stock_calls else [s.tokens for s in layout.segments]
    return prompt_key(parts.runtime.model_id(), pieces, decoding)


RELAY_STREAM_FIELDS = ("stream", "stream_options")  # how a reply is sent, not what it says


@dataclass(frozen=True)
class AskedKey:
    """The key of a question's asked record (see :func:`asked_key`) and the knowledge
    version it was taken at."""

    key: str
    knowledge_version: int


def asked_key(parts: CacheParts, question: str, scope: dict[str, Any] | None, binding: str) -> AskedKey | None:
    """The key of *question*'s asked record: a digest of the question text, its scope and
    everything else that decides the prompt this cache's own pipeline builds for it (the
    knowledge's version, the embedder, the fusion constant and the *binding*: model,
    template, retrieval depth, context policy, generation settings). The same key means the
    same retrieval, so the same prompt and the same answer. None when ``qa_bank=False``."""
    config = parts.config
    if not config.qa_bank:
        return None
    version = parts.knowledge.version
    payload = {
        "question": question,
        "scope": scope or None,
        "binding": binding,
        "knowledge": version,
        "embedder": parts.embedder.name,
        "rrf_k": config.rrf_k,
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode("utf-8")).hexdigest()
    return AskedKey(digest, version)


def prompt_answered(question: str, stored: PromptAnswer, started: float, timings: dict[str, float]) -> Answer:
    """An identical prompt's stored answer, served without the model (exact: the model
    gives this answer to this prompt)."""
    elapsed = time.perf_counter() - started
    return Answer(
        text=stored.text,
        source="prompt_answer",
        question=question,
        similarity=1.0,
        chunk_ids=stored.chunk_ids,
        generated_tokens=stored.generated_tokens,
        ttft_s=elapsed,
        latency_s=elapsed,
        matched_question=question,
        timings=timings,
        predicted=stored.idle,
    )


def generated_answer(
    question: str,
    result: RunResult,
    started: float,
    timings: dict[str, float],
    request: Request | None = None,
    served: QAHit | None = None,
    estimated_accuracy: float | None = None,
) -> Answer:
    """An answer the model produced (through the chunk-state tree), built when the run is
    over: labelled ``qa_bank`` when it is the *served* candidate's answer token for token,
    else with the *request*'s best QA-bank similarity."""
    # what the context kept of the previous prompt is stock llama.cpp's reuse, not the tier's
    restored = (result.reused_chunks > 0 and not result.live_tokens) or result.moved_tokens
    source: AnswerSource = "qa_bank" if served is not None else "chunk_states" if restored else "full"
    return Answer(
        text=result.text,
        source=source,
        question=question,
        similarity=served.similarity if served is not None else request.best_similarity if request else None,
        matched_question=served.entry.question if served is not None else None,
        entry_id=served.entry.id if served is not None else None,
        predicted=served is not None and is_predicted(served.entry),
        latency_s=time.perf_counter() - started,
        chunk_ids=result.layout.chunk_ids,
        reused_tokens=result.reused_tokens + result.moved_tokens,
        prefilled_tokens=result.prefilled_tokens,
        generated_tokens=result.generated_tokens,
        reused_chunks=result.reused_chunks,
        ttft_s=result.ttft_s if result.ttft_s is not None else time.perf_counter() - started,
        timings=timings,
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


def recompute_ladder(config: PerCacheConfig) -> tuple[int, ...]:
    """The recompute settings composed chunk states are calibrated at: the configured
    ``recompute_tokens`` and the larger of 16, 32, 64 and 128 tokens.

    >>> recompute_ladder(PerCacheConfig(recompute_tokens=16))
    (16, 32, 64, 128)
    """
    base = config.recompute_tokens
    return tuple(sorted({base, *(t for t in (16, 32, 64, 128) if t > base)}))
