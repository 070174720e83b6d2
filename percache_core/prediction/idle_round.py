"""One idle round: its report, the accounts rounds add up to, and the context its steps
run in.

A round is a list of steps (:mod:`percache_core.prediction.idle_steps`). Each step is
handed a fresh :class:`WarmReport` part, fills in what it did and returns it;
:func:`run_steps` adds every part into the round's report, field by field, and a part a
step left when it was pre-empted counts too. :class:`IdleAccount` sums a round's report
over its fields into the totals per population strategy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ..answering.parts import CacheParts
from ..answering.request import IdleQuestion
from ..answering.request_path import RequestPath
from ..config import PerCacheConfig
from ..errors import Preempted
from ..serving.state_runner import RunResult
from ..types import QAEntry
from .predictor import PredictionTally

PREFILL_ONLY = "prefill_only"
PREFILL_DECODE = "prefill_decode"


class OutOfTime(Exception):
    """The round's time budget is spent (checked between steps and between questions)."""


@dataclass(frozen=True)
class WarmOptions:
    """How one idle round runs (``PerCache.warm``'s keywords): *max_seconds* (it stops
    after this long), *max_predictions* (questions predicted per view; None:
    ``prediction_stride``), *knowledge_prediction* (also from the knowledge abstract),
    *progress* (a progress bar), *should_stop* (asked between segments and tokens) and
    *answer* (question -> whether the app's own pipeline stored an answer to it).

    >>> WarmOptions(max_seconds=20).progress
    True
    """

    max_seconds: float | None = None
    max_predictions: int | None = None
    knowledge_prediction: bool = True
    progress: bool = True
    should_stop: Callable[[], bool] | None = None
    answer: Callable[[str], bool] | None = None


@dataclass
class WarmReport:
    """What one idle round (or one of its steps) did."""

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
    passages_added: int = 0  # chunks apps retrieved, added to the knowledge (pc.caller.record_passages)
    agreement_checks: int = 0  # apps' requests rebuilt from their question (serving/shapes.py)
    app_states_prefilled: int = 0  # leading states of the apps' requests over the knowledge
    app_requests_run: int = 0  # predicted questions run as the apps' requests
    app_answers_stored: int = 0  # of those, decoded (their answers stored for the identical request)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: bool = False
    out_of_time: bool = False
    # what the user's questions since the previous round were served from idle work's
    # results (see ``stats()["served_from_prediction"]``)
    served_from_prediction: dict[str, Any] = field(default_factory=dict)

    def add(self, part: WarmReport) -> None:
        """Add a step's *part* into this report: numbers summed, lists joined, tallies
        added, flags or-ed, field by field.

        >>> report, part = WarmReport("prefill_only"), WarmReport("prefill_only", refreshed=2)
        >>> report.add(part); report.add(part); report.refreshed
        4
        """
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(part, f.name)
            if f.name == "strategy" or isinstance(mine, dict):
                continue
            if isinstance(mine, PredictionTally):
                mine.add(theirs)
            else:
                setattr(self, f.name, (mine or theirs) if isinstance(mine, bool) else mine + theirs)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class IdleAccount:
    """Idle compute spent under one strategy: the sum of its rounds' reports."""

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

    def add_round(self, report: WarmReport) -> None:
        """Add one round's *report*: every field of the same name, and the round itself,
        its LLM calls and its predicted and populated questions.

        >>> account = IdleAccount()
        >>> account.add_round(WarmReport("prefill_only", prefill_tokens=5, populated=2))
        >>> account.rounds, account.prefill_tokens, account.questions_populated
        (1, 5, 2)
        """
        derived = {
            "rounds": 1,
            "llm_calls": report.knowledge.llm_calls + report.history.llm_calls,
            "questions_predicted": len(report.predicted),
            "questions_populated": report.populated,
        }
        for f in dataclasses.fields(self):
            added = derived[f.name] if f.name in derived else getattr(report, f.name)
            setattr(self, f.name, getattr(self, f.name) + added)


def population_strategy(config: PerCacheConfig, threshold: float | None = None) -> str:
    """``prefill_only`` when tau is above the cutoff (hits need very close questions, so
    answers are rarely reused), else ``prefill_decode``. A tier that is off forces the
    strategy that still fills the other.

    >>> population_strategy(PerCacheConfig(similarity_threshold=0.95, strategy_cutoff=0.9))
    'prefill_only'
    """
    if not config.tiers.chunk_states:
        return PREFILL_DECODE
    if not config.tiers.qa_bank:
        return PREFILL_ONLY
    tau = config.tiers.similarity_threshold if threshold is None else threshold
    return PREFILL_ONLY if tau > config.idle.strategy_cutoff else PREFILL_DECODE


@dataclass
class IdleRound:
    """What the steps of one round share: the cache's parts, the request path that runs
    its own prompt, the pre-emption check, the deadline, the progress bar and the step
    part now being filled in (free-form LLM calls are accounted in it)."""

    parts: CacheParts
    request_path: RequestPath
    should_stop: Callable[[], bool]
    deadline: float | None
    bar: Any
    strategy: str
    own_pipeline: bool = True
    part: WarmReport | None = None

    @property
    def config(self) -> PerCacheConfig:
        return self.parts.config

    def tick(self) -> None:
        """Stop the round when its time budget is spent."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OutOfTime("time budget spent")

    def populate(self, item: IdleQuestion, part: WarmReport) -> RunResult:
        """Run this cache's own prompt for *item* through the request path (see
        ``RequestPath.populate``), accounted in *part*."""
        result = self.request_path.populate(item, self.should_stop)
        part.prefill_tokens += result.prefilled_tokens
        part.decode_tokens += result.generated_tokens
        return result

    def answer_again(self, entry: QAEntry, default_origin: str, part: WarmReport) -> bool:
        """Answer a stale or pending entry's question anew and put the answer in its
        place; whether there was one."""
        origin = entry.origin or default_origin
        result = self.populate(IdleQuestion(entry.question, entry.embedding, origin, entry.scope, replacing=entry), part)
        return bool(result.text)


class IdleStep(Protocol):
    """One step of an idle round."""

    name: str
    own_pipeline_only: bool  # it runs this cache's own prompt (left out for a caller's pipeline)

    def wants_round(self, own_pipeline: bool) -> bool:
        """Whether this step alone makes a round worth starting now."""
        ...

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        """Do the step's work, filling in *part*; return it."""
        ...


def run_steps(round: IdleRound, steps: Sequence[IdleStep], report: WarmReport) -> None:
    """Run *steps* in order, each on a fresh part of *report* that is added to it when
    the step ends (pre-empted or not). Raises :class:`Preempted` when a user waits before
    a step, :class:`OutOfTime` when the budget is spent."""
    for step in steps:
        if step.own_pipeline_only and not round.own_pipeline:
            continue
        if round.should_stop():
            raise Preempted(f"idle round pre-empted before {step.name}")
        round.tick()
        round.bar.set_description(f"idle: {step.name}")
        round.part = WarmReport(report.strategy)
        try:
            step.run(round, round.part)
        finally:
            report.add(round.part)
            round.part = None
        round.bar.update(1)
