"""The steps of an idle round, in the order a round runs them (see
:mod:`percache_core.prediction.scheduler`): each is a small object with a name, whether it
runs this cache's own prompt, whether it alone makes a round worth starting
(``wants_round``) and ``run(round, part) -> part``.

- :class:`PredictedPaths`: the states the demand estimate names, likeliest first;
- :class:`SummariseKnowledge`: new chunks into the knowledge abstract;
- :class:`RefreshStale`: stale answers answered again;
- :class:`AnswerFollowUps`: questions served a similar question's answer get their own;
- :class:`PredictAndPopulate`: questions predicted and populated by the strategy;
- :class:`KnowledgePrefill`: the bulk prefill of every chunk (and its neighbours);
- :class:`Convert`: pending entries decoded, evicted paths prefilled again;
- :class:`Calibrate`: labels for the approximate tiers' bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..answering.parts import CacheParts
from ..answering.request import IdleQuestion
from ..errors import Preempted
from ..kv.budget import PREFILL_BUDGET_SHARE
from ..qa.calibration import Label, retrieval_context
from ..serving.state_runner import RunOptions
from ..serving.streaming import drain
from .abstract import KnowledgeAbstract
from .calibrating import CalibrationSpend, CalibrationWork
from .demand import DemandEstimate, follow
from .idle_round import PREFILL_DECODE, IdleRound, WarmReport, population_strategy
from .paths import knowledge_prefill_paths, make_room, predicted_paths
from .predictor import PredictedQuestion, QueryPredictor

PREDICTED_PATHS_CONSIDERED = 4096  # candidates of the demand estimate per round


class PredictedPaths:
    """Step 1: prefill the paths the demand estimate names, likeliest first. Where the
    bulk prefill does not fit the budget (``ModelRuntime.knowledge_prefill_fits``), it
    evicts less likely stored paths to make room and stops where the stored ones are all
    likelier than the next candidate; where it fits, it evicts nothing (the bulk prefill
    fills the rest) and stops at the prefill share. Owns the demand estimate."""

    name = "predicted paths"
    own_pipeline_only = True

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts
        self.demand = DemandEstimate()
        self.lock = threading.Lock()  # the estimate is read by stats() while a round runs
        self._asked_seen = 0  # of the activity's asked questions, those the estimate has seen
        self._done = -1  # asked questions seen when the step last ran to the end

    def due(self) -> bool:
        """Whether questions came since the step last ran to the end (a round out of time
        or pre-empted leaves it due)."""
        config = self.parts.config
        if not (config.tiers.chunk_states and config.idle.knowledge_prefill):
            return False
        return self.parts.activity.asked_total > 0 and self._done != self.parts.activity.asked_total

    def wants_round(self, own_pipeline: bool) -> bool:
        return own_pipeline and self.due()

    def follow_asked(self) -> int:
        """Feed the estimate the questions asked since it last looked; the count asked so far."""
        activity = self.parts.activity
        with self.lock:
            asked_total = activity.asked_total
            self._asked_seen = follow(
                self.demand, activity.asked, self._asked_seen, asked_total, self.parts.knowledge, self.parts.embed_question
            )
        return asked_total

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        parts = self.parts
        if not self.due() or not len(parts.knowledge):
            return part
        asked_total = self.follow_asked()
        with self.lock:
            probabilities = self.demand.probabilities(parts.knowledge, limit=PREDICTED_PATHS_CONSIDERED)
        runner = parts.runtime.runner
        evict = not parts.runtime.knowledge_prefill_fits(parts.knowledge.chunks)
        for chunks, probability in predicted_paths(parts, probabilities):
            if not make_room(parts, probabilities, probability if evict else 0.0):
                break
            started = time.perf_counter()
            tokens = runner.prefill_prefix(chunks, should_stop=round.should_stop)
            part.predicted_prefill_seconds += time.perf_counter() - started
            part.predicted_prefill_tokens += tokens
            part.prefill_tokens += tokens
            part.predicted_paths_prefilled += 1
        self._done = asked_total
        return part


class SummariseKnowledge:
    """Step 2: summarise new chunks into the knowledge abstract (it serves prediction only)."""

    name = "abstract"
    own_pipeline_only = False

    def __init__(self, parts: CacheParts, abstract: KnowledgeAbstract, llm: Callable[..., str], chat: Callable[[], Any]):
        self.parts = parts
        self.abstract = abstract
        self._llm = llm
        self._chat_format = chat

    def wants_round(self, own_pipeline: bool) -> bool:
        parts = self.parts
        return parts.config.idle.prediction and len(parts.knowledge) > 0 and bool(self.abstract.pending(parts.knowledge.chunks))

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        if not self.parts.config.idle.prediction:
            return part
        pending = self.abstract.pending(self.parts.knowledge.chunks)
        if not pending:
            return part
        before = len(self.abstract.summarized)
        part.abstract_facts_added += self.abstract.summarise(
            pending,
            self._llm,
            chat_format=self._chat_format(),
            max_batches=self.parts.config.idle.abstract_batches_per_round,
        )
        part.chunks_summarised += len(self.abstract.summarized) - before
        return part


class RefreshStale:
    """Step 3: answer stale entries again (a new chunk now ranks in their top-k); a
    caller's remembered answer never is stale."""

    name = "refresh"
    own_pipeline_only = True

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def wants_round(self, own_pipeline: bool) -> bool:
        config = self.parts.config
        return own_pipeline and config.tiers.qa_bank and any(e.stale for e in self.parts.qa_bank.entries)

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        for entry in [e for e in self.parts.qa_bank.entries if e.stale]:
            part.refreshed += round.answer_again(entry, "refresh", part)
        return part


