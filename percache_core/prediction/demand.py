"""Demand for chunk states: how likely the next question's prompt starts with each
[system, chunk, ...] path, learned from what the user asked.

Idle time can prefill only a few of a large knowledge's paths (20 s of prefill makes 30-90
states of 220-token chunks on a laptop CPU; 2 GiB holds about 520 of the bundled model's),
so it prefills the paths the next question is likeliest to restore, and evicts the least
likely. The
estimate is a probability per path prefix (the share of next questions whose retrieved
path starts with it), built from three parts, each updated after every question:

- **where the next question is asked**: in the latest question's scope with the rate at
  which this user's questions stayed in their scope (counted, with a uniform prior); else in
  another scope: half in proportion to how near its chunks are to the recent questions
  (unscoped retrieval of each, newer questions weighing more), half by how near it sits to
  the latest scope in the knowledge's order (documents added together, such as a thread, a
  meeting series or a folder, are asked about together; halving per scope away);
- **which chunk its prompt starts with**, within a scope: half uniform over the scope's
  chunks, half by similarity to the latest question (a softmax over their cosines);
- **which chunk comes second**: one of the first chunk's retrieval neighbours
  (``KnowledgeBank.neighbours``), rank *r* with the share of this user's paths whose
  second chunk was the first's *r*-th neighbour (counted, with a prior that halves per
  rank).

Expected saving per idle second and per byte are both proportional to this probability
(a node's prefill and its bytes grow with the tokens it saves when used), so idle work
takes paths in its order, and eviction gives up the least likely first.

>>> estimate = DemandEstimate()
>>> round(estimate.stay_rate(), 2)  # no question yet: as likely to stay as to move
0.5
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from ..serving.activity import AskedQuestion
from ..types import Chunk

Path = tuple[str, ...]

FIRST_CHUNK_UNIFORM_SHARE = 0.5  # the rest follows similarity to the latest question
SIMILARITY_TEMPERATURE = 0.05  # of the softmax over cosine similarities
NEIGHBOUR_RANKS = 8  # second chunks considered per first chunk
NEIGHBOUR_PRIOR_WEIGHT = 4.0  # in questions: the user's own paths outweigh it after a few
SCOPE_PROBE_CHUNKS = 50  # chunks an unscoped retrieval of a recent question looks at
SCOPES_CONSIDERED = 8  # other scopes the next question may be asked in
ADJACENT_SCOPES = 4  # scopes either side of the latest one in knowledge order
ADJACENT_SHARE = 0.5  # of the other scopes' probability; the rest by retrieval (flat 0.25-0.75)
PAIR_FIRST_CHUNKS = 64  # first chunks whose pairs are estimated (the likeliest)
RECENT_QUESTIONS = 8  # questions whose retrieval points at other scopes
HIT_RATE_TOP_N = 50  # chunks of the estimate a next question's chunks are looked for in


class Knowledge(Protocol):
    """What the estimate reads of the knowledge (``KnowledgeBank`` has it)."""

    def retrieve(self, question: str, k: int, *, question_embedding: np.ndarray | None = None,
                 where: Mapping[str, Any] | None = None) -> list[Any]: ...

    def similarities(self, embedding: np.ndarray, *, where: Mapping[str, Any] | None = None
                     ) -> tuple[list[Chunk], np.ndarray]: ...

    def neighbours(self, chunk: Chunk, count: int, *, scope_fields: Iterable[str] = ()) -> list[Chunk]: ...

    def get_chunk(self, chunk_id: str) -> Chunk | None: ...

    @property
    def chunks(self) -> list[Chunk]: ...


@dataclass
class HitRate:
    """How well the estimate named the next questions' chunks: of each question's chunks,
    the share among the estimate's top :data:`HIT_RATE_TOP_N` chunks as it stood before
    the question came (the oracle, which knows the question, scores 1)."""

    questions: int = 0
    chunks: int = 0
    chunks_hit: int = 0
    first_chunks_hit: int = 0

    def add(self, chunk_ids: Sequence[str], top: set[str]) -> None:
        self.questions += 1
        self.chunks += len(chunk_ids)
        self.chunks_hit += sum(c in top for c in chunk_ids)
        self.first_chunks_hit += bool(chunk_ids) and chunk_ids[0] in top

    def as_dict(self) -> dict[str, Any]:
        return {
            "questions": self.questions,
            "top_n": HIT_RATE_TOP_N,
            "chunk_hit_rate": self.chunks_hit / self.chunks if self.chunks else None,
            "first_chunk_hit_rate": self.first_chunks_hit / self.questions if self.questions else None,
        }


@dataclass
class DemandEstimate:
    """The probability that the next question's path starts with each prefix (see the
    module docstring). Feed it the questions as they come (:meth:`observe`); ask it for
    :meth:`probabilities` when idle time can prefill."""

    asked: deque[AskedQuestion] = field(default_factory=lambda: deque(maxlen=32))
    stays: int = 0
    moves: int = 0
    neighbour_ranks: Counter[int] = field(default_factory=Counter)  # rank (NEIGHBOUR_RANKS: none) -> paths
    hit_rate: HitRate = field(default_factory=HitRate)
    _top_chunks: set[str] | None = None
    _scope_order_key: tuple | None = None
    _scope_order_list: list[tuple] = field(default_factory=list)
    _scope_values: dict[tuple, tuple] = field(default_factory=dict)

    def observe(self, question: AskedQuestion, knowledge: Knowledge) -> None:
        """Learn from one more question (and score the estimate that came before it)."""
        if self._top_chunks is not None and question.chunk_ids:
            self.hit_rate.add(question.chunk_ids, self._top_chunks)
        if self.asked:
            if question.scope == self.asked[-1].scope:
                self.stays += 1
            else:
                self.moves += 1
        path = question.chunk_ids
        if len(path) > 1:
            first = knowledge.get_chunk(path[0])
            if first is not None:
                near = [c.id for c in knowledge.neighbours(first, NEIGHBOUR_RANKS, scope_fields=list(question.scope or {}))]
                self.neighbour_ranks[near.index(path[1]) if path[1] in near else NEIGHBOUR_RANKS] += 1
        self.asked.append(question)

    def stay_rate(self) -> float:
        """The share of this user's questions asked in the scope of the one before
        (Laplace-smoothed)."""
        return (self.stays + 1) / (self.stays + self.moves + 2)

    def second_chunk_rate(self, rank: int) -> float:
        """The share of paths whose second chunk is the first's *rank*-th neighbour."""
        prior = 0.5 ** (rank + 1)
        total = sum(self.neighbour_ranks.values())
        return (self.neighbour_ranks[rank] + NEIGHBOUR_PRIOR_WEIGHT * prior) / (total + NEIGHBOUR_PRIOR_WEIGHT)

    def scope_probabilities(self, knowledge: Knowledge) -> list[tuple[dict[str, Any] | None, float]]:
        """Where the next question is asked: (scope, probability), likeliest first."""
        if not self.asked:
            return []
        latest = self.asked[-1].scope
        if not latest:
            return [(None, 1.0)]
        fields = sorted(latest)
        weights: dict[tuple, float] = {}
        scopes: dict[tuple, dict[str, Any]] = {}
        for age, question in enumerate(list(self.asked)[::-1][:RECENT_QUESTIONS]):
            ranked = knowledge.retrieve(
                question.text, SCOPE_PROBE_CHUNKS, question_embedding=question.embedding
            )
            for rank, found in enumerate(ranked):
                metadata = found.chunk.metadata
                if not all(name in metadata for name in fields):
                    continue
                key = tuple(repr(metadata[name]) for name in fields)
                scopes.setdefault(key, {name: metadata[name] for name in fields})
                weights[key] = weights.get(key, 0.0) + 0.5**age / (rank + 10)
        latest_key = tuple(repr(latest[name]) for name in fields)
        weights.pop(latest_key, None)
        near = _normalised(weights)
        order = self._scope_order(knowledge, fields)
        adjacent: dict[tuple, float] = {}
        if latest_key in order:
            place = order.index(latest_key)
            for step in range(1, ADJACENT_SCOPES + 1):
                for other in (place - step, place + step):
                    if 0 <= other < len(order):
                        adjacent[order[other]] = 0.5**step
                        scopes.setdefault(order[other], dict(zip(fields, self._scope_values[order[other]])))
        adjacent = _normalised(adjacent)
        weights = {
            key: (1 - ADJACENT_SHARE) * near.get(key, 0.0) + ADJACENT_SHARE * adjacent.get(key, 0.0)
            for key in {*near, *adjacent}
        }
        stay = self.stay_rate()
        others = sorted(weights, key=lambda key: (-weights[key], key))[:SCOPES_CONSIDERED]
        total = sum(weights[key] for key in others)
        result: list[tuple[dict[str, Any] | None, float]] = [(dict(latest), stay if others else 1.0)]
        result += [(scopes[key], (1 - stay) * weights[key] / total) for key in others]
        return result

    def _scope_order(self, knowledge: Knowledge, fields: list[str]) -> list[tuple]:
        """The scopes (values of *fields*) in the order the knowledge first holds them
        (documents added together sit together: a thread, a meeting series, a folder);
        remembered while the knowledge keeps its size."""
        chunks = knowledge.chunks
        key = (len(chunks), tuple(fields))
        if self._scope_order_key != key:
            order: dict[tuple, None] = {}
            for chunk in chunks:
                if all(name in chunk.metadata for name in fields):
                    scope = tuple(repr(chunk.metadata[name]) for name in fields)
                    if scope not in order:
                        order[scope] = None
                        self._scope_values[scope] = tuple(chunk.metadata[name] for name in fields)
            self._scope_order_list, self._scope_order_key = list(order), key
        return self._scope_order_list

    def probabilities(self, knowledge: Knowledge, *, limit: int | None = None) -> dict[Path, float]:
        """Each candidate path prefix (chunk ids) and the probability that the next
        question's path starts with it, likeliest first (a prefix always before its
        extensions); at most *limit* of them."""
        first: dict[str, float] = {}
        chunks: dict[str, Chunk] = {}
        latest = self.asked[-1].embedding if self.asked else None
        scope_fields = sorted(self.asked[-1].scope or {}) if self.asked else []  # every scope considered has these
        for scope, chance in self.scope_probabilities(knowledge):
            in_scope, cosines = knowledge.similarities(latest, where=scope)
            if not in_scope:
                continue
            tilt = np.exp((cosines - cosines.max()) / SIMILARITY_TEMPERATURE)
            tilt /= tilt.sum()
            uniform = FIRST_CHUNK_UNIFORM_SHARE / len(in_scope)
            for chunk, share in zip(in_scope, tilt.tolist()):
                first[chunk.id] = first.get(chunk.id, 0.0) + chance * (uniform + (1 - FIRST_CHUNK_UNIFORM_SHARE) * share)
                chunks[chunk.id] = chunk
        ranked = sorted(first, key=lambda c: -first[c])
        self._top_chunks = set(ranked[:HIT_RATE_TOP_N])
        paths: dict[Path, float] = {(c,): first[c] for c in ranked}
        for chunk_id in ranked[:PAIR_FIRST_CHUNKS]:
            near = knowledge.neighbours(chunks[chunk_id], NEIGHBOUR_RANKS, scope_fields=scope_fields)
            for rank, second in enumerate(near):
                paths[(chunk_id, second.id)] = first[chunk_id] * self.second_chunk_rate(rank)
        ordered = sorted(paths, key=lambda path: (-paths[path], len(path)))
        return {path: paths[path] for path in ordered[:limit]}


def follow(estimate: DemandEstimate, asked: Sequence[AskedQuestion], seen: int, total: int,
           knowledge: Knowledge, embed: Callable[[str], np.ndarray]) -> int:
    """Feed *estimate* the questions of *asked* (the newest *total* - *seen* of them, as
    many as it still holds) that it has not seen, embedding those a repeat left without
    one (*embed*); the new count seen."""
    new = min(total - seen, len(asked))
    for question in list(asked)[len(asked) - new:]:
        if question.embedding is None:
            question = replace(question, embedding=embed(question.text))
        estimate.observe(question, knowledge)
    return total


def _normalised(weights: Mapping[Any, float]) -> dict[Any, float]:
    total = sum(weights.values())
    return {key: value / total for key, value in weights.items()} if total else {}
