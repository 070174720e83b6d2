"""The parts of one cache, as the request path, the scheduler and the idle worker see them.

:class:`~percache_core.pipeline.PerCache` builds a ``CacheParts`` and hands it to each of
them; none of them sees the facade. ``config`` is the one current configuration:
``PerCache.configure`` replaces it here, and every part reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import PerCacheConfig
from .knowledge.bank import KnowledgeBank
from .knowledge.embedding import Embedder
from .prediction.activity import UserActivity
from .qa.bank import QABank
from .qa.binding import answer_binding
from .qa.prompt_answers import PromptAnswers
from .runtime import ModelRuntime
from .storage import Store
from .usage import UsageCounters


@dataclass
class CacheParts:
    """Everything a cache is made of, wired once at open."""

    config: PerCacheConfig
    embedder: Embedder
    knowledge: KnowledgeBank
    qa_bank: QABank
    prompt_answers: PromptAnswers  # whole prompts answered before (beside the QA bank)
    runtime: ModelRuntime
    activity: UserActivity
    usage: UsageCounters
    meta: Store  # small records: the embedder's name, the knowledge abstract

    def binding(self, *, top_k: int | None = None, max_new_tokens: int | None = None) -> str:
        """The binding of answers the cache's own pipeline gives with these settings (see
        :func:`~percache_core.qa.binding.answer_binding`)."""
        config = self.config
        return answer_binding(
            config,
            self.runtime.model_id(),
            top_k=top_k or config.top_k,
            max_new_tokens=max_new_tokens or config.max_new_tokens,
        )
