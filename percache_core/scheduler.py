"""Idle-time work: predict questions, populate both tiers, convert between them, refresh.

One ``warm()`` round (PerCache, sections 4.1-4.3):

1. summarise new chunks into the knowledge abstract;
2. regenerate stale answers (a new chunk now ranks in their top-k);
3. answer follow-ups: questions that were served a similar question's answer get their own;
4. predict questions from the abstract and from recent user questions (within the scope of
   the latest question), and populate them by the strategy: tau above ``strategy_cutoff``
   -> prefill only (chunk states and a pending QA entry), otherwise prefill and decode (a
   servable QA entry);
5. knowledge prefill (``knowledge_prefill``): the [system, chunk] state of every chunk,
   recently retrieved chunks first, then the latest question's scope, then the rest, while
   the chunk-state budget has room, so that any prompt restores at least its first chunk;
6. conversions: with the decode strategy, decode pending entries; with room in the
   chunk-state budget, re-prefill the paths of answered entries whose states were evicted.

Every step checks ``should_stop`` (a user question is waiting) between segments and tokens
and stops the round at once; the time budget is checked between steps. All idle work is
accounted per strategy: tokens prefilled and decoded, seconds, questions populated.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .abstract import KnowledgeAbstract
from .binding import answer_metadata
from .generation import Preempted, RunResult, drain
from .knowledge import matches_scope
from .predictor import PredictedQuestion, PredictionTally, QueryPredictor, use_chat_template
from .qa_bank import normalized_question
from .types import Chunk, QAHit

if TYPE_CHECKING:
    from .pipeline import PerCache

PREFILL_ONLY = "prefill_only"
PREFILL_DECODE = "prefill_decode"
PREFILL_BUDGET_SHARE = 0.8  # idle population fills the chunk-state budget up to this share


class _OutOfTime(Exception):
    pass


@dataclass
class IdleAccount:
    """Idle compute spent under one strategy."""

    rounds: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    llm_calls: int = 0
    questions_populated: int = 0


@dataclass
class WarmReport:
    """What one idle round did."""

    strategy: str
    seconds: float = 0.0
    chunks_summarised: int = 0
    chunks_prefilled: int = 0
    abstract_facts_added: int = 0
    predicted: list[str] = field(default_factory=list)
    knowledge: PredictionTally = field(default_factory=PredictionTally)
    history: PredictionTally = field(default_factory=PredictionTally)
    populated: int = 0
    pending_stored: int = 0
    answers_stored: int = 0
    pending_decoded: int = 0
    refreshed: int = 0
    followups_answered: int = 0
    paths_reprefilled: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: bool = False
    out_of_time: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scheduler:
    """Plans and runs idle work for one :class:`~percache_core.pipeline.PerCache`."""

    def __init__(self, pc: PerCache) -> None:
        self._pc = pc
        config = pc.config
        self.history: deque[str] = deque(maxlen=config.history_size)
        self.new_history = 0
        self.history_scope: dict[str, Any] | None = None  # scope of the latest question
        self.followups: deque[tuple[str, np.ndarray, dict[str, Any] | None]] = deque(maxlen=256)
        self.abstract = KnowledgeAbstract(
            pc._meta, max_lines=config.abstract_max_lines, batch_chunks=config.abstract_batch_chunks
        )
        self.accounts: dict[str, IdleAccount] = {PREFILL_ONLY: IdleAccount(), PREFILL_DECODE: IdleAccount()}
        self.preemptions = 0
        self._knowledge_rounds: dict[int, int] = {}  # abstract version -> rounds predicted
        self._predictor: QueryPredictor | None = None
        self._lock = threading.Lock()  # one round at a time
        self._report: WarmReport | None = None
        self._should_stop: Callable[[], bool] = pc.user_waiting

    # -- what the request path tells the scheduler ----------------------------------------

    def record_question(
        self,
        question: str,
        embedding: np.ndarray,
        hit: QAHit | None,
        scope: dict[str, Any] | None = None,
    ) -> None:
        """Remember a user question (for history prediction and follow-ups) and its scope."""
        self.history.append(question)
        self.new_history += 1
        self.history_scope = scope
        if hit is not None and normalized_question(hit.entry.question) != normalized_question(question):
            self.followups.append((question, embedding, scope))

    def mark_stale(
        self, new_chunks: Sequence[Chunk], replaced_documents: set[str] | frozenset[str] = frozenset()
    ) -> int:
        """Mark answered entries for which new information now ranks in the top-k as stale.

        New information is a new chunk that is not one of the entry's own sources, or a
        chunk of a document whose text was replaced. (A document that is new to this cache
        but was the source of an entry, as with entries shared by another device, is not.)
        """
        pc = self._pc
        if not new_chunks:
            return 0
        entries = [e for e in pc.qa_bank.entries if e.answer is not None and not e.metadata.get("stale")]
        chunks, matrix = pc.knowledge.embedding_matrix()
        if not entries or matrix.size == 0:
            return 0
        new_ids = {c.id for c in new_chunks}
        new_columns = [i for i, c in enumerate(chunks) if c.id in new_ids]
        scores = np.stack([e.embedding for e in entries]) @ matrix.T
        k = min(pc.config.top_k, scores.shape[1])
        kth_best = -np.partition(-scores, k - 1, axis=1)[:, k - 1]
        marked = 0
        for row, entry in enumerate(entries):
            sources = set(entry.chunk_ids)
            for column in new_columns:
                chunk = chunks[column]
                is_new_information = chunk.id not in sources or chunk.doc_id in replaced_documents
                if is_new_information and scores[row, column] >= kth_best[row]:
                    pc.qa_bank.correct(entry.id, entry.answer, stale=True)
                    marked += 1
                    break
        return marked

    # -- planning -------------------------------------------------------------------------

    def strategy(self, threshold: float | None = None) -> str:
        """``prefill_only`` when tau is above the cutoff (hits need very close questions, so
        answers are rarely reused), else ``prefill_decode``. A tier that is off forces the
        strategy that still fills the other."""
        config = self._pc.config
        if not config.chunk_states:
            return PREFILL_DECODE
        if not config.qa_bank:
            return PREFILL_ONLY
        tau = config.similarity_threshold if threshold is None else threshold
        return PREFILL_ONLY if tau > config.strategy_cutoff else PREFILL_DECODE

    def has_work(self) -> bool:
        """Whether an idle round would do anything useful now."""
        pc = self._pc
        if self.abstract.pending(pc.knowledge.chunks) or self.new_history or self.followups:
            return True
        if self._knowledge_rounds.get(self.abstract.version, 0) < pc.config.knowledge_prediction_rounds:
            return bool(len(pc.knowledge))
        entries = pc.qa_bank.entries
        if any(e.metadata.get("stale") for e in entries):
            return True
        if self.strategy() == PREFILL_DECODE and any(e.answer is None for e in entries):
            return True
        return next(self._chunks_to_prefill(), None) is not None

    # -- the round ------------------------------------------------------------------------

    def warm(
        self,
        *,
        max_seconds: float | None = None,
        max_predictions: int | None = None,
        knowledge_prediction: bool = True,
        progress: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> WarmReport:
        """Run one idle round (see the module docstring); stops early when a user question
        waits (``report.preempted``) or *max_seconds* run out (``report.out_of_time``).
        With ``knowledge_prediction=False`` only history-based prediction runs."""
        pc = self._pc
        should_stop = should_stop or pc.user_waiting
        with self._lock:
            strategy = self.strategy()
            report = WarmReport(strategy)
            self._report = report
            self._should_stop = should_stop
            started = time.perf_counter()
            deadline = None if max_seconds is None else started + max_seconds
            stride = max_predictions if max_predictions is not None else pc.config.prediction_stride
            bar = _progress_bar(progress)
            try:
                self._step("abstract", bar, deadline, should_stop, self._update_abstract)
                self._step("refresh", bar, deadline, should_stop, self._refresh_stale)
                self._step("follow-ups", bar, deadline, should_stop, self._answer_followups)
                self._step(
                    "predict",
                    bar,
                    deadline,
                    should_stop,
                    lambda stop: self._predict_and_populate(
                        stop, stride, deadline, bar, knowledge_prediction
                    ),
                )
                self._step("prefill chunks", bar, deadline, should_stop, self._prefill_chunks)
                self._step("convert", bar, deadline, should_stop, self._convert)
            except Preempted:
                report.preempted = True
                self.preemptions += 1
            except _OutOfTime:
                report.out_of_time = True
            finally:
                bar.close()
                report.seconds = time.perf_counter() - started
                account = self.accounts[strategy]
                account.rounds += 1
                account.seconds += report.seconds
                account.prefill_tokens += report.prefill_tokens
                account.decode_tokens += report.decode_tokens
                account.llm_calls += report.knowledge.llm_calls + report.history.llm_calls
                account.questions_populated += report.populated
                self._report = None
            return report

    def _step(
        self,
        name: str,
        bar: Any,
        deadline: float | None,
        should_stop: Callable[[], bool],
        work: Callable[[Callable[[], bool]], None],
    ) -> None:
        if should_stop():
            raise Preempted(f"idle round pre-empted before {name}")
        self._tick(deadline)
        bar.set_description(f"idle: {name}")
        work(should_stop)
        bar.update(1)

    def _tick(self, deadline: float | None) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime("time budget spent")

    # -- steps ----------------------------------------------------------------------------

    def _llm(self, prompt: str, **options: Any) -> str:
        """Free-form completion for the predictor and the abstract, accounted and pre-emptible."""
        chat = self._chat_format() is not None
        text, prompt_tokens, generated = self._pc.runner.complete(
            prompt, chat=chat, should_stop=self._should_stop, **options
        )
        if self._report is not None:
            self._report.prefill_tokens += prompt_tokens
            self._report.decode_tokens += generated
        return text

    def _chat_format(self) -> Callable[[str], str] | None:
        engine = self._pc.engine
        if use_chat_template(self._pc.config, engine.model_name, engine.chat_template is not None):
            return engine.chat_prompt
        return None

    def predictor(self) -> QueryPredictor:
        """The query predictor (built on first use)."""
        if self._predictor is None:
            pc = self._pc
            self._predictor = QueryPredictor(
                complete=self._llm,
                count_tokens=lambda text: len(pc.engine.tokenize(text)),
                embedder=pc.embedder,
                known_similarity=lambda embedding: max(
                    (
                        h.similarity
                        for h in pc.qa_bank.search(
                            embedding, top_n=1, min_similarity=-1.0, servable_only=False
                        )
                    ),
                    default=-1.0,
                ),
                config=pc.config,
                chat_format=self._chat_format(),
            )
        return self._predictor

    def _update_abstract(self, should_stop: Callable[[], bool]) -> None:
        pending = self.abstract.pending(self._pc.knowledge.chunks)
        if not pending or self._report is None:
            return
        before = len(self.abstract.summarized)
        self._report.abstract_facts_added += self.abstract.summarise(
            pending,
            self._llm,
            chat_format=self._chat_format(),
            max_batches=self._pc.config.abstract_batches_per_round,
        )
        self._report.chunks_summarised += len(self.abstract.summarized) - before

    def _run(
        self,
        question: str,
        embedding: np.ndarray,
        *,
        decode: bool,
        should_stop: Callable[[], bool],
        scope: dict[str, Any] | None = None,
    ) -> tuple[RunResult, list[Chunk]]:
        pc = self._pc
        retrieved = pc.knowledge.retrieve(
            question, pc.config.top_k, question_embedding=embedding, where=scope
        )
        chunks = [r.chunk for r in retrieved]
        result = drain(
            pc.runner.run(
                question,
                chunks,
                max_new_tokens=pc.config.max_new_tokens,
                decode=decode,
                should_stop=should_stop,
            )
        )
        assert self._report is not None
        self._report.prefill_tokens += result.prefilled_tokens
        self._report.decode_tokens += result.generated_tokens
        return result, chunks

    def _entry_metadata(
        self, result: RunResult, chunks: list[Chunk], scope: dict[str, Any] | None, origin: str
    ) -> dict[str, Any]:
        """Metadata of an entry this cache's own pipeline answered (binding, tokens, sources)."""
        binding = self._pc.binding()
        return answer_metadata(result, chunks, binding=binding, scope=scope, origin=origin)

    def _refresh_stale(self, should_stop: Callable[[], bool]) -> None:
        qa_bank = self._pc.qa_bank
        for entry in [e for e in qa_bank.entries if e.metadata.get("stale")]:
            if entry.metadata.get("remembered"):
                continue  # a caller's answer: only its caller replaces it
            scope = _scope(entry)
            result, chunks = self._run(
                entry.question, entry.embedding, decode=True, should_stop=should_stop, scope=scope
            )
            if result.text:
                metadata = self._entry_metadata(result, chunks, scope, entry.metadata.get("origin", "refresh"))
                qa_bank.correct(
                    entry.id, result.text, chunk_ids=result.layout.chunk_ids, stale=False, **metadata
                )
                assert self._report is not None
                self._report.refreshed += 1

    def _answer_followups(self, should_stop: Callable[[], bool]) -> None:
        if not self._pc.config.qa_bank:
            self.followups.clear()
            return
        while self.followups:
            question, embedding, scope = self.followups[0]
            result, chunks = self._run(question, embedding, decode=True, should_stop=should_stop, scope=scope)
            self.followups.popleft()
            if result.text:
                self._pc.qa_bank.store(
                    question,
                    embedding,
                    result.text,
                    chunk_ids=result.layout.chunk_ids,
                    metadata=self._entry_metadata(result, chunks, scope, "follow-up"),
                )
                assert self._report is not None
                self._report.followups_answered += 1

    def _predict_and_populate(
        self,
        should_stop: Callable[[], bool],
        stride: int,
        deadline: float | None,
        bar: Any,
        use_knowledge: bool = True,
    ) -> None:
        pc = self._pc
        report = self._report
        assert report is not None
        if not pc.config.prediction or not len(pc.knowledge) or stride <= 0:
            return
        predictor = self.predictor()
        predicted: list[tuple[PredictedQuestion, dict[str, Any] | None]] = []
        if self.new_history:
            history, tally = predictor.predict_from_history(list(self.history), stride)
            self.new_history = 0
            report.history.add(tally)
            predicted += [(p, self.history_scope) for p in history]
        self._tick(deadline)
        if use_knowledge:
            version = self.abstract.version
            knowledge, tally = predictor.predict_from_knowledge(self.abstract.lines, stride)
            self._knowledge_rounds[version] = self._knowledge_rounds.get(version, 0) + 1
            report.knowledge.add(tally)
            predicted += [(p, None) for p in knowledge]
        report.predicted = [p.text for p, _ in predicted]
        decode = self.strategy() == PREFILL_DECODE
        for prediction, scope in predicted:
            self._tick(deadline)
            result, chunks = self._run(
                prediction.text, prediction.embedding, decode=decode, should_stop=should_stop, scope=scope
            )
            report.populated += 1
            bar.set_postfix(populated=report.populated)
            if not pc.config.qa_bank:
                continue
            answer = result.text if decode else None
            if decode and not answer:
                continue
            pc.qa_bank.store(
                prediction.text,
                prediction.embedding,
                answer,
                chunk_ids=result.layout.chunk_ids,
                metadata=self._entry_metadata(result, chunks, scope, f"predicted-{prediction.origin}"),
            )
            if answer is None:
                report.pending_stored += 1
            else:
                report.answers_stored += 1

    def _convert(self, should_stop: Callable[[], bool]) -> None:
        pc = self._pc
        report = self._report
        assert report is not None
        if self.strategy() == PREFILL_DECODE and pc.config.qa_bank:
            for entry in [e for e in pc.qa_bank.entries if e.answer is None and not e.metadata.get("stale")]:
                scope = _scope(entry)
                result, chunks = self._run(
                    entry.question, entry.embedding, decode=True, should_stop=should_stop, scope=scope
                )
                if result.text:
                    metadata = self._entry_metadata(result, chunks, scope, entry.metadata.get("origin", "predicted"))
                    pc.qa_bank.correct(entry.id, result.text, chunk_ids=result.layout.chunk_ids, **metadata)
                    report.pending_decoded += 1
        if not pc.config.chunk_states:
            return
        runner = pc.runner
        for entry in pc.qa_bank.entries:
            if runner.tree.bytes >= PREFILL_BUDGET_SHARE * pc.config.chunk_state_budget_bytes:
                break
            chunks = [c for c in (pc.knowledge.get_chunk(i) for i in entry.chunk_ids) if c is not None]
            if not chunks or runner.path_is_stored(entry.question, chunks, pc.config.max_new_tokens):
                continue
            result = drain(
                runner.run(
                    entry.question,
                    chunks,
                    max_new_tokens=pc.config.max_new_tokens,
                    decode=False,
                    should_stop=should_stop,
                )
            )
            report.prefill_tokens += result.prefilled_tokens
            report.paths_reprefilled += 1

    def _chunks_to_prefill(self) -> Iterator[Chunk]:
        """Chunks whose [system, chunk] state is not stored, lazily, in the order to prefill
        them, while the tree is under its prefill share of the budget: chunks of recent QA
        entries (user questions and predictions, newest first), then chunks in the latest
        question's scope, then the rest in knowledge order."""
        pc = self._pc
        config = pc.config
        if not (config.chunk_states and config.knowledge_prefill) or not len(pc.knowledge):
            return
        chunks = pc.knowledge.chunks
        by_id = {c.id: c for c in chunks}
        ordered: dict[str, Chunk] = {}
        for entry in reversed(pc.qa_bank.entries):
            ordered.update((i, by_id[i]) for i in entry.chunk_ids if i in by_id and i not in ordered)
        scope = self.history_scope
        in_scope = [c for c in chunks if scope and matches_scope(c, scope)]
        for chunk in in_scope + list(chunks):
            ordered.setdefault(chunk.id, chunk)
        runner = pc.runner
        limit = PREFILL_BUDGET_SHARE * config.chunk_state_budget_bytes
        for chunk in ordered.values():
            if runner.tree.bytes >= limit:
                return
            if not runner.path_is_stored("", [chunk], 1):
                yield chunk

    def _prefill_chunks(self, should_stop: Callable[[], bool]) -> None:
        report = self._report
        assert report is not None
        for chunk in self._chunks_to_prefill():
            report.prefill_tokens += self._pc.runner.prefill_prefix([chunk], should_stop=should_stop)
            report.chunks_prefilled += 1

    # -- reporting ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy(),
            "preemptions": self.preemptions,
            "history_buffer": len(self.history),
            "pending_followups": len(self.followups),
            "abstract_lines": len(self.abstract.lines),
            **{name: asdict(account) for name, account in self.accounts.items()},
        }


def _scope(entry: Any) -> dict[str, Any] | None:
    return entry.metadata.get("scope") or None


def _progress_bar(enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=6, desc="idle", unit="step", disable=not enabled, leave=False)
