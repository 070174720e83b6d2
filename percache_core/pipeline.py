"""``PerCache``: the request path over the QA bank, the knowledge bank and the chunk-state tree.

``answer(question)``: embed once -> QA-bank check (tau) -> hybrid retrieval with the same
embedding -> lay out segments -> restore the deepest stored prefix state -> prefill the
rest segment by segment (keeping states of new prefixes) -> decode -> store the QA entry.
Hits and misses run the same segment schedule, so a chunk-state hit gives exactly the
tokens the cache-off path gives.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import PerCacheConfig
from .drafting import deviation_bound
from .embedding import Embedder, SentenceTransformerEmbedder
from .errors import CacheClosedError, CacheFolderError, InvalidQuestionError, PerCacheError
from .generation import PromptRunner
from .knowledge import DocumentInput, KnowledgeBank
from .kv.llama_cpp import LlamaEngine
from .kv.state_store import StateStore
from .kv.tree import ChunkStateTree
from .models import resolve_model_path
from .prompting import TEMPLATE_VERSION, PromptSpec
from .qa_bank import QABank
from .request_path import Parts, RequestPath, generated_answer, stored_answer
from .scheduler import Scheduler, WarmReport
from .shared.redis_tier import SharedTier
from .storage import Store
from .streaming import AnswerStream
from .types import Answer, Chunk, QAEntry, QAHit, RetrievedChunk
from .usage import UsageCounters
from .worker import IdleWorker

logger = logging.getLogger(__name__)

MAX_QUESTION_CHARS = 100_000


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
        engine: LlamaEngine | None,
        model_path: Path | None,
        verbose: bool = False,
    ) -> None:
        self.folder = folder
        self.config = config
        self.embedder = embedder
        self._engine = engine
        self._model_path = model_path
        self._verbose = verbose
        self._owns_engine = engine is None
        self._engine_load_lock = threading.Lock()
        self.usage = UsageCounters()
        self._waiting_lock = threading.Lock()
        self._closed = False

        self._meta = Store(folder / "meta")
        self._check_embedder()
        self.knowledge = KnowledgeBank(
            Store(folder / "knowledge"),
            embedder,
            chunk_words=config.chunk_words,
            rrf_k=config.rrf_k,
        )
        self.qa_bank = QABank(
            Store(folder / "qa_bank"),
            dimension=self._embedding_dimension(),
            budget_bytes=config.qa_bank_budget_bytes,
        )
        self.shared = self._open_shared()
        self._states: StateStore | None = None
        self._tree: ChunkStateTree | None = None
        self._runner: PromptRunner | None = None
        self._users_waiting = 0
        self.last_activity = time.monotonic()
        self.scheduler = Scheduler(self)
        self._worker: IdleWorker | None = None
        self.request_path = RequestPath(
            Parts(
                embedder=embedder,
                knowledge=self.knowledge,
                qa_bank=self.qa_bank,
                usage=self.usage,
                runner=lambda: self.runner,
                model_id=self.model_id,
                record_question=self.scheduler.record_question,
            ),
            config,
        )

    # -- opening and closing --------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        config: PerCacheConfig | None = None,
        embedder: Embedder | None = None,
        engine: LlamaEngine | None = None,
        verbose: bool = False,
    ) -> PerCache:
        """Open (or create) the cache in folder *path*.

        Args:
            path: the cache folder; created when missing.
            config: settings; ``PerCacheConfig()`` when omitted.
            embedder: any :class:`~percache_core.embedding.Embedder`; the bundled
                all-MiniLM-L6-v2 when omitted (loaded on first use).
            engine: a loaded :class:`~percache_core.kv.llama_cpp.LlamaEngine` to share;
                otherwise ``config.model_path`` (or the bundled Gemma 3 270M) is loaded on
                the first question that needs the model.
        """
        config = config or PerCacheConfig()
        if not isinstance(config, PerCacheConfig):
            raise TypeError(f"config must be a PerCacheConfig, got {type(config).__name__}")
        folder = Path(path).expanduser()
        if folder.exists() and not folder.is_dir():
            raise CacheFolderError(f"cache path exists and is not a folder: {folder}")
        model_path = None if engine is not None else resolve_model_path(config.model_path)
        return cls(
            folder,
            config=config,
            embedder=embedder or SentenceTransformerEmbedder(),
            engine=engine,
            model_path=model_path,
            verbose=verbose,
        )

    def close(self) -> None:
        """Persist counters and release files and (if it owns it) the model."""
        if self._closed:
            return
        self.stop_worker()
        if self.shared is not None:
            self.shared.close()
        self._closed = True
        self.qa_bank.close()
        self.knowledge.close()
        self._meta.close()
        if self._states is not None:
            self._states.close()
        if self._owns_engine and self._engine is not None:
            self._engine.close()

    def __enter__(self) -> PerCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this PerCache is closed")

    def _embedding_dimension(self) -> int:
        dimension = getattr(self.embedder, "dimension", -1)
        if not isinstance(dimension, int) or dimension <= 0:
            dimension = int(self.embedder.embed(["dimension probe"]).shape[1])
        return dimension

    def _check_embedder(self) -> None:
        if not isinstance(self.embedder, Embedder):
            raise TypeError("embedder must have name, dimension and embed(texts)")
        stored = self._meta.get("embedder")
        if stored is None:
            self._meta.put("embedder", self.embedder.name)
        elif stored != self.embedder.name:
            raise PerCacheError(
                f"the cache at {self.folder} was built with embedder {stored!r}, not "
                f"{self.embedder.name!r}: open it with the same embedder or use a new folder"
            )

    def preload(self) -> None:
        """Load the embedder, the model and the chunk-state tree now, and measure the
        draft-verification bound (about 2 s once per engine), not on first use."""
        self._ensure_open()
        self.embedder.embed(["warm-up"])
        self.engine.warm_up()
        self._open_states()
        with self.engine.lock:
            deviation_bound(self.engine)

    def _open_shared(self) -> SharedTier | None:
        """The Redis tier behind the local one, when ``shared_url`` is set."""
        config = self.config
        if config.shared_url is None:
            return None
        shared = SharedTier(
            config.shared_url,
            namespace=config.shared_namespace,
            secret=config.shared_secret or "",
            write=config.shared_write,
            timeout_s=config.shared_timeout_s,
            sync_interval_s=config.shared_sync_interval_s,
        )

        def receive(entry: QAEntry) -> None:
            if entry.embedding.shape != (self.qa_bank.dimension,):
                logger.warning("shared QA entry %s has another embedding size: ignored", entry.id)
                return
            self.qa_bank.store(
                entry.question,
                entry.embedding,
                entry.answer,
                chunk_ids=entry.chunk_ids,
                metadata=entry.metadata,
            )

        def share(entry: QAEntry) -> None:
            if entry.metadata.get("origin") != "shared":
                shared.put_qa(entry)

        shared.bind_qa(self.embedder.name, receive)
        self.qa_bank.listener = share
        return shared.start()

    # -- the model and the chunk-state tier -----------------------------------------------

    @property
    def engine(self) -> LlamaEngine:
        """The llama.cpp engine, loaded on first use."""
        with self._engine_load_lock:
            if self._engine is None:
                assert self._model_path is not None
                self._engine = LlamaEngine(
                    self._model_path,
                    n_ctx=self.config.n_ctx,
                    n_batch=self.config.n_batch,
                    n_threads=self.config.n_threads,
                    verbose=self._verbose,
                )
            return self._engine

    def model_id(self) -> str:
        """The identity of the model that answers (the engine's fingerprint); part of
        every QA entry's binding."""
        return self.engine.fingerprint(TEMPLATE_VERSION)

    def binding(self, max_new_tokens: int | None = None) -> str:
        """The binding of answers this cache's own pipeline gives with its settings now."""
        return self.request_path.binding(max_new_tokens or self.config.max_new_tokens)

    @property
    def tree(self) -> ChunkStateTree:
        """The chunk-state tree of this engine's fingerprint (loaded on first use)."""
        self._open_states()
        assert self._tree is not None
        return self._tree

    @property
    def states(self) -> StateStore:
        """The stored states of this engine's fingerprint."""
        self._open_states()
        assert self._states is not None
        return self._states

    @property
    def runner(self) -> PromptRunner:
        """Runs prompts on the model through the chunk-state tree."""
        self._open_states()
        assert self._runner is not None
        return self._runner

    def _open_states(self) -> None:
        with self._engine_load_lock:
            if self._states is not None:
                return
        engine = self.engine
        with self._engine_load_lock:
            if self._states is None:
                states = StateStore(self.folder / "states", engine.fingerprint(TEMPLATE_VERSION))
                self._tree = states.load_tree()
                self._runner = PromptRunner(engine, self._tree, states, self.config)
                if self.shared is not None:
                    self.shared.bind_states(states.fingerprint)
                    self._runner.shared = self.shared
                self._states = states

    # -- knowledge ------------------------------------------------------------------------

    def add_documents(
        self, documents: Iterable[DocumentInput], *, split: bool = True, progress: bool = False
    ) -> list[Chunk]:
        """Add documents (strings, or dicts with ``text`` and optional ``id``/``metadata``).

        Returns the new chunks. Re-adding a document with the same text does nothing;
        with the same id and new text it replaces the old chunks.
        """
        self._ensure_open()
        self.last_activity = time.monotonic()
        chunks = self.knowledge.add_documents(documents, split=split, progress=progress)
        if chunks and self.config.qa_bank:
            self.scheduler.mark_stale(chunks, self.knowledge.last_replaced)
        return chunks

    def retrieve(self, question: str, k: int | None = None) -> list[RetrievedChunk]:
        """The chunks hybrid retrieval gives for *question* (best first)."""
        self._ensure_open()
        return self.knowledge.retrieve(_validated(question), k or self.config.top_k)

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
        """Answer *question* from the QA bank, or generate it reusing chunk states.

        Per-call overrides: ``similarity_threshold`` (tau), ``top_k``, ``max_new_tokens``.
        ``scope`` (e.g. ``{"meeting": "kickoff"}``) confines both the QA bank (only entries
        stored with the same scope) and retrieval (only chunks whose metadata match) to it.
        With ``stream=True`` an :class:`AnswerStream` is returned instead.
        """
        if scope is not None and not isinstance(scope, Mapping):
            raise TypeError(f"scope must be a mapping, got {type(scope).__name__}")
        events = self._answer_events(
            question,
            threshold=self._threshold(similarity_threshold),
            top_k=top_k or self.config.top_k,
            max_new_tokens=max_new_tokens or self.config.max_new_tokens,
            scope=dict(scope) if scope else None,
        )
        stream_object = AnswerStream(events)
        return stream_object if stream else stream_object.result()

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
        """Answer *question* from the given *chunks* (in this order) through the chunk-state
        tree, without retrieval: for callers that retrieve on their own.

        Stored answers of similar questions under *binding* (default: this cache's own)
        and *scope* are drafts the model verifies (exact mode), and the answer is stored
        there, so a repeat or a paraphrase with the same answer is served as
        ``source="qa_bank"``; the output is always the cache-off output. Strings are
        wrapped as chunks with a content-derived id.
        """
        self._ensure_open()
        question = _validated(question)
        chunk_list = [c if isinstance(c, Chunk) else _text_chunk(c) for c in chunks]
        tokens = max_new_tokens or self.config.max_new_tokens
        if tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        scope_dict = dict(scope) if scope else None
        started = time.perf_counter()

        def events() -> Generator[str, None, Answer]:
            with self._user_turn():
                embedding = self.embedder.embed([question])[0]
                answer = yield from self.request_path.run(
                    question,
                    chunk_list,
                    embedding=embedding,
                    binding=binding or self.binding(tokens),
                    scope=scope_dict,
                    max_new_tokens=tokens,
                    started=started,
                    timings={},
                )
            return answer

        stream_object = AnswerStream(events())
        return stream_object if stream else stream_object.result()

    def _generate_stream(
        self,
        question: str,
        chunks: list[Chunk],
        max_new_tokens: int | None,
        stream: bool,
        spec: PromptSpec | None,
        stop: Sequence[str] | None = None,
    ) -> Answer | AnswerStream:
        started = time.perf_counter()
        timings: dict[str, float] = {}
        tokens = max_new_tokens or self.config.max_new_tokens
        if tokens <= 0:
            raise ValueError("max_new_tokens must be positive")

        def events() -> Generator[str, None, Answer]:
            answer = yield from self._generate(
                question,
                chunks,
                max_new_tokens=tokens,
                started=started,
                timings=timings,
                spec=spec,
                stop=stop,
            )
            answer.latency_s = time.perf_counter() - started
            return self._finish(answer)

        stream_object = AnswerStream(events())
        return stream_object if stream else stream_object.result()

    def complete_with_documents(
        self,
        prefix: str,
        documents: Sequence[Chunk | str],
        suffix: str,
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
        stream: bool = False,
    ) -> Answer | AnswerStream:
        """Continue the prompt ``prefix + documents + suffix`` (a caller's own template),
        laid out as segments [prefix, document 1, ..., suffix] so that stored states of
        the same prefix and documents are reused. Document texts are used verbatim;
        ``stop`` replaces the configured stop strings.

        >>> pc.complete_with_documents("Context: ", ["Lunch is at noon. "], "Q: When? A:")  # doctest: +SKIP
        """
        self._ensure_open()
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise TypeError("prefix and suffix must be strings")
        chunks = [c if isinstance(c, Chunk) else _text_chunk(c) for c in documents]
        spec = PromptSpec(prefix, tuple((c.id, c.text) for c in chunks), suffix)
        return self._generate_stream(suffix or prefix, chunks, max_new_tokens, stream, spec, stop)

    def lookup(
        self,
        question: str,
        *,
        similarity_threshold: float | None = None,
        scope: Mapping[str, Any] | None = None,
        binding: str | None = None,
    ) -> Answer | None:
        """The QA bank's answer for *question* under *binding* (default: this cache's own)
        and *scope*, or None: for callers that generate on their own and then call
        :meth:`remember` with the same binding (a key of whatever decides their answers:
        model, prompt, settings, the retrieved context).

        Exact mode (the default) only returns the answer stored for the same question
        text: the same inputs give the same output. Semantic mode
        returns the best entry at or above tau that the verifier accepts (approximate).
        """
        self._ensure_open()
        question = _validated(question)
        threshold = self._threshold(similarity_threshold)
        scope_dict = dict(scope) if scope else None
        started = time.perf_counter()
        binding = binding or self.binding()
        with self._user_turn():
            embedding = self.embedder.embed([question])[0]
            if self.config.qa_mode == "exact":
                hit = self._same_question(question, embedding, scope_dict, binding)
            else:
                hit, _ = self.request_path.semantic_hit(question, embedding, threshold, scope_dict, binding)
            self.scheduler.record_question(question, embedding, hit, scope_dict)
        if hit is None:
            return None
        answer = stored_answer(question, hit, started, {})
        answer.approximate = self.config.qa_mode != "exact"
        self.usage.record(answer)
        return answer

    def _same_question(
        self, question: str, embedding: Any, scope: dict[str, Any] | None, binding: str | None
    ) -> QAHit | None:
        entry = self.qa_bank.find(question, scope=scope, binding=binding)
        if entry is None:
            return None
        self.qa_bank.record_hit(entry.id)
        return QAHit(entry, float(min(1.0, float(entry.embedding @ embedding))))

    def remember(
        self,
        question: str,
        answer: str,
        *,
        chunk_ids: Sequence[str] = (),
        scope: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        binding: str | None = None,
    ) -> QAEntry:
        """Store *answer* (a caller's own) for *question* under *binding* (default: this
        cache's own) and *scope*; it replaces an earlier answer to the same question there.
        The model's own answers never replace a remembered one."""
        self._ensure_open()
        question = _validated(question)
        if not isinstance(answer, str):
            raise TypeError(f"answer must be a string, got {type(answer).__name__}")
        extra = dict(metadata or {})
        extra["remembered"] = True
        if scope:
            extra["scope"] = dict(scope)
        extra["binding"] = binding or self.binding()
        embedding = self.embedder.embed([question])[0]
        return self.qa_bank.store(question, embedding, answer, chunk_ids=chunk_ids, metadata=extra)

    def stored_order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """*chunks* reordered so that the longest stored chunk-state path comes first (this
        changes the prompt, and so possibly the answer)."""
        self._ensure_open()
        return self.runner.stored_order(chunks)

    def answer_stream(self, question: str, **overrides: Any) -> AnswerStream:
        """``answer(question, stream=True, **overrides)``."""
        return self.answer(question, stream=True, **overrides)  # type: ignore[return-value]

    def _threshold(self, value: float | None) -> float:
        if value is None:
            return self.config.similarity_threshold
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"similarity_threshold must be in [0, 1], got {value}")
        return float(value)

    def _answer_events(
        self,
        question: str,
        *,
        threshold: float,
        top_k: int,
        max_new_tokens: int,
        scope: dict[str, Any] | None = None,
    ) -> Generator[str, None, Answer]:
        self._ensure_open()
        question = _validated(question)
        if top_k <= 0 or max_new_tokens <= 0:
            raise ValueError("top_k and max_new_tokens must be positive")
        with self._user_turn():
            answer = yield from self.request_path.answer(
                question, threshold=threshold, top_k=top_k, max_new_tokens=max_new_tokens, scope=scope
            )
        return answer

    def _generate(
        self,
        question: str,
        chunks: list[Chunk],
        *,
        max_new_tokens: int,
        started: float,
        timings: dict[str, float],
        spec: PromptSpec | None = None,
        stop: Sequence[str] | None = None,
    ) -> Generator[str, None, Answer]:
        """Generate through the chunk-state tree for a user; yields answer text."""
        with self._user_turn():
            result = yield from self.runner.run(
                question, chunks, spec=spec, stop=stop, max_new_tokens=max_new_tokens, started=started
            )
        timings.update(result.timings)
        return generated_answer(question, result, started, timings)

    @contextmanager
    def _user_turn(self) -> Iterator[None]:
        """Mark a user's question as waiting (idle work yields the model to it)."""
        with self._waiting_lock:
            self._users_waiting += 1
        try:
            yield
        finally:
            with self._waiting_lock:
                self._users_waiting -= 1
            self.last_activity = time.monotonic()

    # -- idle time ------------------------------------------------------------------------

    def warm(
        self,
        *,
        max_seconds: float | None = None,
        max_predictions: int | None = None,
        knowledge_prediction: bool = True,
        progress: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> WarmReport:
        """Run one idle round now: abstract, refresh, follow-ups, prediction and population
        (``max_predictions`` per view, default ``prediction_stride``), conversions.

        A user question pre-empts it (``report.preempted``).

        >>> report = pc.warm(max_seconds=60)   # doctest: +SKIP
        >>> report.predicted                   # doctest: +SKIP
        ['When is the launch talk?', ...]
        """
        self._ensure_open()
        return self.scheduler.warm(
            max_seconds=max_seconds,
            max_predictions=max_predictions,
            knowledge_prediction=knowledge_prediction,
            progress=progress,
            should_stop=should_stop,
        )

    def start_worker(
        self,
        *,
        idle_after_s: float | None = None,
        should_run: Callable[[], bool] | None = None,
        round_seconds: float | None = 60.0,
    ) -> IdleWorker:
        """Start the background worker (idle rounds after ``idle_after_s`` without a query,
        while ``should_run()`` allows); returns it. One worker per cache."""
        self._ensure_open()
        if self._worker is not None and self._worker.running:
            return self._worker
        self._worker = IdleWorker(
            self,
            idle_after_s=self.config.idle_after_s if idle_after_s is None else idle_after_s,
            should_run=should_run,
            round_seconds=round_seconds,
        ).start()
        return self._worker

    def stop_worker(self) -> None:
        """Stop the background worker, if any."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def configure(self, **changes: Any) -> PerCacheConfig:
        """Change settings at run time (e.g. ``similarity_threshold``, budgets): the next
        idle round adapts its strategy and conversions to them.

        >>> pc.configure(similarity_threshold=0.8)   # doctest: +SKIP
        """
        self._ensure_open()
        self.config = self.config.replace(**changes)
        self.request_path.configure(self.config)
        self.qa_bank.budget_bytes = self.config.qa_bank_budget_bytes
        if self._runner is not None:
            self._runner.config = self.config
        return self.config

    def user_waiting(self) -> bool:
        """True while a user's question is waiting for or using the model."""
        return self._users_waiting > 0

    def _finish(self, answer: Answer) -> Answer:
        self.usage.record(answer)
        return answer

    # -- reporting ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Hit rates, token counts, bytes and entries per tier.

        >>> pc.stats()["qa_bank"]["entries"]   # doctest: +SKIP
        12
        """
        self._ensure_open()
        summary = self.usage.summary()
        summary["qa_bank"] = {
            "entries": len(self.qa_bank),
            "bytes": self.qa_bank.bytes,
            "budget_bytes": self.qa_bank.budget_bytes,
            "evictions": self.qa_bank.evictions,
        }
        summary["knowledge"] = {"chunks": len(self.knowledge)}
        summary["idle"] = self.scheduler.stats()
        if self.shared is not None:
            summary["shared"] = self.shared.stats()
        if self._tree is not None and self._states is not None:
            summary["chunk_states"] = {
                "nodes": len(self._tree),
                "bytes": self._tree.bytes,
                "budget_bytes": self.config.chunk_state_budget_bytes,
                "evictions": self.runner.evictions,
                "restore_failures": self.runner.restore_failures,
                "corrupt_dropped": self._states.corrupt_dropped,
            }
        else:
            summary["chunk_states"] = {
                "nodes": 0,
                "bytes": 0,
                "budget_bytes": self.config.chunk_state_budget_bytes,
            }
        return summary


def _text_chunk(text: str) -> Chunk:
    if not isinstance(text, str) or not text.strip():
        raise TypeError("chunks must be Chunk objects or non-empty strings")
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
    return Chunk(f"text-{digest}", f"text-{digest}", text)


def _validated(question: object) -> str:
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    if not question.strip():
        raise InvalidQuestionError("question is empty")
    if len(question) > MAX_QUESTION_CHARS:
        raise InvalidQuestionError(f"question has {len(question):,} characters (max {MAX_QUESTION_CHARS:,})")
    return question.strip()
