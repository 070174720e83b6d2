"""The parts behind one :class:`~percache_core.pipeline.PerCache`, for tests, benchmarks
and tools that measure them.

``PerCache`` shows the user's verbs only. Reading its parts is for measuring (how many
states the tree holds, which entries the QA bank keeps); writing through them skips what
the verbs promise. For example ``internals(pc).knowledge.delete_documents`` leaves the QA
entries, prompt answers and chunk states made from the deleted text, which
``pc.delete_documents`` removes.

>>> from percache_core.inspection import internals
>>> parts = internals(pc)          # doctest: +SKIP
>>> len(parts.tree), len(parts.qa_bank)   # doctest: +SKIP
(41, 12)
"""

from __future__ import annotations

from dataclasses import dataclass

from .answering.parts import CacheParts
from .answering.request_path import RequestPath
from .answering.runtime import ModelRuntime
from .knowledge.bank import KnowledgeBank
from .kv.engine import Engine
from .kv.tiers import TieredStateStore
from .kv.tree import ChunkStateTree
from .pipeline import PerCache
from .prediction.scheduler import Scheduler
from .qa.bank import QABank
from .qa.prompt_answers import PromptAnswers
from .serving.activity import UserActivity
from .serving.state_runner import StateRunner
from .shared.redis_tier import SharedTier
from .usage import UsageCounters


@dataclass(frozen=True)
class CacheInternals:
    """A read view of one cache's parts (see the module docstring)."""

    parts: CacheParts
    request_path: RequestPath
    scheduler: Scheduler
    shared: SharedTier | None

    @property
    def knowledge(self) -> KnowledgeBank:
        return self.parts.knowledge

    @property
    def qa_bank(self) -> QABank:
        return self.parts.qa_bank

    @property
    def prompt_answers(self) -> PromptAnswers:
        return self.parts.prompt_answers

    @property
    def runtime(self) -> ModelRuntime:
        return self.parts.runtime

    @property
    def activity(self) -> UserActivity:
        return self.parts.activity

    @property
    def usage(self) -> UsageCounters:
        return self.parts.usage

    @property
    def engine(self) -> Engine:
        """The engine, loaded on first use."""
        return self.parts.runtime.engine

    @property
    def states(self) -> TieredStateStore:
        """The stored chunk states of this engine's fingerprint (local, shared behind)."""
        return self.parts.runtime.states

    @property
    def tree(self) -> ChunkStateTree:
        """Which prompt prefixes have a stored state locally."""
        return self.parts.runtime.tree

    @property
    def runner(self) -> StateRunner:
        return self.parts.runtime.runner

    @property
    def last_activity(self) -> float:
        """``time.monotonic()`` of the last user activity."""
        return self.parts.activity.last_activity


def internals(cache: PerCache) -> CacheInternals:
    """The parts behind *cache* (see the module docstring)."""
    if not isinstance(cache, PerCache):
        raise TypeError(f"internals() takes a PerCache, got {type(cache).__name__}")
    return CacheInternals(cache._parts, cache._request_path, cache._scheduler, cache._shared)
