"""``PerCache``: the facade that opens a cache folder, wires its parts and delegates.

The parts (:class:`~percache_core.serving.parts.CacheParts`): the knowledge bank, the QA bank, the
model runtime (engine, chunk states, prompt runner; loaded on first use), user activity
and usage counters. The request path (:mod:`percache_core.serving.request_path`) answers
questions over them; the scheduler (:mod:`percache_core.prediction.scheduler`) does idle work over
them, run by the idle worker. None of these sees this class.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .callers import CallerCache
from .config import LiveConfig, PerCacheConfig
from .errors import CacheClosedError, CacheFolderError
from .inputs import positive_override, similarity_override, validated_question, validated_scope
from .knowledge.bank import DocumentInput, KnowledgeBank, validated_document_ids
from .knowledge.embedding import Embedder, check_embedder, default_embedder, embedding_dimension
from .kv.engine import Engine
from .kv.llama_server import LlamaServer
from .models import resolve_model_path
from .policies import AnswerPolicy, state_policy
from .prediction.scheduler import Scheduler, WarmReport
from .prediction.worker import IdleWorker
from .qa.bank import QABank
from .qa.calibration import Calibration
from .qa.prompt_answers import PromptAnswers
from .serving.activity import UserActivity
from .serving.parts import CacheParts
from .serving.request_path import RequestPath
from .serving.runtime import ModelRuntime
from .serving.streaming import AnswerStream, delivered
from .shared.redis_tier import open_shared_tier
from .storage import Store, private_folder
from .types import Answer, Chunk, RetrievedChunk
from .usage import UsageCounters

logger = logging.getLogger(__name__)

SETTINGS_FIXED_AT_OPEN = frozenset(
    {
        "shared_url",
        "shared_namespace",
        "shared_secret",
        "shared_write",
        "shared_timeout_s",
        "shared_sync_interval_s",
    }
)
SETTINGS_OF_THE_LOADED_MODEL = frozenset(
    {"model_path", "n_ctx", "n_batch", "n_threads", "repack_weights", "chunk_state_slices"}
)


class PerCache:
    """A two-tier cache in front of a local RAG pipeline on llama.cpp.

    Open one with :meth:`open`; it is a context manager.

    >>> with PerCache.open("~/.percache/mail") as pc:          # doctest: +SKIP
    ...     pc.add_documents(["The rehearsal is on Friday at 3 pm in room B."])
    ...     pc.answer("When is the rehearsal?").text
    'Friday at 3 pm in room B.'
    """

    def __init__(
        self,
        folder: Path,
        *,
        config: PerCacheConfig,
        embedder: Embedder,
        engine: Engine | None,
        model_path: Path | None,
        verbose: bool = False,
    ) -> None:
        self._folder = folder
        self._closed = False
        try:
            private_folder(folder)
        except OSError as error:
            raise CacheFolderError(f"cannot create cache folder {folder}: {error}") from error
        meta = Store(folder / "meta")
        check_embedder(meta, embedder, folder)
        qa_store = Store(folder / "qa_bank")
        live = LiveConfig(config)
        qa_budget = lambda: live.current.budgets.qa_bank_budget_bytes  # noqa: E731
        qa_bank = QABank(qa_store, dimension=embedding_dimension(embedder), budget_bytes=qa_budget)
        self._shared = open_shared_tier(config, qa_bank, embedder.name)
        self._parts = CacheParts(
            live=live,
            embedder=embedder,
            knowledge=KnowledgeBank(
                Store(folder / "knowledge"),
                embedder,
                chunk_words=lambda: live.current.retrieval.chunk_words,
                rrf_k=lambda: live.current.retrieval.rrf_k,
            ),
            qa_bank=qa_bank,
            prompt_answers=PromptAnswers(qa_store, budget_bytes=qa_budget, shared=self._shared),
            runtime=ModelRuntime(
                folder, live, engine=engine, model_path=model_path, shared=self._shared, verbose=verbose
            ),
            activity=UserActivity(history_size=config.idle.history_size),
            usage=UsageCounters(),
            meta=meta,
            calibration=Calibration(meta),
        )
        # the parts stay behind the verbs (tests and benchmarks read them through
        # percache_core.inspection.internals)
        self._request_path = RequestPath(self._parts)
        self._scheduler = Scheduler(self._parts, self._request_path)
        self.caller = CallerCache(self._parts, self._request_path, self._ensure_open)
        """The verbs for apps that run their own pipeline (lookup, complete, generate,
        remember, forget): see :class:`~percache_core.callers.CallerCache`."""
        self._worker: IdleWorker | None = None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        config: PerCacheConfig | None = None,
        embedder: Embedder | None = None,
        engine: Engine | LlamaServer | None = None,
        verbose: bool = False,
    ) -> PerCache:
        """Open (or create) the cache in folder *path*.

        Args:
            path: the cache folder; created when missing.
            config: settings; ``PerCacheConfig()`` when omitted.
            embedder: any :class:`~percache_core.knowledge.embedding.Embedder`; the bundled
                all-MiniLM-L6-v2 when omitted (loaded on first use).
            engine: a loaded :class:`~percache_core.kv.engine.Engine` to share (a
                ``LlamaEngine``, or a ``FakeEngine`` in tests), or a
                :class:`~percache_core.kv.llama_server.LlamaServer` (started, or attached
                to by its URL); otherwise ``config.engine.model_path`` (or the bundled Gemma 3
                270M) is loaded in this process on the first question that needs the model.

        Raises:
            TypeError: a *config*, *engine* or *path* of the wrong type.
            CacheFolderError: *path* is empty or is a file.
            ValueError: ``reuse="approximate"`` on a llama-server (composed chunk states
                need the in-process engine).

        >>> with PerCache.open("cache", engine=LlamaServer.start()) as pc:   # doctest: +SKIP
        ...     pc.answer("When is the review?").text
        """
        config = config or PerCacheConfig()
        if not isinstance(config, PerCacheConfig):
            raise TypeError(f"config must be a PerCacheConfig, got {type(config).__name__}")
        if engine is not None and not isinstance(engine, (Engine, LlamaServer)):
            raise TypeError(f"engine must be an Engine (e.g. LlamaEngine) or a LlamaServer, got {type(engine).__name__}")
        if isinstance(engine, LlamaServer):
            config = _for_server(config, engine)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a folder path, got {type(path).__name__}")
        if not os.fspath(path).strip():
            raise CacheFolderError("the cache folder path is empty (give a folder, e.g. ~/.percache/notes)")
        folder = Path(path).expanduser()
        if folder.exists() and not folder.is_dir():
            raise CacheFolderError(f"cache path exists and is not a folder: {folder}")
        model_path = None if engine is not None else resolve_model_path(config.engine.model_path)
        return cls(
            folder,
            config=config,
            embedder=embedder or default_embedder(),
            engine=engine,
            model_path=model_path,
            verbose=verbose,
        )

    def close(self) -> None:
        """Persist counters, store what is still being stored, and release files, the
        worker and (if it loaded it) the model; a llama-server passed in keeps running.
        Idempotent; ``with PerCache.open(...) as pc:`` calls it.

        >>> pc.close()   # doctest: +SKIP
        """
        if self._closed:
            return
        self.stop_worker()
        if self._shared is not None:
            self._shared.close()
        self._closed = True
        parts = self._parts
        parts.qa_bank.close()
        parts.knowledge.close()
        parts.meta.close()
        parts.runtime.close()

    def __enter__(self) -> PerCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this PerCache is closed")

    # -- what the cache is ----------------------------------------------------------------

    @property
    def config(self) -> PerCacheConfig:
        """The settings now (change them with :meth:`configure`)."""
        return self._parts.config

    @property
    def answer_policy(self) -> AnswerPolicy:
        """How stored answers may be served under the settings now (chosen once per
        configuration): ``answer_policy.approximate`` is True where an answer served
        without the model may be another question's (``qa_mode="semantic"``)."""
        return self._parts.answers

    @property
    def folder(self) -> Path:
        """The cache folder."""
        return self._folder

    @property
    def chunk_count(self) -> int:
        """How many chunks the knowledge holds (0: no documents added)."""
        self._ensure_open()
        return len(self._parts.knowledge)

    @property
    def embedder(self) -> Embedder:
        """The embedder of questions and chunks (e.g. for an app's own vector store)."""
        return self._parts.embedder

    def preload(self) -> None:
        """Load the embedder, the model and the chunk states now, and run the engine's
        self-checks (a few seconds once per engine: the exact prefill piece size, the
        draft-verification bound, whether drafts pay; on a llama-server its cut rule), not
        on first use.

        Raises:
            CacheClosedError: the cache is closed.
            ModelNotFoundError: the model file cannot be found or loaded.

        >>> pc.preload()   # doctest: +SKIP
        """
        self._ensure_open()
        self._parts.embed_question("warm-up")
        self._parts.runtime.preload()
        self._parts.runtime.size_state_budget(self._parts.knowledge.chunks)
        logger.info("engine self-check: %s", self._parts.runtime.self_check_report())

    # -- knowledge ------------------------------------------------------------------------

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
            removing = [chunk for chunk in self._parts.knowledge.chunks if chunk.doc_id in ids]
            self._scheduler.invalidation.documents_deleted(removing, ids)
            if removing:
                self._parts.prompt_answers.clear()  # a key does not say which texts its prompt held
            # the chunks go last: a failure (or kill) before leaves the documents, so a
            # retry does the whole work again
            return len(self._parts.knowledge.delete_documents(ids))

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

    def answer(
        self,
        question: str,
        *,
        similarity_threshold: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        scope: Mapping[str, Any] | None = None,
        stream: bool = False,
    ) -> Answer | AnswerStream:
        """Answer *question* from a stored answer, or generate it reusing chunk states.

        Args:
            question: the user's question.
            similarity_threshold: tau for this call (semantic mode).
            top_k: chunks retrieved for this call.
            max_new_tokens: the longest answer for this call.
            scope: e.g. ``{"meeting": "kickoff"}``: confines both the QA bank (only
                entries stored with the same scope) and retrieval (only chunks whose
                metadata match) to it.
            stream: return an :class:`AnswerStream` (text pieces as they come, then
                ``.answer``) instead of an :class:`~percache_core.types.Answer`.

        Returns:
            The answer: its text, where it came from (``source``), tokens reused and
            prefilled, timings.

        Raises:
            InvalidQuestionError: an empty or over-long question (before any work).
            ValueError: an override out of range.
            CacheClosedError: the cache is closed.

        >>> pc.answer("When is the review?").source   # doctest: +SKIP
        'chunk_states'
        """
        self._ensure_open()
        question = validated_question(question)
        threshold = similarity_override(similarity_threshold, self.config.tiers.similarity_threshold)
        top_k = positive_override("top_k", top_k, self.config.retrieval.top_k)
        max_new_tokens = positive_override("max_new_tokens", max_new_tokens, self.config.engine.max_new_tokens)
        scope_dict = validated_scope(scope)
        events = self._request_path.answer(
            question,
            similarity_threshold=threshold,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            scope=scope_dict,
        )
        return delivered(self._parts.activity.in_user_turn(events), stream)

    def answer_stream(self, question: str, **overrides: Any) -> AnswerStream:
        """``answer(question, stream=True, **overrides)``: the text pieces as they come.

        >>> stream = pc.answer_stream("When is the review?")   # doctest: +SKIP
        >>> text = "".join(stream); stream.answer.source        # doctest: +SKIP
        'full'
        """
        return self.answer(question, stream=True, **overrides)  # type: ignore[return-value]

    # -- idle time ------------------------------------------------------------------------

    def warm(
        self,
        *,
        max_seconds: float | None = None,
        max_predictions: int | None = None,
        knowledge_prediction: bool = True,
        progress: bool = True,
        should_stop: Callable[[], bool] | None = None,
        answer: Callable[[str], bool] | None = None,
    ) -> WarmReport:
        """Run one idle round now, its eight steps in order (see
        :mod:`percache_core.prediction.scheduler`): predicted paths, the knowledge
        abstract, stale answers refreshed, follow-ups answered, prediction and population
        (``max_predictions`` per view, default ``prediction_stride``), the bulk knowledge
        prefill, conversions, calibration.

        Args:
            max_seconds: the round stops after this long (between steps).
            max_predictions: questions predicted per view (knowledge, history).
            knowledge_prediction: also predict from the knowledge abstract (else from the
                recent questions only).
            progress: show a progress bar.
            should_stop: asked between segments and tokens; the round stops when it turns
                true.
            answer: question -> whether an answer was stored: the app's own pipeline
                answers the predicted questions.

        Returns:
            What the round did (:class:`~percache_core.prediction.scheduler.WarmReport`).

        A user question pre-empts it (``report.preempted``). With *answer* (question ->
        whether an answer was stored), predicted questions are answered by the caller's own
        pipeline and the round only summarises and predicts (see ``Scheduler.warm``).

        >>> report = pc.warm(max_seconds=60)   # doctest: +SKIP
        >>> report.predicted                   # doctest: +SKIP
        ['When is the launch talk?', ...]
        """
        self._ensure_open()
        return self._scheduler.warm(
            max_seconds=max_seconds,
            max_predictions=max_predictions,
            knowledge_prediction=knowledge_prediction,
            progress=progress,
            should_stop=should_stop,
            answer=answer,
        )

    def start_worker(
        self,
        *,
        idle_after_s: float | None = None,
        should_run: Callable[[], bool] | None = None,
        round_seconds: float | None = 60.0,
        answer: Callable[[str], bool] | None = None,
    ) -> IdleWorker:
        """Start the background worker: idle rounds (see :meth:`warm`) while no question
        is asked. One worker per cache; a user's question pre-empts a round at once.

        Args:
            idle_after_s: seconds without a question before a round (default:
                ``idle_after_s`` of the config).
            should_run: asked before each round (e.g. "on mains power").
            round_seconds: the longest round.
            answer: as in :meth:`warm` (an app's own pipeline answers the predictions).

        Returns:
            The running :class:`~percache_core.prediction.worker.IdleWorker`.

        >>> pc.start_worker(idle_after_s=30)   # doctest: +SKIP
        """
        self._ensure_open()
        if self._worker is not None and self._worker.running:
            return self._worker
        self._worker = IdleWorker(
            self._scheduler,
            idle_after_s=self.config.idle.idle_after_s if idle_after_s is None else idle_after_s,
            should_run=should_run,
            round_seconds=round_seconds,
            answer=answer,
        ).start()
        return self._worker

    def stop_worker(self) -> None:
        """Stop the background worker, if any."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def configure(self, **changes: Any) -> PerCacheConfig:
        """Change settings at run time (e.g. ``similarity_threshold``, budgets): the next
        question and the next idle round use them.

        Args:
            changes: ``PerCacheConfig`` fields and their new values.

        Returns:
            The settings now.

        Raises:
            ValueError: a value out of range, or a setting fixed when the cache was opened
                (the shared tier's, and the model's once it is loaded): reopen the cache to
                change those.
            TypeError: an unknown setting.

        >>> pc.configure(similarity_threshold=0.8)   # doctest: +SKIP
        """
        self._ensure_open()
        fixed = set(changes) & SETTINGS_FIXED_AT_OPEN
        if self._parts.runtime.engine_loaded:
            fixed |= set(changes) & SETTINGS_OF_THE_LOADED_MODEL
        fixed = {name for name in fixed if changes[name] != getattr(self.config, name)}
        if fixed:
            raise ValueError(
                f"{', '.join(sorted(fixed))} cannot change while the cache is open "
                "(close it and open it again with the new config)"
            )
        config = self.config.replace(**changes)
        self._parts.reconfigure(config)
        self._parts.runtime.forget_recorded_model()  # the model's settings may have changed
        return config

    # -- reporting ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the cache did and holds: answers by source, hit rates, tokens reused and
        prefilled, bytes and entries of each tier, idle work, the engine's self-check.

        Returns:
            A JSON-ready dict (``qa_bank``, ``chunk_states``, ``prediction``, ...).

        >>> pc.stats()["qa_bank"]["entries"]   # doctest: +SKIP
        12
        """
        self._ensure_open()
        summary = self._parts.usage.summary()
        summary["qa_bank"] = {
            "entries": len(self._parts.qa_bank),
            "bytes": self._parts.qa_bank.bytes,
            "budget_bytes": self._parts.qa_bank.budget_bytes,
            "evictions": self._parts.qa_bank.evictions,
            "prompt_answers": len(self._parts.prompt_answers),
            "prompt_answer_bytes": self._parts.prompt_answers.bytes,
        }
        summary["knowledge"] = {"chunks": len(self._parts.knowledge)}
        summary["idle"] = self._scheduler.stats()
        summary["prediction"] = self._scheduler.demand_stats()
        summary["approximate"] = self._scheduler.approximate_stats()
        if self._shared is not None:
            summary["shared"] = self._shared.stats()
        summary["chunk_states"] = self._parts.runtime.stats()
        summary["engine_self_check"] = self._parts.runtime.self_check_report()
        return summary


def _for_server(config: PerCacheConfig, server: LlamaServer) -> PerCacheConfig:
    """*config* as it runs on *server*: without chunk states where the server cannot hold
    them exactly (with a warning that says why); composed chunk states refused."""
    if state_policy(config).approximate and not server.features.composed_states:
        raise ValueError(
            'reuse="approximate" composes chunk states token by token: it needs the in-process '
            "engine (a LlamaEngine), not a llama-server"
        )
    problem = server.chunk_state_problem if config.tiers.chunk_states else None
    if problem is not None:
        warnings.warn(f"no chunk states on the llama-server at {server.url}: {problem}; stored answers still work", stacklevel=3)
        return config.replace(chunk_states=False)
    return config