class AnswerFollowUps:
    """Step 4: questions that were served a similar question's answer get their own, and
    the served answer is checked against it (a calibration label)."""

    name = "follow-ups"
    own_pipeline_only = True

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def wants_round(self, own_pipeline: bool) -> bool:
        parts = self.parts
        return own_pipeline and parts.config.idle.prediction and len(parts.knowledge) > 0 and bool(parts.activity.followups)

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        activity = self.parts.activity
        if not self.parts.config.tiers.qa_bank:
            activity.followups.clear()
            return part
        while activity.followups:
            followup = activity.followups[0]
            item = IdleQuestion(followup.question, followup.embedding, "follow-up", followup.scope)
            result = round.populate(item, part)
            activity.followups.popleft()
            if result.text:
                part.followups_answered += 1
                self._check_served(followup.served, result, part)
        return part

    def _check_served(self, served: Any, result: Any, part: WarmReport) -> None:
        """Label the answer that was served against the model's own *result*."""
        if served.entry.answer is None or served.entry.remembered:
            return
        right = self.parts.answers_agree(served.entry.answer, result.text)
        context = retrieval_context(result.layout.chunk_ids, served.entry.chunk_ids)
        self.parts.calibration.add(Label(served.entry.id, served.similarity, right, "served", True, context))
        part.served_checked += 1
        part.served_wrong += not right


class PredictAndPopulate:
    """Step 5: predict questions from the abstract and from recent user questions (within
    the latest question's scope), and populate them by the strategy (or through the
    caller's own pipeline, *answer*)."""

    name = "predict"
    own_pipeline_only = False

    def __init__(self, parts: CacheParts, abstract: KnowledgeAbstract, predictor: Callable[[], QueryPredictor]) -> None:
        self.parts = parts
        self.abstract = abstract
        self._predictor = predictor
        self.knowledge_rounds: dict[int, int] = {}  # abstract version -> rounds predicted
        # set by the round: questions per step, whether the abstract is used, the caller's pipeline
        self.stride = 0
        self.use_knowledge = True
        self.answer: Callable[[str], bool] | None = None
        self.for_apps: list[str] = []  # predicted questions left for the apps' requests (app_requests.py)

    def wants_round(self, own_pipeline: bool) -> bool:
        parts, config = self.parts, self.parts.config
        if not (config.idle.prediction and len(parts.knowledge)):
            return False
        if parts.activity.new_history:
            return True
        if self.knowledge_rounds.get(self.abstract.version, 0) < config.idle.knowledge_prediction_rounds:
            return True
        entries = parts.qa_bank.entries if config.tiers.qa_bank and own_pipeline else []
        return population_strategy(config) == PREFILL_DECODE and any(e.answer is None for e in entries)

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        parts = self.parts
        if not parts.config.idle.prediction or not len(parts.knowledge) or self.stride <= 0:
            return part
        predicted = self._predict(round, part)
        part.predicted = [p.text for p, _ in predicted]
        if self.answer is not None:
            self._through_caller(round, part, [p for p, _ in predicted])
            return part
        if not round.own_pipeline:  # only apps ask: their requests, not this cache's prompt
            self.for_apps = [p.text for p, _ in predicted]
            return part
        decode = round.strategy == PREFILL_DECODE
        qa_bank = parts.config.tiers.qa_bank
        for prediction, scope in predicted:
            round.tick()
            origin = f"predicted-{prediction.origin}"
            item = IdleQuestion(prediction.text, prediction.embedding, origin, scope, decode=decode)
            result = round.populate(item, part)
            part.populated += 1
            round.bar.set_postfix(populated=part.populated)
            part.pending_stored += qa_bank and not decode
            part.answers_stored += qa_bank and decode and bool(result.text)
        return part

    def _predict(self, round: IdleRound, part: WarmReport) -> list[tuple[PredictedQuestion, dict[str, Any] | None]]:
        activity, predictor = self.parts.activity, self._predictor()
        predicted: list[tuple[PredictedQuestion, dict[str, Any] | None]] = []
        if activity.new_history:
            history, tally = predictor.predict_from_history(list(activity.history), self.stride)
            activity.new_history = 0
            part.history.add(tally)
            predicted += [(p, activity.history_scope) for p in history]
        round.tick()
        if self.use_knowledge:
            version = self.abstract.version
            knowledge, tally = predictor.predict_from_knowledge(self.abstract.lines, self.stride)
            self.knowledge_rounds[version] = self.knowledge_rounds.get(version, 0) + 1
            part.knowledge.add(tally)
            predicted += [(p, None) for p in knowledge]
        return predicted

    def _through_caller(self, round: IdleRound, part: WarmReport, predicted: list[PredictedQuestion]) -> None:
        """Populate *predicted* through the caller's pipeline, as idle work (no activity,
        history or usage counts; a user's question pre-empts its model runs)."""
        assert self.answer is not None
        for prediction in predicted:
            round.tick()
            if round.should_stop():
                raise Preempted("idle round pre-empted between predicted questions")
            with self.parts.activity.background(round.should_stop):
                part.answers_stored += bool(self.answer(prediction.text))
            part.populated += 1
            round.bar.set_postfix(populated=part.populated)


