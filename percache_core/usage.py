"""Usage counters of one cache: answers per source, tokens, latency, verifier rejections.

The counts of one process are kept here; :meth:`UsageCounters.persisted` adds them to the
record of the processes that closed the folder before (the facade writes it on close), and
:meth:`UsageCounters.summary` reports that record and this process together.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .types import Answer


@dataclass
class _Totals:
    queries: int = 0
    qa_bank_hits: int = 0
    chunk_state_hits: int = 0
    full: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    verifier_rejections: int = 0
    stale_dropped: int = 0
    storage_failures: int = 0
    draft_tokens_accepted: int = 0
    remembered: int = 0
    prompt_answers: int = 0
    approximate: int = 0  # answers that may differ from the cache-off answer
    predicted: int = 0  # answers served from what idle work stored (QA entries, prompt answers)
    idle_state_answers: int = 0  # answers that restored at least one state idle work stored
    idle_reused_chunks: int = 0
    idle_reused_tokens: int = 0
    restored_depth: dict[int, int] = field(default_factory=dict)  # reused chunks -> answers
    latency_s: dict[str, float] = field(
        default_factory=lambda: {"qa_bank": 0.0, "chunk_states": 0.0, "full": 0.0}
    )


def _totals_of(record: Mapping[str, Any] | None) -> _Totals:
    """The totals a persisted *record* holds (an unreadable one: none)."""
    totals = _Totals()
    if not isinstance(record, Mapping):
        return totals
    for f in fields(_Totals):
        value = record.get(f.name)
        if f.name == "restored_depth" and isinstance(value, Mapping):
            totals.restored_depth = {int(k): int(v) for k, v in value.items()}
        elif f.name == "latency_s" and isinstance(value, Mapping):
            totals.latency_s.update({str(k): float(v) for k, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(totals, f.name, type(getattr(totals, f.name))(value))
    return totals


def _added(a: _Totals, b: _Totals) -> _Totals:
    """The totals of *a* and *b* together, field by field."""
    out = _Totals()
    for f in fields(_Totals):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict):
            setattr(out, f.name, {k: x.get(k, 0) + y.get(k, 0) for k in {*x, *y}})
        else:
            setattr(out, f.name, x + y)
    return out


class UsageCounters:
    """Thread-safe counts of what the cache answered and how.

    >>> usage = UsageCounters()
    >>> usage.record(Answer(text="Friday.", source="qa_bank", question="When?", latency_s=0.01))
    >>> usage.summary()["qa_bank_hit_rate"]
    1.0
    """

    def __init__(self) -> None:
        self._totals = _Totals()
        self._lock = threading.Lock()

    def record(self, answer: Answer) -> None:
        """Count one finished answer."""
        with self._lock:
            totals = self._totals
            totals.queries += 1
            source = "qa_bank" if answer.answered_before else answer.source  # a stored answer
            totals.remembered += answer.source == "remembered"
            totals.prompt_answers += answer.source == "prompt_answer"
            totals.approximate += answer.approximate
            if source == "qa_bank":
                totals.qa_bank_hits += 1
            elif answer.source == "chunk_states":
                totals.chunk_state_hits += 1
            else:
                totals.full += 1
            totals.reused_tokens += answer.reused_tokens
            totals.prefilled_tokens += answer.prefilled_tokens
            totals.generated_tokens += answer.generated_tokens
            totals.draft_tokens_accepted += answer.draft_tokens_accepted
            totals.predicted += answer.predicted
            totals.idle_state_answers += answer.idle_reused_chunks > 0
            totals.idle_reused_chunks += answer.idle_reused_chunks
            totals.idle_reused_tokens += answer.idle_reused_tokens
            if source != "qa_bank":
                depth = totals.restored_depth
                depth[answer.reused_chunks] = depth.get(answer.reused_chunks, 0) + 1
            totals.latency_s[source] += answer.latency_s

    def count_rejection(self) -> None:
        """Count a QA-bank candidate the verifier rejected."""
        with self._lock:
            self._totals.verifier_rejections += 1

    def count_stale_drop(self) -> None:
        """Count a QA entry dropped because its sources changed (semantic mode)."""
        with self._lock:
            self._totals.stale_dropped += 1

    def count_storage_failure(self) -> None:
        """Count an answer that was returned but could not be stored (disk full, ...)."""
        with self._lock:
            self._totals.storage_failures += 1

    def persisted(self, earlier: Mapping[str, Any] | None) -> dict[str, Any]:
        """The record of *earlier* processes' counts with this process's added (JSON).

        >>> usage = UsageCounters()
        >>> usage.record(Answer(text="Friday.", source="full", question="When?"))
        >>> usage.persisted(usage.persisted(None))["queries"]
        2
        """
        with self._lock:
            totals = _added(_totals_of(earlier), self._totals)
        record = asdict(totals)
        record["restored_depth"] = {str(k): v for k, v in totals.restored_depth.items()}
        return record

    def summary(self, earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Counts, hit rates and mean latency per source: of this process, with the
        counts of the *earlier* processes' record added (see :meth:`persisted`)."""
        with self._lock:
            c = _added(_totals_of(earlier), self._totals) if earlier else self._totals
            queries = max(1, c.queries)
            return {
                "queries": c.queries,
                "qa_bank_hits": c.qa_bank_hits,  # every answer stored before, the two below included
                "remembered": c.remembered,
                "prompt_answers": c.prompt_answers,
                "approximate_answers": c.approximate,
                "approximate_share": c.approximate / queries,
                "chunk_state_hits": c.chunk_state_hits,
                "full": c.full,
                "qa_bank_hit_rate": c.qa_bank_hits / queries,
                "chunk_state_hit_rate": c.chunk_state_hits / queries,
                "reused_tokens": c.reused_tokens,
                "prefilled_tokens": c.prefilled_tokens,
                "generated_tokens": c.generated_tokens,
                "verifier_rejections": c.verifier_rejections,
                "stale_dropped": c.stale_dropped,
                "storage_failures": c.storage_failures,
                "draft_tokens_accepted": c.draft_tokens_accepted,
                "served_from_prediction": {
                    "answers": c.predicted,
                    "answers_restoring_idle_states": c.idle_state_answers,
                    "idle_chunks_restored": c.idle_reused_chunks,
                    "idle_tokens_restored": c.idle_reused_tokens,
                    "restored_depth": {str(k): v for k, v in sorted(c.restored_depth.items())},
                },
                "mean_latency_s": {
                    source: total / max(1, count)
                    for (source, total), count in zip(
                        c.latency_s.items(), (c.qa_bank_hits, c.chunk_state_hits, c.full)
                    )
                },
            }
