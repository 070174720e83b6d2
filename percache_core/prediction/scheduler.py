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

Each step is an object of :mod:`percache_core.prediction.idle_steps`; the round runs them
in this order (:func:`~percache_core.prediction.idle_round.run_steps`), each filling in its
own part of the round's :class:`~percache_core.prediction.idle_round.WarmReport`. Every
step checks ``should_stop`` (a user question is waiting) between segments and tokens and
stops the round at once; the time budget is checked between steps. All idle work is
accounted per strategy (:class:`~percache_core.prediction.idle_round.IdleAccount`, the sum
of its rounds' reports): tokens prefilled and decoded, seconds, questions populated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..answering.parts import CacheParts
from ..answering.request_path import RequestPath
from ..config import PerCacheConfig
from ..errors import Preempted
from ..kv.engine import Decoding
from .abstract import KnowledgeAbstract
from .app_requests import AppLeadingStates, AppPassages, AppPredictedRequests
from .background_checks import BackgroundChecks
from .calibrating import CalibrationWork
from .idle_round import (
    PREFILL_DECODE,
    PREFILL_ONLY,
    IdleAccount,
    IdleRound,
    IdleStep,
    OutOfTime,
    WarmOptions,
    WarmReport,
    population_strategy,
    run_steps,
)
from .idle_steps import (
    AnswerFollowUps,
    Calibrate,
    Convert,
    KnowledgePrefill,
    PredictAndPopulate,
    PredictedPaths,
    RefreshStale,
    SummariseKnowledge,
)
from .invalidation import Invalidation
from .predictor import QueryPredictor, predictor_for, use_chat_template

__all__ = ["PREFILL_DECODE", "PREFILL_ONLY", "IdleAccount", "Scheduler", "WarmReport", "population_strategy"]


class Scheduler:
    """Plans and runs idle work over one cache's *parts*: :meth:`has_work`, :meth:`warm`
    (one round), :meth:`stats`, :meth:`demand_stats` and :meth:`approximate_stats`."""

    def __init__(self, parts: CacheParts, request_path: RequestPath) -> None:
        self.parts = parts
        self.request_path = request_path  # runs this cache's own prompt for idle work
        self.activity = parts.activity
        self.abstract = KnowledgeAbstract(
            parts.meta,
            max_lines=lambda: parts.config.idle.abstract_max_lines,
            batch_chunks=lambda: parts.config.idle.abstract_batch_chunks,
        )
        self.accounts: dict[str, IdleAccount] = {PREFILL_ONLY: IdleAccount(), PREFILL_DECODE: IdleAccount()}
        self.preemptions = 0
        self._predictor: QueryPredictor | None = None
        self._predictor_config: PerCacheConfig | None = None  # the configuration it was built under
        self._lock = threading.RLock()  # one round at a time (a round may delete documents it finds gone)
        self._round: IdleRound | None = None
        self._report: WarmReport | None = None
        self.invalidation = Invalidation(parts, self.abstract, self._lock)
        # the self-checks of flows that run no idle round: started by the first answer
        # that finds them pending (ModelRuntime.runner)
        self.background_checks = BackgroundChecks(parts.runtime, parts.activity)
        parts.runtime.when_checks_pending = self.background_checks.start
        self._served_before: dict[str, Any] = {}
        self.predicted_paths = PredictedPaths(parts)
        self.prediction = PredictAndPopulate(parts, self.abstract, lambda: self.predictor())
        self.steps: list[IdleStep] = [
            AppPassages(parts, self.invalidation),
            self.predicted_paths,
            AppLeadingStates(parts),
            SummariseKnowledge(parts, self.abstract, self._llm, self._chat_format),
            RefreshStale(parts),
            AnswerFollowUps(parts),
            self.prediction,
            AppPredictedRequests(parts, request_path, self.prediction),
            KnowledgePrefill(parts),
            Convert(parts),
            Calibrate(CalibrationWork(parts, request_path)),
        ]

    @property
    def round_report(self) -> WarmReport | None:
        """What the idle round now running did so far (its finished steps and the one
        running), or None between rounds."""
        report, round = self._report, self._round
        if report is None or round is None:
            return None
        view = WarmReport(report.strategy)
        view.add(report)
        if round.part is not None:
            view.add(round.part)
        return view

    def strategy(self, threshold: float | None = None) -> str:
        """The population strategy now (see :func:`population_strategy`)."""
        return population_strategy(self.parts.config, threshold)

    def own_prompt_asked(self) -> bool:
        """Whether idle work runs this cache's own prompt: unless apps bring their own
        prompts (shapes learned, or an adapter or ``percache serve`` said so before the
        app's first request: ``pc.caller.serves_app``) and nobody asked ``pc.answer`` in
        this process."""
        shapes = self.parts.shapes
        return self.parts.activity.asked_total > 0 or not (shapes.app_attached or shapes.shapes())

    def has_work(self, own_pipeline: bool = True) -> bool:
        """Whether an idle round would do anything useful now (with ``prediction=False``
        only refreshing stale answers and prefilling chunk states remain; without
        *own_pipeline*, as for ``warm(answer=...)``, or where only apps' own prompts came,
        only summarising, predicting and the apps' requests)."""
        own_pipeline = own_pipeline and self.own_prompt_asked()
        return any(step.wants_round(own_pipeline) for step in self.steps)

    # -- the round ------------------------------------------------------------------------

    def warm(self, options: WarmOptions = WarmOptions()) -> WarmReport:
        """Run one idle round (see the module docstring) as *options* say; stops early when
        a user question waits (``report.preempted``) or its seconds run out
        (``report.out_of_time``). With ``knowledge_prediction=False`` only history-based
        prediction runs. An *answer*
        populates a predicted question through the caller's own pipeline (a framework's
        query engine) instead of this cache's prompt, and returns whether it stored an
        answer; then the round only summarises and predicts, and the steps that run this
        cache's own prompt (refresh, follow-ups, knowledge prefill, conversions) are left
        out: their answers and states would not be the caller's; so they are where only
        apps' prompts came (:meth:`own_prompt_asked`: see ``app_requests``). The caller's
        calls into this cache are idle work (``UserActivity.background``): no activity,
        history or usage counts, and a user's question pre-empts their model runs."""
        parts = self.parts
        waiting = options.should_stop or parts.activity.waiting
        own_pipeline = options.answer is None and self.own_prompt_asked()
        with self._lock:
            started = time.perf_counter()
            deadline = None if options.max_seconds is None else started + options.max_seconds

            def stop() -> bool:  # checked between segments and tokens
                return waiting() or (deadline is not None and time.perf_counter() > deadline)

            strategy = self.strategy() if own_pipeline else PREFILL_DECODE
            steps = sum(1 for step in self.steps if own_pipeline or not step.own_pipeline_only)
            bar = _progress_bar(options.progress, steps=steps)
            round = IdleRound(parts, self.request_path, stop, deadline, bar, strategy, own_pipeline)
            stride = options.max_predictions
            self.prediction.stride = stride if stride is not None else parts.config.idle.prediction_stride
            self.prediction.use_knowledge = options.knowledge_prediction
            self.prediction.answer = options.answer
            report = self._report = WarmReport(strategy)
            self._round = round
            try:
                if (own_pipeline or parts.runtime.engine_loaded or parts.shapes.app_attached) and not stop():
                    # once per engine, here rather than in an answer: a user pre-empts a check,
                    # the round's deadline only keeps the next one from starting
                    parts.runtime.self_check(waiting, lambda: not stop())
                    parts.runtime.size_state_budget(parts.knowledge.chunks)
                if parts.runtime.engine_loaded and not parts.runtime.checks_ready():
                    raise OutOfTime("the engine's self-checks took the round")  # its steps would keep no state
                run_steps(round, self.steps, report)
            except Preempted:
                if deadline is not None and time.perf_counter() > deadline and not waiting():
                    report.out_of_time = True
                else:
                    report.preempted = True
                    self.preemptions += 1
            except OutOfTime:
                report.out_of_time = True
            finally:
                if not report.preempted and not waiting():  # stock keeps the last prompt in its context
                    parts.runtime.reinstate_asked()
                bar.close()
                report.seconds = time.perf_counter() - started
                self.accounts[strategy].add_round(report)
                report.served_from_prediction = self._served_since_last_round()
                self._report, self._round = None, None
            return report

    # -- the model for free-form calls ----------------------------------------------------

    def _llm(self, prompt: str, decoding: Decoding) -> str:
        """Free-form completion for the predictor and the abstract, accounted in the step
        part now running and pre-emptible."""
        round = self._round
        chat = self._chat_format() is not None
        should_stop = round.should_stop if round is not None else self.activity.waiting
        text, prompt_tokens, generated = self.parts.runtime.runner.complete_plain(
            prompt, decoding, chat=chat, should_stop=should_stop
        )
        if round is not None and round.part is not None:
            round.part.prefill_tokens += prompt_tokens
            round.part.decode_tokens += generated
        return text

    def _chat_format(self) -> Callable[[str], str] | None:
        engine = self.parts.runtime.engine
        if use_chat_template(self.parts.config, engine.model_name, engine.chat_template is not None):
            return engine.chat_prompt
        return None

    def predictor(self) -> QueryPredictor:
        """The query predictor (built on first use, and again when the configuration
        changed: its prompts follow the template setting)."""
        if self._predictor is None or self._predictor_config is not self.parts.config:
            self._predictor_config = self.parts.config
            self._predictor = predictor_for(self.parts, self._llm, self._chat_format())
        return self._predictor

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
        """The strategy in force, pre-emptions, the activity buffers, the abstract's size
        and the idle accounts per strategy."""
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
        summary = calibration.summary(config.bound.max_error_rate)
        served = summary["by_kind"].get("served", {"labels": 0, "wrong": 0})  # type: ignore[union-attr]
        usage = parts.usage.summary()
        accounts = self.accounts.values()
        return {
            "max_error_rate": config.bound.max_error_rate,
            "equivalence": config.bound.answer_equivalence,
            "answers": usage["approximate_answers"],
            "share": usage["approximate_share"],
            "checked": served["labels"],
            "wrong": served["wrong"],
            "measured_error_rate": served["wrong"] / served["labels"] if served["labels"] else None,
            "semantic_thresholds": summary["thresholds"] if config.bound.bounded else None,
            "recompute_tokens": parts.states.recompute_tokens(parts.calibration),
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
        if self.parts.config.tiers.chunk_states and self.parts.config.idle.knowledge_prefill:
            self.predicted_paths.follow_asked()  # the hit rate counts the latest question too
        accounts = self.accounts.values()
        idle_seconds = sum(a.seconds for a in accounts)
        predicted_seconds = sum(a.predicted_prefill_seconds for a in accounts)
        predicted_tokens = sum(a.predicted_prefill_tokens for a in accounts)
        restored = self.parts.usage.summary()["served_from_prediction"]["idle_tokens_restored"]
        saved = restored * predicted_seconds / predicted_tokens if predicted_tokens else 0.0
        idle_bytes = self.parts.runtime.idle_state_bytes()
        paths = self.predicted_paths
        with paths.lock:
            hit_rate = paths.demand.hit_rate.as_dict()
        return {
            **hit_rate,
            "stay_rate": paths.demand.stay_rate(),
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