class KnowledgePrefill:
    """Step 6: the [system, chunk] state of every chunk (recently retrieved first, then the
    latest question's scope, then the rest), then [system, chunk, neighbour] pairs, where
    every chunk's first state fits the budget (see :func:`~percache_core.prediction.paths.knowledge_prefill_paths`)."""

    name = "prefill chunks"
    own_pipeline_only = True

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def wants_round(self, own_pipeline: bool) -> bool:
        return own_pipeline and next(knowledge_prefill_paths(self.parts, self.parts.activity.history_scope), None) is not None

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        runner = self.parts.runtime.runner
        for path in knowledge_prefill_paths(self.parts, self.parts.activity.history_scope):
            part.prefill_tokens += runner.prefill_prefix(path, should_stop=round.should_stop)
            part.chunks_prefilled += len(path) == 1
            part.pairs_prefilled += len(path) > 1
        return part


class Convert:
    """Step 7: with the decode strategy, decode pending entries; with room in the
    chunk-state budget, prefill again the paths of answered entries whose states were
    evicted."""

    name = "convert"
    own_pipeline_only = True

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def wants_round(self, own_pipeline: bool) -> bool:
        return False  # its work follows from the other steps'

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        parts = self.parts
        if round.strategy == PREFILL_DECODE and parts.config.tiers.qa_bank:
            for entry in [e for e in parts.qa_bank.entries if e.state == "pending"]:
                part.pending_decoded += round.answer_again(entry, "predicted", part)
        if not parts.config.tiers.chunk_states:
            return part
        runner, tokens = parts.runtime.runner, parts.config.engine.max_new_tokens
        for entry in parts.qa_bank.entries:
            if runner.states.bytes >= PREFILL_BUDGET_SHARE * parts.runtime.state_budget_bytes:
                break
            chunks = [c for c in (parts.knowledge.get_chunk(i) for i in entry.chunk_ids) if c is not None]
            if not chunks or runner.path_is_stored(entry.question, chunks, tokens):
                continue
            layout = runner.lay_out(entry.question, chunks, max_new_tokens=tokens)
            options = RunOptions(max_new_tokens=tokens, decode=False, idle=True)
            result = drain(runner.run(layout, options, should_stop=round.should_stop))
            part.prefill_tokens += result.prefilled_tokens
            part.paths_reprefilled += 1
        return part


class Calibrate:
    """Step 8: buy calibration labels with idle model answers, where an approximate tier
    runs under ``max_error_rate`` (:mod:`percache_core.prediction.calibrating`)."""

    name = "calibrate"
    own_pipeline_only = True

    def __init__(self, work: CalibrationWork) -> None:
        self.work = work

    def wants_round(self, own_pipeline: bool) -> bool:
        return False  # labels ride on rounds the other steps start

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        if not self.work.due():
            return part
        spend = CalibrationSpend()
        started = time.perf_counter()
        try:
            self.work.run(round.should_stop, spend)
        finally:
            part.calibration_answers += spend.answers
            part.calibration_labels += spend.labels
            part.calibration_seconds += time.perf_counter() - started
        return part
