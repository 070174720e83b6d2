"""``CallerCache`` (``pc.caller``): a PerCache for apps that run their own pipeline.

A LlamaIndex query engine, a LangChain chain or your own code builds its prompts and
retrieves on its own; what it needs of a cache is a short verb list over the same parts
and the same answering path (:class:`~percache_core.serving.request_path.RequestPath`)
that ``PerCache.answer`` uses:

- :meth:`~CallerCache.lookup`: a stored answer the caller may serve (counted as a hit);
- :meth:`~CallerCache.complete`: continue the caller's finished prompt through the
  chunk states (its output is the model's own, with or without the cache);
- :meth:`~CallerCache.generate`: answer a question from chunks the caller retrieved;
- :meth:`~CallerCache.remember` / :meth:`~CallerCache.forget`: store the caller's
  answer, and delete what it stored.

Every answer the caller keeps is bound to a *binding* (a key of whatever decides its
answers: model, prompt template, settings, retrieved context), so two pipelines never share
answers by accident.

>>> with PerCache.open("cache") as pc:                    # doctest: +SKIP
...     hit = pc.caller.lookup("When is the review?", binding="my-app-v1")
...     text = hit.text if hit else my_pipeline("When is the review?")
...     pc.caller.remember("When is the review?", text, binding="my-app-v1")
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from .inputs import as_chunks, positive_override, similarity_override, validated_question, validated_scope
from .kv.engine import Decoding, Engine, TextModel
from .serving.parts import CacheParts
from .serving.prompting import TextPrompt
from .serving.request import Request, stored_answer
from .serving.request_path import RequestPath
from .serving.state_runner import RelayedRequest
from .serving.streaming import AnswerStream, delivered
from .types import Answer, Chunk, QAEntry, QAHit

OFFERS_KEPT = 64
QUOTE_KEY = 48  # characters a quoted passage is found by (its first ones)


def _offer_key(question: str, binding: str, scope: dict[str, Any] | None) -> tuple[str, str, str]:
    return question, binding, json.dumps(scope or {}, sort_keys=True, default=str)


class CallerCache:
    """The verbs an app with its own pipeline uses (see the module docstring); reach it as
    ``pc.caller``."""

    def __init__(self, parts: CacheParts, request_path: RequestPath, ensure_open: Callable[[], None]) -> None:
        self._parts = parts
        self._path = request_path
        self._ensure_open = ensure_open
        # semantic lookups that served nothing: the stored answers they saw, until the
        # caller remembers its own answer to the question (a calibration label each)
        self._offered: OrderedDict[tuple[str, str, str], list[QAHit]] = OrderedDict()
        self._quote_index: tuple[int, dict[str, list[Chunk]]] = (-1, {})  # knowledge version, index

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
        embedding = request.embedding = parts.embed_question(question)
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
        """The entry stored for exactly *question* under *binding* and *scope* (not counted
        as a hit: for checking, e.g. whether a predicted question still needs an answer),
        or None."""
        self._ensure_open()
        binding = binding or self._parts.binding()
        return self._parts.qa_bank.find(validated_question(question), scope=validated_scope(scope), binding=binding)

    def entry(self, entry_id: str) -> QAEntry | None:
        """The QA entry with this id (``Answer.entry_id``), or None."""
        self._ensure_open()
        return self._parts.qa_bank.get(entry_id)

    # -- running the caller's prompts -------------------------------------------------------

    def complete(
        self,
        prompt: str,
        *,
        documents: Sequence[str] = (),
        decoding: Decoding | None = None,
        add_bos: bool | None = None,
        stream: bool = False,
    ) -> Answer | AnswerStream:
        """Continue a finished prompt string (a framework's template, a chat template) as
        the model does without a cache, reusing stored states of its leading part.

        The prompt is tokenized whole and prefilled as one call would be: it is cut only
        where one of *documents* (texts in the prompt: retrieved chunks, chat messages) ends
        and the engine's self-check proved that the cut changes nothing, and the state there
        is kept. So the output never depends on the cache, and it is stock llama.cpp's text
        (``Decoding(trim=True)`` drops the white space around it, as for a chat reply). A
        prompt run before with the same settings is answered from its stored answer without
        the model. *decoding* (its tokens, sampling, stop strings, prompt lookup and trim)
        applies to this call. Markup in the prompt is tokenized
        as special tokens; *add_bos* says whether a BOS is added (None: unless the prompt
        starts with it; a :class:`~percache_core.kv.engine.ChatPrompt` says). No QA-bank
        entry: the question's answer is the caller's to :meth:`remember`.

        Args:
            prompt: the finished prompt (non-empty).
            documents: texts in the prompt after which states are kept.
            decoding: this call's decoding (default: the configured tokens, sampling and
                stop strings, no prompt lookup, the text as decoded).
            add_bos: whether tokenizing adds BOS (None: unless the prompt starts with it).
            stream: return an :class:`AnswerStream` of text pieces instead of an Answer.

        Returns:
            The :class:`Answer` (``prompt_answer`` when the prompt was answered before), or a
            stream of it.

        Raises:
            TypeError: a prompt that is not a non-empty string, or documents that are not strings.
            ValueError: ``max_new_tokens`` that is not a positive integer.
            ContextOverflowError: a prompt that does not fit the context.

        >>> pc.caller.complete("Context:\\n\\nLunch is at noon.\\n\\nQ: When? A:",
        ...                    documents=["Lunch is at noon."], decoding=Decoding(max_new_tokens=8))  # doctest: +SKIP
        """
        self._ensure_open()
        if not isinstance(prompt, str) or not prompt:
            raise TypeError("prompt must be a non-empty string")
        if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
            raise TypeError("documents must be a sequence of strings")
        resolved = self._parts.config.engine.resolve(decoding)
        events = self._path.complete(prompt, TextPrompt(prompt, tuple(documents), add_bos), resolved)
        return delivered(self._parts.activity.in_user_turn(events), stream)

    def relay(
        self, request: RelayedRequest, prompt: str, *, documents: Sequence[str] = (), stream: bool = False
    ) -> Answer | AnswerStream:
        """Run a client's OpenAI request on a llama-server engine's own endpoint, with the
        chunk states of its leading part restored: the server lays out, samples, stops and
        parses the reply as it does for the client alone (``percache serve`` uses this).

        *prompt* is the prompt the server lays out for *request* (``apply_template`` of a
        chat's body, a completion's prompt string), cut where one of *documents* ends as
        :meth:`complete` does. The server must report the planned reuse of a prompt of the
        same length before any text, else the request runs again from nothing. An
        identical request run before (same prompt and body) is answered from its stored
        answer without the model; *request* then holds its finish reason and no chunks.

        Args:
            request: the path and body; the run fills in its chunks, finish reason and usage.
            prompt: the request's prompt as the server lays it out (non-empty).
            documents: texts in the prompt (messages, passages) after which states are kept.
            stream: return an :class:`AnswerStream` of text pieces instead of an Answer.

        Returns:
            The :class:`Answer` (source ``"prompt_answer"`` when stored before), or a stream.

        Raises:
            TypeError: on a prompt that is not a non-empty string.
            PerCacheError: when this cache's engine is not a llama-server.

        >>> request = RelayedRequest("/v1/chat/completions", body)           # doctest: +SKIP
        >>> pc.caller.relay(request, server.apply_template(body)).text       # doctest: +SKIP
        """
        self._ensure_open()
        if not isinstance(prompt, str) or not prompt:
            raise TypeError("prompt must be a non-empty string")
        spec = TextPrompt(prompt, tuple(d for d in documents if d.strip()), add_bos=True)
        decoding = self._parts.config.engine.resolve(Decoding(max_new_tokens=1, stop=()))
        events = self._path.complete(prompt, spec, decoding, relay=request)
        # (the server decodes as the body says; one token of room is what the layout keeps)
        return delivered(self._parts.activity.in_user_turn(events), stream)

    def lend_engine(self) -> AbstractContextManager[None]:
        """Hold the engine for a request PerCache does not run (a passed-through one):
        no other request runs meanwhile, and what its slot holds afterwards is unknown."""
        self._ensure_open()
        return self._parts.runtime.runner.lend_engine()

    def generate(
        self,
        question: str,
        chunks: Sequence[Chunk | str],
        *,
        max_new_tokens: int | None = None,
        binding: str | None = None,
        scope: Mapping[str, Any] | None = None,
        stream: bool = False,
    ) -> Answer | AnswerStream:
        """Answer *question* with this cache's RAG prompt from the given *chunks* (in this
        order) through the chunk-state tree, without retrieval: for callers that retrieve
        on their own.

        Stored answers of similar questions under *binding* (default: this cache's own)
        and *scope* are drafts the model verifies (exact mode), and the answer is stored
        there, so a repeat or a paraphrase with the same answer is served as
        ``source="qa_bank"``; the output is always the cache-off output. Strings are
        wrapped as chunks with a content-derived id. With ``context="adaptive"`` the
        prompt gets the shortest leading run of *chunks* that makes the model confident.

        Args:
            question: the question.
            chunks: the chunks the caller retrieved, in prompt order (strings are wrapped).
            max_new_tokens: this call's answer length (default: the configured).
            binding, scope: where stored answers are looked up and this one is stored.
            stream: return an :class:`AnswerStream` instead of an Answer.

        Returns:
            The :class:`Answer`, or a stream of it.

        Raises:
            InvalidQuestionError: an empty or over-long question.

        >>> pc.caller.generate("When is lunch?", ["Lunch is at noon."]).text  # doctest: +SKIP
        """
        self._ensure_open()
        question = validated_question(question)
        chunk_list = as_chunks(chunks)
        tokens = positive_override("max_new_tokens", max_new_tokens, self._parts.config.engine.max_new_tokens)
        scope_dict = validated_scope(scope)
        binding = binding or self._parts.binding(max_new_tokens=tokens)
        events = self._path.generate(question, chunk_list, binding=binding, scope=scope_dict, max_new_tokens=tokens)
        return delivered(self._parts.activity.in_user_turn(events), stream)

    def stored_order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """*chunks* reordered so that the longest stored chunk-state path comes first (this
        changes the prompt, and so possibly the answer)."""
        self._ensure_open()
        return self._parts.runtime.runner.stored_order(chunks)

    # -- the caller's own answers -----------------------------------------------------------

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
        embedding = self._parts.embed_question(question)
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

    # -- what the caller's prompts are made for ---------------------------------------------

    def model_id(self) -> str:
        """The identity of the model that answers (the engine's fingerprint; loads the
        model on first use): part of every binding.

        >>> pc.caller.model_id()   # doctest: +SKIP
        'gemma-3-270m-it-Q8_0.gguf:...'
        """
        self._ensure_open()
        return self._parts.runtime.model_id()

    def binding(self, max_new_tokens: int | None = None) -> str:
        """The binding of the answers this cache's own pipeline gives with its settings now:
        the default *binding* of :meth:`lookup`, :meth:`find` and :meth:`remember`."""
        self._ensure_open()
        return self._parts.binding(max_new_tokens=max_new_tokens)

    @property
    def text_model(self) -> TextModel:
        """The model's tokenizer and chat template (loads the model on first use): what a
        chat adapter formats its messages with."""
        return self._parts.runtime.engine

    def runs_on(self, engine: Engine) -> bool:
        """Whether this cache answers with *engine* (so the caller's model calls may go
        through :meth:`complete`)."""
        return self._parts.runtime.runs_on(engine)

    def quoted_passages(self, text: str) -> list[str]:
        """The passages of the knowledge's chunks that *text* (a prompt) quotes, in order:
        from a chunk's start, as long as the text goes on as the chunk does (an app may
        shorten its passages), at least ``QUOTE_KEY`` characters. A prompt cut where they end
        keeps their states (:meth:`relay`'s *documents*).

        >>> pc.caller.quoted_passages(f"Notes: {chunk.text} Question: when?")   # doctest: +SKIP
        [chunk.text]
        """
        self._ensure_open()
        knowledge = self._parts.knowledge
        version, index = self._quote_index
        if version != knowledge.version:
            index = {}
            for chunk in knowledge.chunks:
                if len(chunk.text) >= QUOTE_KEY:
                    index.setdefault(chunk.text[:QUOTE_KEY], []).append(chunk)
            self._quote_index = (knowledge.version, index)
        found: list[str] = []
        start = 0
        while start <= len(text) - QUOTE_KEY:
            best = ""
            for chunk in index.get(text[start : start + QUOTE_KEY], ()):
                span = os.path.commonprefix([text[start : start + len(chunk.text)], chunk.text])
                best = span if len(span) > len(best) else best
            if best:
                found.append(best)
                start += len(best)
            else:
                start += 1
        return found

    def chunk(self, chunk_id: str) -> Chunk | None:
        """The stored chunk *chunk_id* (a whole document's first chunk as ``id#c000``)."""
        knowledge = self._parts.knowledge
        return knowledge.get_chunk(chunk_id) or knowledge.get_chunk(f"{chunk_id}#c000")
