"""The parts of one cache, as the request path, the scheduler and the idle worker see them.

:class:`~percache_core.pipeline.PerCache` builds a ``CacheParts`` and hands it to each of
them; none of them sees the facade. ``live`` holds the one current configuration:
``PerCache.configure`` replaces it there, and every part (these and the runtime, the
runner, the knowledge bank's chunking and fusion, the QA bank's budgets, the abstract)
reads the section it needs from it when it needs it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..config import LiveConfig, PerCacheConfig
from ..knowledge.bank import KnowledgeBank
from ..knowledge.embedding import Embedder
from ..policies import AnswerPolicy, StatePolicy, answer_policy, state_policy
from ..qa.bank import QABank
from ..qa.calibration import Calibration, equivalent
from ..qa.prompt_answers import PromptAnswers
from ..serving.activity import MAX_HISTORY_CHARS, UserActivity
from ..serving.binding import answer_binding
from ..serving.shapes import RequestShapes
from ..storage import Store
from ..usage import UsageCounters
from .runtime import ModelRuntime

QUESTION_EMBEDDINGS_KEPT = 64


@dataclass
class CacheParts:
    """Everything a cache is made of, wired once at open."""

    live: LiveConfig  # the configuration in force (PerCache.configure replaces it)
    embedder: Embedder
    knowledge: KnowledgeBank
    qa_bank: QABank
    prompt_answers: PromptAnswers  # whole prompts answered before (beside the QA bank)
    runtime: ModelRuntime
    activity: UserActivity
    usage: UsageCounters
    meta: Store  # small records: the embedder's name, the knowledge abstract, calibration labels
    calibration: Calibration  # how often approximate answers are wrong (qa/calibration.py)
    shapes: RequestShapes  # the shapes of the requests apps bring (serving/shapes.py)
    answers: AnswerPolicy = field(init=False)  # how stored answers may be served
    states: StatePolicy = field(init=False)  # how chunk states may be reused
    _question_embeddings: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict, repr=False)
    _embedding_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.reconfigure(self.live.current)

    @property
    def config(self) -> PerCacheConfig:
        """The configuration in force now."""
        return self.live.current

    def reconfigure(self, config: PerCacheConfig) -> None:
        """Put *config* in force: every part reads its sections from ``live``, and the
        reuse policies are chosen again (once, here)."""
        self.live.current = config
        self.answers = answer_policy(config, self.qa_bank, self.calibration, self.usage)
        self.states = state_policy(config)

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

    def embed_key(self, key: str) -> np.ndarray:
        """The embedding a caller's key is stored and looked up with: its
        :meth:`embed_question`, or for a text longer than any question a person types (a
        whole prompt used as a key, ``MAX_HISTORY_CHARS``) zeros: such a key is found by
        its exact text only, never as similar to another (embedding a prompt cost 0.11 s
        a lookup, measured, and says nothing of the question it asks)."""
        if len(key) <= MAX_HISTORY_CHARS:
            return self.embed_question(key)
        return np.zeros(self.embedder.dimension, dtype=np.float32)

    def answers_agree(self, answer: str, own: str) -> bool:
        """Whether an approximate *answer* counts as right against the model's *own*
        answer to the question's prompt (``config.bound.answer_equivalence``)."""
        config = self.config
        return equivalent(answer, own, equivalence=config.bound.answer_equivalence, min_f1=config.bound.equivalence_min_f1)

    def binding(self, *, top_k: int | None = None, max_new_tokens: int | None = None) -> str:
        """The binding of answers the cache's own pipeline gives with these settings (see
        :func:`~percache_core.serving.binding.answer_binding`)."""
        config = self.config
        return answer_binding(
            config,
            self.runtime.model_id(),
            top_k=top_k or config.retrieval.top_k,
            max_new_tokens=max_new_tokens or config.engine.max_new_tokens,
        )
