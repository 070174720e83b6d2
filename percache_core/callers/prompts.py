"""The prompt verbs of ``pc.caller``: :meth:`~PromptVerbs.complete` (the caller's finished
prompt through the chunk states), :meth:`~PromptVerbs.generate` (a question over chunks the
caller retrieved), :meth:`~PromptVerbs.relay` and :meth:`~PromptVerbs.lend_engine` (a
client's OpenAI request on a llama-server), and what the caller's prompts are made for:
:meth:`~PromptVerbs.model_id`, :meth:`~PromptVerbs.binding`, :meth:`~PromptVerbs.text_model`,
:meth:`~PromptVerbs.runs_on`, :meth:`~PromptVerbs.stored_order`,
:meth:`~PromptVerbs.quoted_passages`, :meth:`~PromptVerbs.chunk` and
:meth:`~PromptVerbs.retrieves_with` (the app's own retriever, for idle work's predicted
requests in the app's shape: :mod:`percache_core.serving.shapes`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..answering.parts import CacheParts
from ..answering.request_path import RequestPath
from ..inputs import as_chunks, positive_override, validated_question, validated_scope
from ..knowledge.bank import DocumentInput
from ..kv.engine import Decoding, Engine, TextModel
from ..serving.prompting import TextPrompt
from ..serving.shapes import decoding_record
from ..serving.state_runner import RelayedRequest
from ..serving.streaming import AnswerStream, delivered
from ..types import Answer, Chunk

QUOTE_KEY = 48  # characters a quoted passage is found by (its first ones)


class PromptVerbs:
    """``pc.caller``'s verbs over the caller's own prompts (see the module docstring)."""

    _parts: CacheParts
    _path: RequestPath
    _ensure_open: Callable[[], None]
    _quote_index: tuple[int, dict[str, list[str]]]
    _deferred_quote_index: tuple[int, dict[str, list[str]]]

    def complete(
        self,
        prompt: str,
        *,
        documents: Sequence[str] = (),
        decoding: Decoding | None = None,
        add_bos: bool | None = None,
        stream: bool = False,
        question: str | None = None,
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

        Its shape is learned (:mod:`percache_core.serving.shapes`) for idle work.

        Args:
            prompt: the finished prompt (non-empty).
            documents: texts in the prompt after which states are kept.
            decoding: this call's decoding (default: the configured tokens, sampling and
                stop strings, no prompt lookup, the text as decoded).
            add_bos: whether tokenizing adds BOS (None: unless the prompt starts with it).
            stream: return an :class:`AnswerStream` of text pieces instead of an Answer.
            question: the user's question the prompt asks (a retriever's query, the last
                user message), where the caller knows it: it is learned with the shape.

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
        if self._parts.activity.background_stop() is None:  # a request the app sent, not idle work's
            _learn_shape(self._parts, self.quoted_passages, prompt, question, (resolved, add_bos))
        events = self._path.complete(prompt, TextPrompt(prompt, _before_question(prompt, documents, question), add_bos), resolved)
        return delivered(self._parts.activity.in_user_turn(events), stream)

    def record_passages(self, passages: Iterable[DocumentInput]) -> int:
        """Passages the app retrieved, for the knowledge idle work predicts from: found in
        the app's prompts at once (:meth:`quoted_passages`), embedded and added as chunks
        (one each, as ``add_documents(split=False)``) by the next idle round, so that no
        answer waits for their embedding. An id stored with the same text is not queued.

        Args:
            passages: dicts with ``text`` and optional ``id`` and ``metadata``, or strings.

        Returns:
            How many passages wait for an idle round.

        Raises:
            TypeError: a single passage instead of a list.
            InvalidDocumentError: an empty text, a bad id or metadata that cannot be stored.

        >>> pc.caller.record_passages([{"id": "node-7", "text": "The review moved to Thursday."}])  # doctest: +SKIP
        1
        """
        self._ensure_open()
        return self._parts.knowledge.defer_documents(passages)

    def retrieves_with(self, retrieve: Callable[[str, int], list[str]] | None) -> None:
        """Give idle work the app's own retriever: *retrieve(question, n)* returns the
        texts of the passages the app puts in its prompt for *question* (at most *n*, in
        prompt order). Predicted questions are then built into requests with the app's
        passages rather than PerCache's retrieval (:mod:`percache_core.serving.shapes`).
        ``PerCacheRetriever`` registers its inner retriever; None forgets it.

        Args:
            retrieve: (question, n) -> passage texts, or None.

        >>> pc.caller.retrieves_with(lambda q, n: [d.page_content for d in retriever.invoke(q)][:n])  # doctest: +SKIP
        """
        if retrieve is not None and not callable(retrieve):
            raise TypeError("retrieve must be a callable (question, n) -> list of passage texts, or None")
        self._parts.shapes.retrieve = retrieve

    def serves_app(self) -> None:
        """Say that an app brings its own prompts to this cache (the adapters and ``percache serve``
        do): until ``pc.answer`` is asked in this process, idle rounds leave PerCache's own prompt
        alone, even before the app's first request teaches them its shape (states of a prompt the
        app never sends would only take idle time and disk)."""
        self._parts.shapes.app_attached = True

    def relay(
        self, request: RelayedRequest, prompt: str, *, documents: Sequence[str] = (), stream: bool = False,
        question: str | None = None,
    ) -> Answer | AnswerStream:
        """Run a client's OpenAI request on a llama-server engine's own endpoint, with the chunk
        states of its leading part restored: the server lays out, samples, stops and parses the
        reply as it does for the client alone (``percache serve`` uses this).

        *prompt* is the prompt the server lays out for *request* (``apply_template`` of a chat's
        body, a completion's prompt string), cut where one of *documents* ends as :meth:`complete`
        does. The server must report the planned reuse of a prompt of the same length before any
        text, else the request runs again from nothing. An identical request run before (same
        prompt and body) is answered from its stored answer without the model; *request* then
        holds its finish reason and no chunks. Its shape is learned as :meth:`complete` learns
        one, so that idle work prefills predicted requests as the client sends them (their
        states; a relayed reply is the server's, so none is decoded ahead). Its own states are
        stored after the reply (:meth:`finish_relay`).

        Args:
            request: the path and body; the run fills in its chunks, finish reason and usage.
            prompt: the request's prompt as the server lays it out (non-empty).
            documents: texts in the prompt (messages, passages) after which states are kept.
            stream: return an :class:`AnswerStream` of text pieces instead of an Answer.
            question: the user's question (a chat's last user message), learned with the shape.

        Returns:
            The :class:`Answer` (source ``"prompt_answer"`` when stored before), or a stream.

        Raises:
            TypeError: on a prompt that is not a non-empty string.
            PerCacheError: when this cache's engine is not a llama-server.

        >>> pc.caller.relay(RelayedRequest(path, body), server.apply_template(body)).text  # doctest: +SKIP
        """
        self._ensure_open()
        if not isinstance(prompt, str) or not prompt:
            raise TypeError("prompt must be a non-empty string")
        spec = TextPrompt(prompt, tuple(d for d in documents if d.strip()), add_bos=True)
        decoding = self._parts.config.engine.resolve(Decoding(max_new_tokens=1, stop=()))
        if self._parts.activity.background_stop() is None:
            _learn_shape(self._parts, self.quoted_passages, prompt, question, (decoding, True), relayed=True)
        events = self._path.complete(prompt, spec, decoding, relay=request)
        # (the server decodes as the body says; one token of room is what the layout keeps)
        return delivered(self._parts.activity.in_user_turn(events), stream)

    def finish_relay(self) -> None:
        """Save the server's slot for the states the last :meth:`relay` left, off the reply's
        time (``percache serve``: once the reply is sent; else the server's next use does)."""
        self._ensure_open()
        self._parts.runtime.runner.settle()  # (their cutting and writing stay in the writer thread)

    def lend_engine(self) -> AbstractContextManager[None]:
        """Hold the engine for a request PerCache does not run (a passed-through one):
        no other request runs meanwhile, and what its slot holds afterwards is unknown.

        Returns:
            A context manager that holds the engine while it is entered.

        Raises:
            CacheClosedError: the cache is closed.
            ValueError: an in-process engine (only a llama-server is lent).

        >>> with pc.caller.lend_engine():   # doctest: +SKIP
        ...     httpx.post(server.url + "/v1/chat/completions", json=body)
        """
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
        changes the prompt, and so possibly the answer).

        Args:
            chunks: the retrieved chunks, in the caller's order.

        Returns:
            The same chunks, the stored path's first.

        >>> pc.caller.stored_order(pc.retrieve("When?"))   # doctest: +SKIP
        """
        self._ensure_open()
        return self._parts.runtime.runner.stored_order(chunks)

    # -- what the caller's prompts are made for ---------------------------------------------

    def model_id(self) -> str:
        """The identity of the model that answers (the engine's fingerprint; loads the
        model on first use): part of every binding.

        Returns:
            The fingerprint, as text.

        >>> pc.caller.model_id()   # doctest: +SKIP
        'gemma-3-270m-it-Q8_0.gguf:...'
        """
        self._ensure_open()
        return self._parts.runtime.model_id()

    def binding(self, max_new_tokens: int | None = None) -> str:
        """The binding of the answers this cache's own pipeline gives with its settings now:
        the default *binding* of :meth:`lookup`, :meth:`find` and :meth:`remember`.

        Args:
            max_new_tokens: the answer length it is for (default: the configured one).

        Returns:
            The binding key.

        >>> pc.caller.binding()   # doctest: +SKIP
        '3f1c...'
        """
        self._ensure_open()
        return self._parts.binding(max_new_tokens=max_new_tokens)

    @property
    def text_model(self) -> TextModel:
        """The model's tokenizer and chat template (loads the model on first use): what a
        chat adapter formats its messages with.

        Returns:
            The model's :class:`~percache_core.kv.engine.TextModel`.

        >>> pc.caller.text_model().tokenize("Hello", True)   # doctest: +SKIP
        """
        return self._parts.runtime.engine

    def runs_on(self, engine: Engine) -> bool:
        """Whether this cache answers with *engine* (so the caller's model calls may go
        through :meth:`complete`).

        Args:
            engine: a loaded engine.

        Returns:
            True when it is this cache's.

        >>> pc.caller.runs_on(engine)   # doctest: +SKIP
        True
        """
        return self._parts.runtime.runs_on(engine)

    def quoted_passages(self, text: str) -> list[str]:
        """The passages of the knowledge's chunks that *text* (a prompt) quotes, in order:
        from a chunk's start, as long as the text goes on as the chunk does (an app may
        shorten its passages), at least ``QUOTE_KEY`` characters. A prompt cut where they end
        keeps their states (:meth:`relay`'s *documents*).

        Args:
            text: a prompt.

        Returns:
            The quoted passages, in the order the prompt has them.

        >>> pc.caller.quoted_passages(f"Notes: {chunk.text} Question: when?")   # doctest: +SKIP
        [chunk.text]
        """
        self._ensure_open()
        knowledge = self._parts.knowledge
        self._quote_index = _refreshed(self._quote_index, knowledge.version, lambda: [c.text for c in knowledge.chunks])
        self._deferred_quote_index = _refreshed(  # retrieved passages idle work adds
            self._deferred_quote_index, knowledge.deferred_version, lambda: knowledge.deferred_texts
        )
        index, deferred = self._quote_index[1], self._deferred_quote_index[1]
        found: list[str] = []
        start = 0
        while start <= len(text) - QUOTE_KEY:
            best = ""
            key = text[start : start + QUOTE_KEY]
            for passage in (*index.get(key, ()), *deferred.get(key, ())):
                span = os.path.commonprefix([text[start : start + len(passage)], passage])
                best = span if len(span) > len(best) else best
            if best:
                found.append(best)
                start += len(best)
            else:
                start += 1
        return found

    def chunk(self, chunk_id: str) -> Chunk | None:
        """A stored chunk.

        Args:
            chunk_id: its id (a document's id gives its first chunk, ``id#c000``).

        Returns:
            The :class:`Chunk`, or None.

        >>> pc.caller.chunk("notes-1")   # doctest: +SKIP
        """
        knowledge = self._parts.knowledge
        return knowledge.get_chunk(chunk_id) or knowledge.get_chunk(f"{chunk_id}#c000")


def _quote_keys(texts: Iterable[str]) -> dict[str, list[str]]:
    """The passages long enough to be found by :meth:`PromptVerbs.quoted_passages`, by
    their first ``QUOTE_KEY`` characters."""
    index: dict[str, list[str]] = {}
    for text in texts:
        if len(text) >= QUOTE_KEY:
            index.setdefault(text[:QUOTE_KEY], []).append(text)
    return index


def _before_question(prompt: str, documents: Sequence[str], question: str | None) -> tuple[str, ...]:
    """Of *documents*, those that begin before *question* stands in *prompt* ends (all
    where it is unknown or not there): a state after a document that follows the question
    holds it, so it serves only a prompt with the same question there, whose answer is
    stored anyway. A chat's last message (the question itself) stays: the next turn repeats
    it in its history. Where the question comes before every document (LangChain's RAG
    tutorial), the text before it: the instructions every such prompt starts with, whose
    state the next prompt restores where stock's call reuses its previous prompt's.

    >>> _before_question("Q: why? Notes: a. b.", ["a.", "b."], "why?")
    ('Q: ',)
    >>> _before_question("Notes: a. b. Q: why?", ["a.", "b.", "Q: why?"], "why?")
    ('a.', 'b.', 'Q: why?')
    """
    needle = question.strip() if isinstance(question, str) else ""
    at = prompt.find(needle) if needle else -1
    if at < 0:
        return tuple(documents)
    kept = tuple(d for d in documents if d.strip() and prompt.find(d.strip()) <= at)
    if not kept and documents and prompt[:at].strip():
        return (prompt[:at],)
    return kept


def _refreshed(
    cached: tuple[int, dict[str, list[str]]], version: int, texts: Callable[[], list[str]]
) -> tuple[int, dict[str, list[str]]]:
    """*cached* (a version and its :func:`_quote_keys`) where it is of *version*, else the
    index of *texts* now."""
    return cached if cached[0] == version else (version, _quote_keys(texts()))


def _learn_shape(
    parts: CacheParts,
    quoted: Callable[[str], list[str]],
    prompt: str,
    question: str | None,
    binding: tuple[Decoding, bool | None],
    *,
    relayed: bool = False,
) -> None:
    """Learn the shape of a request the app sent (see :mod:`percache_core.serving.shapes`):
    *quoted* finds the knowledge's passages in *prompt*; *binding* is its decoding and
    whether tokenizing adds BOS."""
    knowledge = parts.knowledge
    if not len(knowledge) and not knowledge.deferred_texts:
        return
    passages = quoted(prompt)
    if not passages:
        return
    question = question.strip() if isinstance(question, str) and question.strip() else None
    decoding, add_bos = binding
    parts.shapes.observe(prompt, passages, question, decoding_record(decoding), add_bos, relayed=relayed)
    activity = parts.activity
    if question and (not activity.history or activity.history[-1] != question):
        activity.record_question(question, None, None)  # the app's questions feed history prediction
