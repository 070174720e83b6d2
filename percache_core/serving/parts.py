"""The parts of one cache, as the request path, the scheduler and the idle worker see them.

:class:`~percache_core.pipeline.PerCache` builds a ``CacheParts`` and hands it to each of
them; none of them sees the facade. ``config`` is the one current configuration:
``PerCache.configure`` replaces it here and hands it to the parts that keep settings of
their own (the runtime and its runner, the knowledge bank's chunking and fusion, the QA
bank's budgets, the scheduler's abstract and predictor).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..config import PerCacheConfig
from ..knowledge.bank import KnowledgeBank
from ..knowledge.embedding import Embedder
from ..qa.bank import QABank
from ..qa.calibration import Calibration, equivalent
from ..qa.prompt_answers import PromptAnswers
from ..storage import Store
from ..usage import UsageCounters
from .activity import UserActivity
from .binding import answer_binding
from .runtime import ModelRuntime

QUESTION_EMBEDDINGS_KEPT = 64


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
    meta: Store  # small records: the embedder's name, the knowledge abstract, calibration labels
    calibration: Calibration  # how often approximate answers are wrong (qa/calibration.py)
    _question_embeddings: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict, repr=False)
    _embedding_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def embed_question(self, question: str) -> np.ndarray:
        """*question*'s embedding, computed once for the last ``QUESTION_EMBEDDINGS_KEPT``
        questions: a caller's lookup and its remember of the same question (and every other
        step of one request) embed it once."""
        with self._embedding_lock:
            vector = self._question_embeddings.get(question)
            if vector is not None:
                self._question_embeddings.move_to_end(question)
                return vector
        vector = self.embedder.embed([question])[0]
        vector.setflags(write=False)  # shared by the steps of a request
        with self._embedding_lock:
            self._question_embeddings[question] = vector
            while len(self._question_embeddings) > QUESTION_EMBEDDINGS_KEPT:
                self._question_embeddings.popitem(last=False)
        return vector

    def answers_agree(self, answer: str, own: str) -> bool:
        """Whether an approximate *answer* counts as right against the model's *own*
        answer to the question's prompt (``config.answer_equivalence``)."""
        config = self.config
        return equivalent(answer, own, equivalence=config.answer_equivalence, min_f1=config.equivalence_min_f1)

    def binding(self, *, top_k: int | None = None, max_new_tokens: int | None = None) -> str:
        """The binding of answers the cache's own pipeline gives with these settings (see
        :func:`~percache_core.serving.binding.answer_binding`)."""
        config = self.config
        return answer_binding(
            config,
            self.runtime.model_id(),
            top_k=top_k or config.top_k,
            max_new_tokens=max_new_tokens or config.max_new_tokens,
        )
