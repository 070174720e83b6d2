"""The request path: embed -> QA candidates -> retrieve -> lay out -> prompt answer, or
run (drafts verified) -> store. Every request to this cache's model takes it, whoever
asks (idle work's free-form LLM calls for the predictor and the abstract are not requests:
:mod:`percache_core.answering.completion`):

- :meth:`RequestPath.answer`: a user's question with this cache's own RAG prompt;
- :meth:`RequestPath.generate`: the same prompt over chunks a caller retrieved;
- :meth:`RequestPath.complete`: a caller's own finished prompt (no QA entry);
- :meth:`RequestPath.populate`: idle work's run of this cache's prompt for a predicted,
  stale, pending or follow-up question (the scheduler keeps no path of its own).

A request is a :class:`~percache_core.answering.request.Request`; what a run leaves for later
requests is stored by :class:`~percache_core.answering.records.RunRecords`; which stored
answers are drafts and which are served without the model is the answer policy's to say
(:mod:`percache_core.policies`).

A prompt identical to one answered before (same pieces, engine and decoding settings) is
answered from the stored prompt answers without the model (:mod:`percache_core.qa.prompt_answers`):
the model gives that answer to that prompt, so this is exact in every mode. A question a
caller answered with ``pc.caller.remember()`` (the same text, scope and binding) gets the caller's
answer without the model (``source="remembered"``): the one case where an answer differs
from the model's, because the caller said so.

Two answer policies (``PerCacheConfig.qa_mode``):

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

import logging
import time
from collections.abc import Callable, Generator
from typing import Any

from ..config import PerCacheConfig
from ..errors import StorageWriteError
from ..kv.engine import Completion, Decoding
from ..policies import AnswerLookup
from ..qa.calibration import retrieval_context
from ..qa.prompt_answers import PromptAnswer
from ..serving.binding import chunk_sources
from ..serving.prompting import TextPrompt
from ..serving.state_runner import RelayedRequest, RunOptions, RunResult, StopCheck
from ..serving.streaming import drain
from ..types import Answer, Chunk, QAEntry, QAHit
from .context import context_chunks
from .parts import CacheParts
from .records import RunRecords
from .request import (
    IdleQuestion,
    Request,
    asked_key,
    generated_answer,
    prompt_answer_key,
    prompt_answered,
    stored_answer,
)

logger = logging.getLogger(__name__)


class RequestPath:
    """Answers requests over one cache's *parts*: :meth:`answer`, :meth:`generate`,
    :meth:`complete` and :meth:`populate`; :attr:`records` keeps what runs produce."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts
        self.records = RunRecords(parts)

    @property
    def config(self) -> PerCacheConfig:
        return self.parts.config

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
        parts, started = self.parts, time.perf_counter()
        binding = parts.binding(top_k=top_k, max_new_tokens=max_new_tokens)
        request = Request(question, binding, scope, max_new_tokens, top_k, started)
        before = self._answered_before(request)
        if before is not None:
            yield before.text
            return self._finish(before)
        request.embedding = parts.embed_question(question)
        clock = request.timed("embed", request.started)
        lookup = self.lookup(request, similarity_threshold, self._context_of(request))
        served = self._served(request, lookup)
        if served is not None:
            request.timed("qa_check", clock)
            yield served.text
            return self._finish(served)
        candidates = parts.answers.drafts(lookup)
        if candidates:
            request.best_similarity = candidates[0].similarity
            request.offered = candidates
        clock = request.timed("qa_check", clock)
        parts.activity.record_question(question, request.embedding, None, scope)
        chunks = [r.chunk for r in request.retrieved(parts.knowledge)]
        parts.activity.record_retrieval(question, request.embedding, scope, [c.id for c in chunks])
        request.timed("retrieve", clock)
        return (yield from self.run(request, chunks, candidates))

    def _answered_before(self, request: Request) -> Answer | None:
        """The caller's remembered answer to this very question, or the stored answer of
        the prompt its asked record names (sets ``request.asked``); None otherwise."""
        parts, question, scope = self.parts, request.question, request.scope
        remembered = self.remembered(question, scope, request.binding)
        if remembered is not None:  # the caller's own answer to this very question
            parts.activity.record_question(question, remembered.entry.embedding, remembered, scope)
            return stored_answer(request, remembered, source="remembered", approximate=False)
        request.asked = asked_key(parts, question, scope, request.binding) if parts.answers.asks_records else None
        found = None if request.asked is None else parts.prompt_answers.find_asked(request.asked.key)
        if found is None:
            return None
        stored = found[1]  # this very question, answered before over the same knowledge
        parts.activity.record_question(question, None, None, scope)
        parts.activity.record_retrieval(question, None, scope, stored.chunk_ids)
        request.timings["asked"] = time.perf_counter() - request.started
        return prompt_answered(request, stored)

    def _context_of(self, request: Request) -> Callable[[QAEntry], str]:
        """Whether *request* retrieves an entry's chunks (its prompt would hold the same
        ones; see :func:`~percache_core.qa.calibration.retrieval_context`)."""
        knowledge = self.parts.knowledge

        def context_of(entry: QAEntry) -> str:
            return retrieval_context(tuple(r.chunk.id for r in request.retrieved(knowledge)), entry.chunk_ids)

        return context_of

    def _served(self, request: Request, lookup: AnswerLookup) -> Answer | None:
        """The answer the answer policy serves without the model (semantic mode), with the
        entries it saw kept on *request*; None where it serves none."""
        parts = self.parts
        if not parts.config.tiers.qa_bank:
            return None
        hit, request.offered = parts.answers.served(lookup)
        request.best_similarity = request.offered[0].similarity if request.offered else None
        if hit is None:
            return None
        parts.activity.record_question(request.question, request.embedding, hit, request.scope)
        accuracy = parts.answers.estimated_accuracy(hit, lookup.context(hit.entry))
        return stored_answer(request, hit, estimated_accuracy=accuracy)

    def remembered(self, question: str, scope: dict[str, Any] | None, binding: str) -> QAHit | None:
        """The answer a caller stored with ``remember()`` for this question text, under
        this scope and binding (counted as a hit), or None."""
        if not self.config.tiers.qa_bank:
            return None
        entry = self.parts.qa_bank.find(question, scope=scope, binding=binding)
        if entry is None or not entry.remembered:
            return None
        self.parts.qa_bank.record_hit(entry.id)
        return QAHit(entry, 1.0)

    def complete(
        self, question: str, spec: TextPrompt, decoding: Decoding, relay: RelayedRequest | None = None
    ) -> Generator[str, None, Answer]:
        """Run a caller's own prompt *spec* through the chunk states with *decoding*
        (resolved: its tokens and sampling set); an identical prompt run before (same
        pieces, engine and decoding) is answered from the prompt answers without the model.
        No QA-bank entry: the question's answers are the caller's to keep. With *relay* the
        last request is the client's own OpenAI request on a server's endpoint (its body is
        part of the key; a stored answer's finish reason is set on it). Yields text;
        returns the :class:`Answer`."""
        request = Request(question)
        runner = self.parts.runtime.runner
        assert decoding.max_new_tokens is not None and decoding.sampling is not None
        layout = runner.lay_out(question, [], spec=spec, max_new_tokens=decoding.max_new_tokens)
        key = prompt_answer_key(self.parts, layout, decoding, relay)
        stored = self.records.prompt_answer(key)
        if stored is not None and (relay is None or stored.finish_reason):
            if relay is not None:  # what the server said of the run that stored it
                relay.reply = stored_reply(stored)
            yield stored.text
            return self._finish(prompt_answered(request, stored))
        background = self.parts.activity.background_stop()  # idle work yields to users
        options = RunOptions(
            decoding.max_new_tokens,
            stop=decoding.stop,
            sampling=decoding.sampling,
            prompt_lookup=decoding.prompt_lookup,
            trim=decoding.trim,
            idle=background is not None,
            relay=relay,
        )
        result = yield from runner.run(layout, options, should_stop=background, started=request.started)
        if relay is None or (relay.reply.plain and relay.reply.finish_reason):  # reasoning, tool calls: not kept
            self.records.keep_prompt_answer(key, result, finish_reason=relay.reply.finish_reason if relay else "")
        request.timings = dict(result.timings)
        return self._finish(generated_answer(request, result))

    def lookup(
        self, request: Request, threshold: float | None = None, context_of: Callable[[QAEntry], str] | None = None
    ) -> AnswerLookup:
        """*request*'s question as the answer policy looks it up: served at or above
        *threshold* (default tau) where its sources are unchanged for a retrieval of the
        request's depth; *context_of* tells whether it retrieves an entry's chunks."""
        assert request.embedding is not None
        return AnswerLookup(
            request.question,
            request.embedding,
            request.binding,
            request.scope,
            self.config.tiers.similarity_threshold if threshold is None else threshold,
            context_of,
            lambda entry: self.sources_unchanged(entry, request.scope, request.top_k),
        )

    def generate(
        self, question: str, chunks: list[Chunk], *, binding: str, scope: dict[str, Any] | None, max_new_tokens: int
    ) -> Generator[str, None, Answer]:
        """:meth:`run` for chunks a caller retrieved (``pc.caller.generate``): the question
        is embedded when the run starts."""
        request = Request(question, binding, scope, max_new_tokens, self.config.retrieval.top_k)
        request.embedding = self.parts.embed_question(question)
        return (yield from self.run(request, chunks))

    def run(
        self, request: Request, chunks: list[Chunk], candidates: list[QAHit] | None = None
    ) -> Generator[str, None, Answer]:
        """Generate the answer to *request* from *chunks* with the stored answers of similar
        questions (*candidates*, found here when None) as drafts; label it ``qa_bank`` when
        it is one of them token for token, else store it under the request's binding and
        scope. Yields text; returns the :class:`Answer`. Callers hold the user's turn (idle
        work yields the model to it)."""
        parts, config, records = self.parts, self.config, self.records
        question, tokens = request.question, request.max_new_tokens
        if candidates is None:
            candidates = parts.answers.drafts(self.lookup(request))
        # stored answers are drafts only where the engine verifies them (in the process)
        drafts = [self.draft_tokens(c.entry) for c in candidates] if parts.runtime.features.drafts else []
        runner = parts.runtime.runner
        if config.retrieval.adaptive:
            clock = time.perf_counter()
            chunks = context_chunks(runner, question, chunks, max_new_tokens=tokens)
            request.timed("adaptive_context", clock)
        clock = time.perf_counter()
        layout = runner.lay_out(question, chunks, max_new_tokens=tokens)
        key = prompt_answer_key(parts, layout, Decoding(tokens, config.engine.sampling, trim=True))
        stored = records.prompt_answer(key)
        request.timed("prompt_answer", clock)
        if stored is not None:
            records.keep_asked(request.asked, key)
            yield stored.text
            return self._finish(prompt_answered(request, stored))
        background = parts.activity.background_stop()  # idle work yields to users
        recompute = parts.states.recompute_tokens(parts.calibration)
        options = RunOptions(
            tokens, answer_drafts=drafts, approximate=recompute is not None, recompute_tokens=recompute,
            idle=background is not None,
        )  # fmt: skip
        result = yield from runner.run(layout, options, should_stop=background, started=request.started)
        request.timings.update(result.timings)
        if records.keep_prompt_answer(key, result):
            records.keep_asked(request.asked, key)
        served = next((c for c, d in zip(candidates, drafts) if d and result.tokens == d), None)
        if served is not None:
            parts.qa_bank.record_hit(served.entry.id)
        elif config.tiers.qa_bank and config.tiers.store_answers and result.text and not (result.approximate or result.batched):
            self._keep_user_answer(request, result, chunks)
        accuracy = parts.states.estimated_accuracy(parts.calibration, recompute) if result.approximate else None
        records.label_offered(question, request.offered or candidates, result)
        return self._finish(generated_answer(request, result, served, accuracy))

    def _keep_user_answer(self, request: Request, result: RunResult, chunks: list[Chunk]) -> None:
        """Store a user's answer in the QA bank (a failed write is counted and logged; the
        answer stands)."""
        clock = time.perf_counter()
        try:
            self.records.keep_answer(request, result, chunks, "user")
        except StorageWriteError as error:
            self.parts.usage.count_storage_failure()
            logger.warning("answer not stored in the QA bank (%s); it is returned all the same", error)
        request.timed("store_qa", clock)

    def populate(self, item: IdleQuestion, should_stop: StopCheck) -> RunResult:
        """Idle work's run of this cache's own prompt for *item* (a predicted, stale,
        pending or follow-up question): retrieve as :meth:`answer` does, prefill through the
        chunk states and, with ``item.decode``, decode; keep the prompt's answer for an
        identical prompt later, and (with ``item.store``) store the question in the QA bank
        (pending without decoding), replacing ``item.replacing``. Pre-empted by
        *should_stop* (a user waits)."""
        parts, config = self.parts, self.config
        runner, tokens = parts.runtime.runner, config.engine.max_new_tokens
        request = Request(item.question, parts.binding(), item.scope, tokens, config.retrieval.top_k)
        request.embedding = item.embedding
        retrieved = [r.chunk for r in request.retrieved(parts.knowledge)]
        chunks = context_chunks(runner, item.question, retrieved, max_new_tokens=tokens, should_stop=should_stop)
        layout = runner.lay_out(item.question, chunks, max_new_tokens=tokens)
        result = drain(runner.run(layout, RunOptions(tokens, decode=item.decode, idle=True), should_stop=should_stop))
        if item.decode:  # the same prompt asked later is answered without the model
            key = prompt_answer_key(parts, result.layout, Decoding(tokens, config.engine.sampling, trim=True))
            self.records.keep_prompt_answer(key, result, idle=True)
        if item.store and config.tiers.qa_bank and not result.batched and (result.text or not item.decode):
            self.records.keep_answer(request, result, chunks, item.origin, item.replacing)
        return result

    def draft_tokens(self, entry: QAEntry) -> list[int]:
        """The token ids of an entry's answer: as decoded (model entries), else the
        answer's text tokenized (a guess; verification decides)."""
        tokens = entry.metadata.get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return list(tokens)
        if not entry.answer:
            return []
        return self.parts.runtime.engine.tokenize(" " + entry.answer)

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


def stored_reply(stored: PromptAnswer) -> Completion:
    """A relayed request's reply from its stored answer: the text, finish reason and usage
    of the run that stored it (every prompt token cached)."""
    usage = {
        "completion_tokens": stored.generated_tokens,
        "prompt_tokens": stored.prompt_tokens,
        "total_tokens": stored.prompt_tokens + stored.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stored.prompt_tokens},
    }
    return Completion(text=stored.text, finish_reason=stored.finish_reason, usage=usage)
