"""The :class:`PerCache` facade: opening, answering, configuring and reporting (its other
verbs are in :mod:`~percache_core.pipeline.documents` and :mod:`~percache_core.pipeline.idle`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..answering.request_path import RequestPath
from ..callers import CallerCache
from ..config import PerCacheConfig
from ..engines import engine_kind
from ..errors import CacheClosedError, CacheFolderError, StorageWriteError
from ..inputs import positive_override, similarity_override, validated_question, validated_scope
from ..knowledge.bert import default_embedder
from ..knowledge.embedding import Embedder
from ..kv.engine import ModelEngine
from ..models import resolve_model_path
from ..policies import AnswerPolicy
from ..prediction.scheduler import Scheduler
from ..prediction.worker import IdleWorker
from ..serving.streaming import AnswerStream, delivered
from ..types import Answer
from .documents import DocumentVerbs
from .idle import IdleVerbs
from .wiring import SETTINGS_FIXED_AT_OPEN, SETTINGS_OF_THE_LOADED_MODEL, open_parts

logger = logging.getLogger(__name__)

USAGE_RECORD = "usage"  # the answer counts of the processes that closed the folder
COUNTED = {
    "answers and tokens": "every process that closed this folder, and this one",
    "idle work, prediction, approximate answers": "this process",
    "qa_bank, knowledge, chunk_states": "what the folder holds now",
}


class PerCache(DocumentVerbs, IdleVerbs):
    """A two-tier cache in front of a local RAG pipeline on llama.cpp.

    Open one with :meth:`open` (which checks its arguments and calls this constructor);
    it is a context manager.

    Args:
        folder: the cache folder.
        config: the settings.
        embedder: the embedder of questions and chunks.
        engine: a loaded engine or a llama-server (None: *model_path* loaded on first use).
        model_path: the GGUF to load when there is no *engine*.
        verbose: llama.cpp's own log.

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
        engine: ModelEngine | None,
        model_path: Path | None,
        verbose: bool = False,
    ) -> None:
        self._folder = folder
        self._closed = False
        self._parts, self._shared = open_parts(folder, config, embedder, engine, model_path, verbose)
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
        engine: ModelEngine | None = None,
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
                :class:`~percache_core.engines.llama_server.server.LlamaServer` (started, or attached
                to by its URL); otherwise ``config.engine.model_path`` (or the bundled Gemma 3
                270M) is loaded in this process on the first question that needs the model.

        Returns:
            The open cache (close it, or use it in a ``with`` block).

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
        if engine is not None:
            config = engine_kind(engine).configured(engine, config)  # TypeError: no engine kind
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
        self._scheduler.background_checks.stop()
        self._parts.runtime.flush()  # the states still being written reach every tier
        if self._shared is not None:
            self._shared.close()
        self._closed = True
        parts = self._parts
        self._persist_usage()
        parts.qa_bank.close()
        parts.knowledge.close()
        parts.meta.close()
        parts.runtime.close()

    def _persist_usage(self) -> None:
        """Add this process's answer counts to the folder's record (a failed write loses
        them, nothing else)."""
        meta = self._parts.meta
        try:
            with meta.transaction():
                meta.put(USAGE_RECORD, self._parts.usage.persisted(meta.get(USAGE_RECORD)))
        except (StorageWriteError, OSError) as error:
            logger.warning("answer counts not kept (%s)", error)

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

        Args:
            question: the question.
            **overrides: :meth:`answer`'s keywords (``top_k``, ``max_new_tokens``, ``scope``, ...).

        Returns:
            An :class:`AnswerStream`: iterate it for the text; its ``answer`` is set at the end.

        Raises:
            InvalidQuestionError: an empty or over-long question.

        >>> stream = pc.answer_stream("When is the review?")   # doctest: +SKIP
        >>> text = "".join(stream); stream.answer.source        # doctest: +SKIP
        'full'
        """
        return self.answer(question, stream=True, **overrides)  # type: ignore[return-value]

    # -- idle time ------------------------------------------------------------------------

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
            A JSON-ready dict (``qa_bank``, ``chunk_states``, ``prediction``,
            ``app_requests``: the shapes learned from apps' own prompts, ...).

        >>> pc.stats()["qa_bank"].get("entries")   # doctest: +SKIP
        12
        """
        self._ensure_open()
        summary = self._parts.usage.summary(self._parts.meta.get(USAGE_RECORD))
        summary["counted"] = COUNTED
        summary["qa_bank"] = {
            "entries": len(self._parts.qa_bank),
            "bytes": self._parts.qa_bank.bytes,
            "budget_bytes": self._parts.qa_bank.budget_bytes,
            "evictions": self._parts.qa_bank.evictions,
            "prompt_answers": len(self._parts.prompt_answers),
            "prompt_answer_bytes": self._parts.prompt_answers.bytes,
        }
        summary["knowledge"] = {"chunks": len(self._parts.knowledge)}
        summary["app_requests"] = self._parts.shapes.stats()
        summary["idle"] = self._scheduler.stats()
        summary["prediction"] = self._scheduler.demand_stats()
        summary["approximate"] = self._scheduler.approximate_stats()
        if self._shared is not None:
            summary["shared"] = self._shared.stats()
        summary["chunk_states"] = self._parts.runtime.stats()
        summary["engine_self_check"] = self._parts.runtime.self_check_report()
        return summary
