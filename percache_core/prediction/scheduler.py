"""Idle-time work: predict questions, populate both tiers, convert between them, refresh.

One ``warm()`` round (PerCache, sections 4.1-4.3):

1. predicted paths (``knowledge_prefill``, once a user asked): the [system, chunk] and
   [system, chunk, neighbour] states the demand estimate
   (:mod:`percache_core.prediction.demand`) finds likeliest for the next question, in
   that order, evicting stored paths it finds less likely to make room: the step that
   saves the most per idle second, so it goes first;
2. summarise new chunks into the knowledge abstract;
3. regenerate stale answers (a new chunk now ranks in their top-k);
4. answer follow-ups: questions that were served a similar question's answer get their own
   (and the served answer is checked against it: a calibration label);
5. predict questions from the abstract and from recent user questions (within the scope of
   the latest question), and populate them by the strategy: tau above ``strategy_cutoff``
   -> prefill only (chunk states and a pending QA entry), otherwise prefill and decode (a
   servable QA entry);
6. knowledge prefill in bulk (``knowledge_prefill``), only when every chunk's [system,
   chunk] state fits the budget: the [system, chunk] state of every chunk, recently retrieved
   chunks first, then the latest question's scope, then the rest, so that any prompt
   restores at least its first chunk; then [system, chunk, neighbour] for the
   ``knowledge_prefill_neighbours`` chunks that rank next when the chunk's own text is the
   question;
7. conversions: with the decode strategy, decode pending entries; with room in the
   chunk-state budget, re-prefill the paths of answered entries whose states were evicted;
8. calibrate (an approximate tier under ``max_error_rate``): label approximate answers with
   the model's own, within ``calibration_answers_per_round`` model answers
   (:mod:`percache_core.prediction.calibrating`).

Every step checks ``should_stop`` (a user question is waiting) between segments and tokens
and stops the round at once; the time budget is checked between steps. All idle work is
accounted per strategy: tokens prefilled and decoded, seconds, questions populated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..config import PerCacheConfig
from ..kv.budget import PREFILL_BUDGET_SHARE
from ..qa.calibration import Label, retrieval_context
from ..serving.parts import CacheParts
from ..serving.request_path import RequestPath
from ..serving.state_runner import Preempted, RunOptions, RunResult
from ..serving.streaming import drain
from ..types import QAEntry
from .abstract import KnowledgeAbstract
from .calibrating import CalibrationSpend, CalibrationWork
from .demand import DemandEstimate, follow
from .invalidation import Invalidation
from .paths import knowledge_prefill_paths, make_room, predicted_paths
from .predictor import PredictedQuestion, PredictionTally, QueryPredictor, predictor_for, use_chat_template

PREFILL_ONLY = "prefill_only"
PREFILL_DECODE = "prefill_decode"
PREDICTED_PATHS_CONSIDERED = 4096  # candidates of the demand estimate per round


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
    questions_predicted: int = 0
    questions_populated: int = 0
    answers_stored: int = 0
    pending_stored: int = 0
    chunks_prefilled: int = 0
    pairs_prefilled: int = 0
    predicted_paths_prefilled: int = 0
    predicted_prefill_seconds: float = 0.0
    predicted_prefill_tokens: int = 0
    calibration_answers: int = 0  # model answers spent on calibration labels
    calibration_labels: int = 0
    calibration_seconds: float = 0.0


@dataclass
class WarmReport:
    """What one idle round did."""

    strategy: str
    seconds: float = 0.0
    chunks_summarised: int = 0
    chunks_prefilled: int = 0  # [system, chunk] states of the knowledge prefill
    pairs_prefilled: int = 0  # [system, chunk, neighbour] states (knowledge_prefill_neighbours)
    predicted_paths_prefilled: int = 0  # states the demand estimate named (step 1)
    predicted_prefill_seconds: float = 0.0
    predicted_prefill_tokens: int = 0
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
    served_checked: int = 0  # approximate answers served to users, checked against the model's own
    served_wrong: int = 0  # of those, not equivalent
    calibration_answers: int = 0  # model answers spent on labels (variants, composed runs)
    calibration_labels: int = 0  # labels they gave
    calibration_seconds: float = 0.0
    paths_reprefilled: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: bool = False
    out_of_time: bool = False
    # what the user's questions since the previous round were served from idle work's
    # results (see ``stats()["served_from_prediction"]``)
    served_from_prediction: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)



def population_strategy(config: PerCacheConfig, threshold: float | None = None) -> str:
    """``prefill_only`` when tau is above the cutoff (hits need very close questions, so
    answers are rarely reused), else ``prefill_decode``. A tier that is off forces the
    strategy that still fills the other.

    >>> population_strategy(PerCacheConfig(similarity_threshold=0.95, strategy_cutoff=0.9))
    'prefill_only'
    """
    if not config.chunk_states:
        return PREFILL_DECODE
    if not config.qa_bank:
        return PREFILL_ONLY
    tau = config.similarity_threshold if threshold is None else threshold
    return PREFILL_ONLY if tau > config.strategy_cutoff else PREFILL_DECODE


class Scheduler:
    """Plans and runs idle work over one cache's *parts*."""

    def __init__(self, parts: CacheParts, request_path: RequestPath) -> None:
        self.parts = parts
        self.request_path = request_path  # runs this cache's own prompt for idle work
        config = parts.config
        self.activity = parts.activity
        self.abstract = KnowledgeAbstract(
            parts.meta, max_lines=config.abstract_max_lines, batch_chunks=config.abstract_batch_chunks
        )
        self.accounts: dict[str, IdleAccount] = {PREFILL_ONLY: IdleAccount(), PREFILL_DECODE: IdleAccount()}
        self.preemptions = 0
        self._knowledge_rounds: dict[int, int] = {}  # abstract version -> rounds predicted
        self._predictor: QueryPredictor | None = None
        self._lock = threading.RLock()  # one round at a time (a round may delete documents it finds gone)
        self._report: WarmReport | None = None
        self._should_stop: Callable[[], bool] = parts.activity.waiting
        self.invalidation = Invalidation(parts, self.abstract, self._lock)
        self.calibration = CalibrationWork(parts, request_path)
        self._served_before: dict[str, Any] = {}
        self.demand = DemandEstimate()
        self._demand_lock = threading.Lock()  # the estimate is read by stats() while a round runs
        self._asked_seen = 0  # of the activity's asked questions, those the estimate has seen
        self._predicted_done = -1  # asked questions seen when predicted paths last ran to the end

    @property
    def round_report(self) -> WarmReport | None:
        """The report of the idle round now running (it fills in as the round goes), or None
        between rounds."""
        return self._report

    # -- what the facade tells the scheduler ------------------------------------------------

    def configure(self, config: PerCacheConfig) -> None:
        """Use new settings from the next round on (the predictor is rebuilt with them)."""
        with self._lock:
            self.abstract.max_lines = config.abstract_max_lines
            self.abstract.batch_chunks = config.abstract_batch_chunks
            self._predictor = None

    # -- planning -------------------------------------------------------------------------

    def strategy(self, threshold: float | None = None) -> str:
        """The population strategy now (see :func:`population_strategy`)."""
        return population_strategy(self.parts.config, threshold)

    def has_work(self, own_pipeline: bool = True) -> bool:
        """Whether an idle round would do anything useful now (with ``prediction=False``
        only refreshing stale answers and prefilling chunk states remain; without
        *own_pipeline*, as for ``warm(answer=...)``, only summarising and predicting)."""
        parts, config = self.parts, self.parts.config
        if own_pipeline and self._predicted_paths_due():
            return True
        entries = parts.qa_bank.entries if config.qa_bank and own_pipeline else []
        if any(e.stale for e in entries):
            return True
        if config.prediction and len(parts.knowledge):
            if self.abstract.pending(parts.knowledge.chunks) or self.activity.new_history:
                return True
            if own_pipeline and self.activity.followups:
                return True
            if self._knowledge_rounds.get(self.abstract.version, 0) < config.knowledge_prediction_rounds:
                return True
            if self.strategy() == PREFILL_DECODE and any(e.answer is None for e in entries):
                return True
        return own_pipeline and next(knowledge_prefill_paths(self.parts, self.activity.history_scope), None) is not None

    # -- the round ------------------------------------------------------------------------

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
        """Run one idle round (see the module docstring); stops early when a user question
        waits (``report.preempted``) or *max_seconds* run out (``report.out_of_time``).
        With ``knowledge_prediction=False`` only history-based prediction runs.

        *answer* populates a predicted question through the caller's own pipeline (a
        framework's query engine) instead of this cache's prompt, and returns whether it
        stored an answer; then the round only summarises and predicts, and the steps that
        run this cache's own prompt (refresh, follow-ups, knowledge prefill, conversions)
        are left out: their answers and states would not be the caller's. The caller's
        calls into this cache are idle work (``UserActivity.background``): no activity,
        history or usage counts, and a user's question pre-empts their model runs."""
        parts = self.parts
        waiting = should_stop or parts.activity.waiting
        own_pipeline = answer is None
        with self._lock:
            strategy = self.strategy() if own_pipeline else PREFILL_DECODE
            report = WarmReport(strategy)
            self._report = report
            started = time.perf_counter()
            deadline = None if max_seconds is None else started + max_seconds

            def should_stop() -> bool:  # checked between segments and tokens
                return waiting() or (deadline is not None and time.perf_counter() > deadline)

            self._should_stop = should_stop
            stride = max_predictions if max_predictions is not None else parts.config.prediction_stride
            bar = _progress_bar(progress, steps=8 if own_pipeline else 2)
            try:
                if (own_pipeline or parts.runtime.engine_loaded) and not should_stop():
                    parts.runtime.self_check()  # once per engine (seconds), here rather than in an answer
                    parts.runtime.size_state_budget(parts.knowledge.chunks)
                if own_pipeline:
                    self._step("predicted paths", bar, deadline, should_stop, self._prefill_predicted)
                self._step("abstract", bar, deadline, should_stop, self._update_abstract)
                if own_pipeline:
                    self._step("refresh", bar, deadline, should_stop, self._refresh_stale)
                    self._step("follow-ups", bar, deadline, should_stop, self._answer_followups)
                self._step(
                    "predict",
                    bar,
                    deadline,
                    should_stop,
                    lambda stop: self._predict_and_populate(
                        stop, stride, deadline, bar, knowledge_prediction, answer
                    ),
                )
                if own_pipeline:
                    self._step("prefill chunks", bar, deadline, should_stop, self._prefill_chunks)
                    self._step("convert", bar, deadline, should_stop, self._convert)
                    self._step("calibrate", bar, deadline, should_stop, self._calibrate)
            except Preempted:
                if deadline is not None and time.perf_counter() > deadline and not waiting():
                    report.out_of_time = True
                else:
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
                account.questions_predicted += len(report.predicted)
                account.questions_populated += report.populated
                account.answers_stored += report.answers_stored
                account.pending_stored += report.pending_stored
                account.chunks_prefilled += report.chunks_prefilled
                account.pairs_prefilled += report.pairs_prefilled
                account.predicted_paths_prefilled += report.predicted_paths_prefilled
                account.predicted_prefill_seconds += report.predicted_prefill_seconds
                account.predicted_prefill_tokens += report.predicted_prefill_tokens
                account.calibration_answers += report.calibration_answers
                account.calibration_labels += report.calibration_labels
                account.calibration_seconds += report.calibration_seconds
                report.served_from_prediction = self._served_since_last_round()
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
        text, prompt_tokens, generated = self.parts.runtime.runner.complete_plain(
            prompt, chat=chat, should_stop=self._should_stop, **options
        )
        if self._report is not None:
            self._report.prefill_tokens += prompt_tokens
            self._report.decode_tokens += generated
        return text

    def _chat_format(self) -> Callable[[str], str] | None:
        engine = self.parts.runtime.engine
        if use_chat_template(self.parts.config, engine.model_name, engine.chat_template is not None):
            return engine.chat_prompt
        return None

    def predictor(self) -> QueryPredictor:
        """The query predictor (built on first use)."""
        if self._predictor is None:
            self._predictor = predictor_for(self.parts, self._llm, self._chat_format())
        return self._predictor

    def _update_abstract(self, should_stop: Callable[[], bool]) -> None:
        if not self.parts.config.prediction:
            return  # the abstract only serves prediction
        pending = self.abstract.pending(self.parts.knowledge.chunks)
        if not pending or self._report is None:
            return
        before = len(self.abstract.summarized)
        self._report.abstract_facts_added += self.abstract.summarise(
            pending,
            self._llm,
            chat_format=self._chat_format(),
            max_batches=self.parts.config.abstract_batches_per_round,
        )
        self._report.chunks_summarised += len(self.abstract.summarized) - before

    def _populate(
        self,
        question: str,
        embedding: np.ndarray,
        *,
        decode: bool,
        origin: str,
        should_stop: Callable[[], bool],
        scope: dict[str, Any] | None = None,
        replacing: QAEntry | None = None,
    ) -> RunResult:
        """Run this cache's own prompt for *question* through the request path (see
        ``RequestPath.populate``), accounted in the round's report."""
        result = self.request_path.populate(
            question,
            embedding,
            scope=scope,
            decode=decode,
            origin=origin,
            should_stop=should_stop,
            replacing=replacing,
        )
        assert self._report is not None
        self._report.prefill_tokens += result.prefilled_tokens
        self._report.decode_tokens += result.generated_tokens
        return result

    def _answer_again(self, entry: QAEntry, default_origin: str, should_stop: Callable[[], bool]) -> bool:
        """Answer a stale or pending entry's question anew and put the answer in its place;
        whether there was one."""
        result = self._populate(
            entry.question,
            entry.embedding,
            decode=True,
            origin=entry.origin or default_origin,
            should_stop=should_stop,
            scope=entry.scope,
            replacing=entry,
        )
        return bool(result.text)

    def _calibrate(self, should_stop: Callable[[], bool]) -> None:
        """Buy calibration labels with idle model answers (``prediction/calibrating.py``)."""
        if not self.calibration.due():
            return
        assert self._report is not None
        spend = CalibrationSpend()
        started = time.perf_counter()
        try:
            self.calibration.run(should_stop, spend)
        finally:
            self._report.calibration_answers += spend.answers
            self._report.calibration_labels += spend.labels
            self._report.calibration_seconds += time.perf_counter() - started

    def _refresh_stale(self, should_stop: Callable[[], bool]) -> None:
        for entry in [e for e in self.parts.qa_bank.entries if e.stale]:  # a caller's remembered answer never is
            if self._answer_again(entry, "refresh", should_stop):
                assert self._report is not None
                self._report.refreshed += 1

    def _answer_followups(self, should_stop: Callable[[], bool]) -> None:
        if not self.parts.config.qa_bank:
            self.activity.followups.clear()
            return
        while self.activity.followups:
            followup = self.activity.followups[0]
            result = self._populate(
                followup.question,
                followup.embedding,
                decode=True,
                origin="follow-up",
                should_stop=should_stop,
                scope=followup.scope,
            )
            self.activity.followups.popleft()
            if result.text:
                assert self._report is not None
                self._report.followups_answered += 1
                served = followup.served
                if served.entry.answer is not None and not served.entry.remembered:  # the served answer, checked
                    right = self.parts.answers_agree(served.entry.answer, result.text)
                    context = retrieval_context(result.layout.chunk_ids, served.entry.chunk_ids)
                    label = Label(served.entry.id, served.similarity, right, "served", True, context)
                    self.parts.calibration.add(label)
                    self._report.served_checked += 1
                    self._report.served_wrong += not right

    def _predict_and_populate(
        self,
        should_stop: Callable[[], bool],
        stride: int,
        deadline: float | None,
        bar: Any,
        use_knowledge: bool = True,
        answer: Callable[[str], bool] | None = None,
    ) -> None:
        parts = self.parts
        report = self._report
        assert report is not None
        if not parts.config.prediction or not len(parts.knowledge) or stride <= 0:
            return
        predictor = self.predictor()
        predicted: list[tuple[PredictedQuestion, dict[str, Any] | None]] = []
        if self.activity.new_history:
            history, tally = predictor.predict_from_history(list(self.activity.history), stride)
            self.activity.new_history = 0
            report.history.add(tally)
            predicted += [(p, self.activity.history_scope) for p in history]
        self._tick(deadline)
        if use_knowledge:
            version = self.abstract.version
            knowledge, tally = predictor.predict_from_knowledge(self.abstract.lines, stride)
            self._knowledge_rounds[version] = self._knowledge_rounds.get(version, 0) + 1
            report.knowledge.add(tally)
            predicted += [(p, None) for p in knowledge]
        report.predicted = [p.text for p, _ in predicted]
        if answer is not None:
            for prediction, _ in predicted:
                self._tick(deadline)
                if should_stop():
                    raise Preempted("idle round pre-empted between predicted questions")
                with self.activity.background(should_stop):  # not a user's call; pre-emptible
                    report.answers_stored += bool(answer(prediction.text))
                report.populated += 1
                bar.set_postfix(populated=report.populated)
            return
        decode = self.strategy() == PREFILL_DECODE
        for prediction, scope in predicted:
            self._tick(deadline)
            result = self._populate(
                prediction.text,
                prediction.embedding,
                decode=decode,
                origin=f"predicted-{prediction.origin}",
                should_stop=should_stop,
                scope=scope,
            )
            report.populated += 1
            bar.set_postfix(populated=report.populated)
            if parts.config.qa_bank and not decode:
                report.pending_stored += 1
            elif parts.config.qa_bank and result.text:
                report.answers_stored += 1

    def _convert(self, should_stop: Callable[[], bool]) -> None:
        parts = self.parts
        report = self._report
        assert report is not None
        if self.strategy() == PREFILL_DECODE and parts.config.qa_bank:
            for entry in [e for e in parts.qa_bank.entries if e.state == "pending"]:
                report.pending_decoded += self._answer_again(entry, "predicted", should_stop)
        if not parts.config.chunk_states:
            return
        runner = parts.runtime.runner
        for entry in parts.qa_bank.entries:
            if runner.states.bytes >= PREFILL_BUDGET_SHARE * parts.runtime.state_budget_bytes:
                break
            chunks = [c for c in (parts.knowledge.get_chunk(i) for i in entry.chunk_ids) if c is not None]
            if not chunks or runner.path_is_stored(entry.question, chunks, parts.config.max_new_tokens):
                continue
            tokens = parts.config.max_new_tokens
            layout = runner.lay_out(entry.question, chunks, max_new_tokens=tokens)
            options = RunOptions(max_new_tokens=tokens, decode=False, idle=True)
            result = drain(runner.run(layout, options, should_stop=should_stop))
            report.prefill_tokens += result.prefilled_tokens
            report.paths_reprefilled += 1

    def _predicted_paths_due(self) -> bool:
        """Whether the predicted-paths step has work: questions came since it last ran to
        the end (a round out of time or pre-empted leaves it due)."""
        config = self.parts.config
        if not (config.chunk_states and config.knowledge_prefill):
            return False
        return self.parts.activity.asked_total > 0 and self._predicted_done != self.parts.activity.asked_total

    def _follow_asked(self) -> int:
        """Feed the demand estimate the questions asked since it last looked; the count of
        questions asked so far."""
        activity = self.parts.activity
        with self._demand_lock:
            asked_total = activity.asked_total
            self._asked_seen = follow(
                self.demand, activity.asked, self._asked_seen, asked_total, self.parts.knowledge, self.parts.embed_question
            )
        return asked_total

    def _prefill_predicted(self, should_stop: Callable[[], bool]) -> None:
        """Step 1: prefill the paths the demand estimate names, likeliest first. Where the
        bulk prefill does not fit the budget (``ModelRuntime.knowledge_prefill_fits``), it
        evicts less likely stored paths to make room and stops where the stored ones are
        all likelier than the next candidate; where it fits, it evicts nothing (the bulk
        prefill fills the rest) and stops at the prefill share."""
        parts, report = self.parts, self._report
        assert report is not None
        if not self._predicted_paths_due() or not len(parts.knowledge):
            return
        asked_total = self._follow_asked()
        with self._demand_lock:
            probabilities = self.demand.probabilities(parts.knowledge, limit=PREDICTED_PATHS_CONSIDERED)
        runner = parts.runtime.runner
        evict = not parts.runtime.knowledge_prefill_fits(parts.knowledge.chunks)
        for chunks, probability in predicted_paths(parts, probabilities):
            if not make_room(parts, probabilities, probability if evict else 0.0):
                break
            started = time.perf_counter()
            tokens = runner.prefill_prefix(chunks, should_stop=should_stop)
            report.predicted_prefill_seconds += time.perf_counter() - started
            report.predicted_prefill_tokens += tokens
            report.prefill_tokens += tokens
            report.predicted_paths_prefilled += 1
        self._predicted_done = asked_total

    def _prefill_chunks(self, should_stop: Callable[[], bool]) -> None:
        report = self._report
        assert report is not None
        for path in knowledge_prefill_paths(self.parts, self.activity.history_scope):
            report.prefill_tokens += self.parts.runtime.runner.prefill_prefix(path, should_stop=should_stop)
            if len(path) == 1:
                report.chunks_prefilled += 1
            else:
                report.pairs_prefilled += 1

    # -- reporting ------------------------------------------------------------------------

    def _served_since_last_round(self) -> dict[str, Any]:
        served = self.parts.usage.summary()["served_from_prediction"]
        since = {
            name: value - self._served_before.get(name, 0)
            for name, value in served.items()
            if isinstance(value, int)
        }
        self._served_before = served
        return since

    def stats(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy(),
            "preemptions": self.preemptions,
            "history_buffer": len(self.activity.history),
            "pending_followups": len(self.activity.followups),
            "abstract_lines": len(self.abstract.lines),
            **{name: asdict(account) for name, account in self.accounts.items()},
        }


    def approximate_stats(self) -> dict[str, Any]:
        """The approximate tiers under their bound: the share of answers that were
        approximate, the error rate measured on the served answers idle work checked, the
        calibrated threshold and recompute setting in force, the labels, and what they cost."""
        parts, config = self.parts, self.parts.config
        calibration = parts.calibration
        summary = calibration.summary(config.max_error_rate)
        served = summary["by_kind"].get("served", {"labels": 0, "wrong": 0})  # type: ignore[union-attr]
        usage = parts.usage.summary()
        accounts = self.accounts.values()
        return {
            "max_error_rate": config.max_error_rate,
            "equivalence": config.answer_equivalence,
            "answers": usage["approximate_answers"],
            "share": usage["approximate_share"],
            "checked": served["labels"],
            "wrong": served["wrong"],
            "measured_error_rate": served["wrong"] / served["labels"] if served["labels"] else None,
            "semantic_thresholds": summary["thresholds"] if config.bounded else None,
            "recompute_tokens": self.request_path.recompute_tokens() if config.reuse == "approximate" else None,
            "labels": summary["labels"],
            "labels_by_kind": summary["by_kind"],
            "calibration_answers": sum(a.calibration_answers for a in accounts),
            "calibration_seconds": sum(a.calibration_seconds for a in accounts),
        }

    def demand_stats(self) -> dict[str, Any]:
        """How well prediction served the chunk states: the demand estimate's hit rate on
        the questions that came (:class:`~percache_core.prediction.demand.HitRate`), and
        the idle seconds and idle-stored state bytes spent per second of prefill those
        states saved (their restored tokens at the predicted-paths step's own prefill
        speed, restore time not subtracted)."""
        if self.parts.config.chunk_states and self.parts.config.knowledge_prefill:
            self._follow_asked()  # the hit rate counts the latest question too
        accounts = self.accounts.values()
        idle_seconds = sum(a.seconds for a in accounts)
        predicted_seconds = sum(a.predicted_prefill_seconds for a in accounts)
        predicted_tokens = sum(a.predicted_prefill_tokens for a in accounts)
        restored = self.parts.usage.summary()["served_from_prediction"]["idle_tokens_restored"]
        saved = restored * predicted_seconds / predicted_tokens if predicted_tokens else 0.0
        idle_bytes = self.parts.runtime.idle_state_bytes()
        with self._demand_lock:
            hit_rate = self.demand.hit_rate.as_dict()
        return {
            **hit_rate,
            "stay_rate": self.demand.stay_rate(),
            "predicted_paths_prefilled": sum(a.predicted_paths_prefilled for a in accounts),
            "predicted_prefill_seconds": predicted_seconds,
            "idle_tokens_restored": restored,
            "prefill_seconds_saved": saved,
            "idle_seconds_per_second_saved": idle_seconds / saved if saved else None,
            "idle_state_bytes": idle_bytes,
            "bytes_per_second_saved": idle_bytes / saved if saved else None,
        }


def _progress_bar(enabled: bool, steps: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc="idle", unit="step", disable=not enabled, leave=False)
