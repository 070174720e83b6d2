"""The demand estimate for chunk states (pure logic, over a small in-memory knowledge)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from percache_core.prediction.demand import HIT_RATE_TOP_N, DemandEstimate
from percache_core.serving.activity import AskedQuestion
from percache_core.types import Chunk


@dataclass
class Found:
    chunk: Chunk
    score: float


class TinyKnowledge:
    """Chunks in two meetings, each with a random unit embedding; retrieval by cosine."""

    def __init__(self, per_meeting: int = 6, seed: int = 0) -> None:
        generator = np.random.default_rng(seed)
        self.chunks = [
            Chunk(f"{meeting}{i}", f"{meeting}{i}", f"text {meeting}{i}", {"meeting": meeting})
            for meeting in ("a", "b")
            for i in range(per_meeting)
        ]
        vectors = generator.normal(size=(len(self.chunks), 8))
        self.vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    def _rows(self, where: Mapping[str, Any] | None) -> list[int]:
        return [i for i, c in enumerate(self.chunks) if not where or all(c.metadata.get(k) == v for k, v in where.items())]

    def retrieve(self, question: str, k: int, *, question_embedding: np.ndarray | None = None,
                 where: Mapping[str, Any] | None = None) -> list[Found]:
        rows = self._rows(where)
        scores = self.vectors[rows] @ question_embedding
        order = np.argsort(-scores)[:k]
        return [Found(self.chunks[rows[i]], float(scores[i])) for i in order]

    def similarities(self, embedding: np.ndarray, *, where: Mapping[str, Any] | None = None):
        rows = self._rows(where)
        return [self.chunks[i] for i in rows], self.vectors[rows] @ embedding

    def neighbours(self, chunk: Chunk, count: int, *, scope_fields: Iterable[str] = ()) -> list[Chunk]:
        row = self.chunks.index(chunk)
        where = {f: chunk.metadata[f] for f in scope_fields}
        return [f.chunk for f in self.retrieve("", count + 1, question_embedding=self.vectors[row], where=where)
                if f.chunk.id != chunk.id][:count]

    def get_chunk(self, chunk_id: str) -> Chunk | None:
        return next((c for c in self.chunks if c.id == chunk_id), None)


def asked_in(knowledge: TinyKnowledge, meeting: str, row: int) -> AskedQuestion:
    """A question near chunk *row*, asked in *meeting*, with the path retrieval gives it."""
    embedding = knowledge.vectors[row]
    scope = {"meeting": meeting}
    path = tuple(f.chunk.id for f in knowledge.retrieve("", 3, question_embedding=embedding, where=scope))
    return AskedQuestion(f"question {row}", embedding, scope, path)


def test_no_question_no_estimate():
    assert DemandEstimate().probabilities(TinyKnowledge()) == {}


def test_the_latest_scope_comes_first_and_its_share_follows_how_often_the_user_stays():
    knowledge = TinyKnowledge()
    estimate = DemandEstimate()
    for row in (0, 1, 2):
        estimate.observe(asked_in(knowledge, "a", row), knowledge)
    assert estimate.stay_rate() == pytest.approx(3 / 4)  # two stays, no move, Laplace prior
    probabilities = estimate.probabilities(knowledge)
    singles = {path[0]: p for path, p in probabilities.items() if len(path) == 1}
    in_a = sum(p for c, p in singles.items() if c.startswith("a"))
    assert in_a == pytest.approx(3 / 4)
    assert sum(singles.values()) == pytest.approx(1.0)
    assert next(iter(probabilities))[0].startswith("a")


def test_pairs_follow_their_first_chunk_and_learn_the_users_second_chunks():
    knowledge = TinyKnowledge()
    estimate = DemandEstimate()
    before = estimate.second_chunk_rate(0)
    for row in (0, 3, 4):  # retrieval's second chunk is the first's nearest neighbour by construction
        estimate.observe(asked_in(knowledge, "a", row), knowledge)
    assert estimate.second_chunk_rate(0) > before
    probabilities = estimate.probabilities(knowledge)
    order = list(probabilities)
    for path, probability in probabilities.items():
        if len(path) == 2:
            assert probability <= probabilities[path[:1]]
            assert order.index(path[:1]) < order.index(path)  # a prefix before its extension


def test_hit_rate_scores_each_question_against_the_estimate_before_it():
    knowledge = TinyKnowledge()
    estimate = DemandEstimate()
    estimate.observe(asked_in(knowledge, "a", 0), knowledge)
    assert estimate.hit_rate.questions == 0  # nothing was estimated before the first question
    estimate.probabilities(knowledge)
    estimate.observe(asked_in(knowledge, "a", 1), knowledge)
    rates = estimate.hit_rate.as_dict()
    assert rates["questions"] == 1 and rates["top_n"] == HIT_RATE_TOP_N
    assert rates["chunk_hit_rate"] == 1.0  # the tiny knowledge is inside the top 50
