"""Idle work in the apps' own requests: the steps of an idle round that fill what an app
that brings its own prompt will restore (:mod:`percache_core.serving.shapes` learns the
shapes of its requests).

- :class:`AppPassages`: the passages the apps retrieved (``pc.caller.record_passages``)
  embedded into the knowledge, off the answers' path;
- :class:`AppLeadingStates`: first the agreement checks of the requests the app sent, then
  the leading states of the app's requests over the knowledge: [prefix + passage], first
  for the chunks the app quoted lately and their nearest neighbours, then for every other
  chunk, then for shapes of several passages [prefix + passage + separator + neighbour]
  (the hot chunks' first, then by rank: every chunk's nearest before any chunk's second),
  the neighbours ranked as the app ranks, learned: hybrid retrieval or the embeddings alone,
  whichever rebuilt more of its requests exactly, else put more of its second passages
  among their first's neighbours (measured against running the predicted requests before the other
  chunks: 1.097x against 0.917x the app before the swap on a SQuAD user, see
  docs/evaluation.md);
- :class:`AppPredictedRequests`: the round's predicted questions built into requests as the
  app sends them (its own retriever's passages where PerCache holds it, else PerCache's
  retrieval) and run as the app's request runs: decoded, so that the app's identical
  request is answered from its stored answer, where the shape's agreement says the app
  sends exactly such requests (and the app's requests are not relayed to a llama-server,
  whose replies are stored under the client's body); else prefilled through their last
  passage (their leading states).

Both run where apps bring their own prompts (the first also where a round hands predicted
questions to the app's own pipeline, ``warm(answer=...)``, which then runs them), and never
change what a request gets: a rendered prompt runs as any caller's prompt does.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..answering.parts import CacheParts
from ..answering.request_path import RequestPath
from ..errors import Preempted
from ..kv.budget import PREFILL_BUDGET_SHARE
from ..kv.engine import Decoding
from ..serving.prompting import TextPrompt
from ..serving.shapes import APP, DENSE, HYBRID, RequestShape, Retrieve, decoding_from
from ..serving.streaming import drain
from ..types import Chunk
from .idle_round import IdleRound, WarmReport
from .idle_steps import PredictAndPopulate
from .invalidation import Invalidation

AGREEMENT_TO_ANSWER = 0.8  # the least agreement at which predicted requests are decoded
LATEST_SHAPES = 1  # shapes seen once that still get leading states: the latest ones
PASSAGES_BATCH = 16  # passages embedded between two pre-emption checks


def shapes_to_fill(parts: CacheParts) -> list[RequestShape]:
    """The shapes whose leading states idle work fills: every shape seen twice or more,
    and the latest seen (a chat's turns each have a shape of their own: only the latest
    one's is worth states), most seen first."""
    shapes = parts.shapes.shapes()
    latest = sorted(shapes, key=lambda s: s.last_seen, reverse=True)[:LATEST_SHAPES]
    return [s for s in shapes if s.seen >= 2 or s in latest]


def passages_for(parts: CacheParts) -> Retrieve:
    """The app's retriever where an adapter registered one, else PerCache's retrieval
    (question, n) -> passage texts, ranked as the app's requests were learned to rank
    theirs (``shapes.neighbour_order``: hybrid, or the embeddings' similarity alone)."""
    return parts.shapes.retrieve or _ranked(parts, parts.shapes.neighbour_order == DENSE)


def retrievals(parts: CacheParts) -> dict[str, Retrieve]:
    """Every retrieval an app's request is rebuilt with in its agreement check: PerCache's
    two rankings, and the app's own retriever where an adapter registered one."""
    found = {HYBRID: _ranked(parts, dense=False), DENSE: _ranked(parts, dense=True)}
    if parts.shapes.retrieve is not None:
        found[APP] = parts.shapes.retrieve
    return found


def _ranked(parts: CacheParts, dense: bool) -> Retrieve:
    def retrieve(question: str, n: int) -> list[str]:
        return [r.chunk.text for r in parts.knowledge.retrieve(question, n, dense=dense)]

    return retrieve


class AppPassages:
    """Step: the passages apps retrieved into the knowledge, in batches of
    ``PASSAGES_BATCH`` between pre-emption checks; the QA bank hears of them as of any
    added document."""

    name = "app passages"
    own_pipeline_only = False

    def __init__(self, parts: CacheParts, invalidation: Invalidation) -> None:
        self.parts = parts
        self.invalidation = invalidation

    def wants_round(self, own_pipeline: bool) -> bool:
        return bool(self.parts.knowledge.deferred_texts)

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        knowledge = self.parts.knowledge
        while knowledge.deferred_texts:
            round.tick()
            if round.should_stop():
                raise Preempted("idle round pre-empted between passages")
            chunks = knowledge.add_deferred(PASSAGES_BATCH)
            if chunks and self.parts.config.tiers.qa_bank:
                self.invalidation.documents_added(chunks, knowledge.last_replaced)
            part.passages_added += len(chunks)
        return part


class AppLeadingStates:
    """Step: the agreement checks, then the leading states of the apps' requests over the
    knowledge (see the module docstring), within the prefill share of the budget."""

    name = "app leading states"
    own_pipeline_only = False

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    def wants_round(self, own_pipeline: bool) -> bool:
        parts = self.parts
        if parts.shapes.pending_checks:
            return True
        if not (parts.config.tiers.chunk_states and parts.config.idle.knowledge_prefill and len(parts.knowledge)):
            return False
        return any(True for _ in self._prompts(limit_to_one=True))

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        parts = self.parts
        part.agreement_checks += parts.shapes.check_agreement(retrievals(parts), round.should_stop)
        if round.should_stop():
            raise Preempted("idle round pre-empted during the agreement checks")
        parts.shapes.neighbour_order = DENSE if self._dense_order() else HYBRID  # once a round, after its checks
        if not (parts.config.tiers.chunk_states and parts.config.idle.knowledge_prefill):
            return part
        runner = parts.runtime.runner
        for spec in self._prompts():
            round.tick()
            tokens = runner.prefill_text(spec, should_stop=round.should_stop)
            part.prefill_tokens += tokens
            part.app_states_prefilled += tokens > 0
        return part

    def _prompts(self, limit_to_one: bool = False) -> Iterator[TextPrompt]:
        """The leading prompts in the order to prefill them, while the states are under the
        prefill share of the budget (with *limit_to_one*, the first whose state is not
        stored)."""
        parts = self.parts
        runner = parts.runtime.runner if parts.runtime.engine_loaded else None
        if runner is None or runner.states is None:
            return
        limit = PREFILL_BUDGET_SHARE * parts.runtime.state_budget_bytes
        dense = parts.shapes.neighbour_order == DENSE  # learned by run
        hot, rest = self._ordered_chunks(dense)
        for shape in shapes_to_fill(parts):
            for path in self._paths(shape, hot, rest, dense):
                if runner.states.bytes >= limit:
                    return
                texts = [c.text for c in path]
                spec = TextPrompt(shape.leading(texts), tuple(texts), shape.add_bos)
                if not limit_to_one:
                    yield spec  # prefill_text lays it out once and skips a stored one
                elif runner.text_needs_prefill(spec):
                    yield spec
                    return

    def _paths(self, shape: RequestShape, hot: list[Chunk], rest: list[Chunk], dense: bool) -> Iterator[list[Chunk]]:
        """[chunk] for the *hot* chunks (those the app quoted lately and their neighbours),
        then for the *rest*, then for a shape of several passages [chunk, neighbour] in the
        same order, lazily: every request's first passage is worth more than a second one,
        which pays only where the app's second passage is that neighbour. The *rest*'s pairs
        go by rank: every chunk's nearest neighbour before any chunk's second. The
        neighbours are ranked as the app's second passages were (*dense*: see
        :meth:`_dense_order`)."""
        yield from ([c] for c in (*hot, *rest))
        if shape.passages < 2 or not shape.separator:
            return
        count = self.parts.config.idle.knowledge_prefill_neighbours
        knowledge = self.parts.knowledge
        for chunk in hot:
            for neighbour in knowledge.neighbours(chunk, count, dense=dense):
                yield [chunk, neighbour]
        for rank in range(count):
            for chunk in rest:
                near = knowledge.neighbours(chunk, count, dense=dense)
                if rank < len(near):
                    yield [chunk, near[rank]]

    def _dense_order(self) -> bool:
        """Whether the embeddings' similarity alone (a plain vector store's ranking) ranks
        as the app does, better than PerCache's hybrid retrieval: it rebuilt more of the
        app's requests exactly (the agreement checks); where both rebuilt as many (an app
        with an embedder of its own rebuilds none), it put the app's second passages among
        their first passage's neighbours more often, over the app's latest requests (hybrid
        on a tie, and before any request of two passages)."""
        agreed = self.parts.shapes.ranking_agreed()
        if agreed[DENSE] != agreed[HYBRID]:
            return agreed[DENSE] > agreed[HYBRID]
        knowledge = self.parts.knowledge
        count = self.parts.config.idle.knowledge_prefill_neighbours
        requests = [r for r in self.parts.shapes.recent_requests() if len(r) >= 2]
        if not requests or count <= 0:
            return False
        by_text = {c.text: c for c in knowledge.chunks}
        hits = {False: 0, True: 0}
        for first, second, *_ in requests:
            chunk = by_text.get(first)
            if chunk is None:
                continue
            for dense in hits:
                hits[dense] += any(n.text == second for n in knowledge.neighbours(chunk, count, dense=dense))
        return hits[True] > hits[False]

    def _ordered_chunks(self, dense: bool) -> tuple[list[Chunk], list[Chunk]]:
        """The knowledge's chunks in the order their leading states are worth having: the
        *hot* ones, the passages the app quoted lately (a question after them is likely to
        start there too) and their nearest neighbours (the next question's passages are
        likely near the last ones'), then the rest in knowledge order."""
        knowledge = self.parts.knowledge
        quoted = self.parts.shapes.recent_passages()
        hot = {c.id: c for c in knowledge.chunks if c.text in quoted}
        count = self.parts.config.idle.knowledge_prefill_neighbours
        for chunk in list(hot.values()):
            hot.update((n.id, n) for n in knowledge.neighbours(chunk, count, dense=dense) if n.id not in hot)
        return list(hot.values()), [c for c in knowledge.chunks if c.id not in hot]


class AppPredictedRequests:
    """Step: the round's predicted questions as the apps' requests (see the module
    docstring)."""

    name = "app requests"
    own_pipeline_only = False

    def __init__(self, parts: CacheParts, request_path: RequestPath, prediction: PredictAndPopulate) -> None:
        self.parts = parts
        self.request_path = request_path
        self.prediction = prediction  # leaves its questions here when no pipeline answers them

    def wants_round(self, own_pipeline: bool) -> bool:
        return False  # its questions come from the prediction step

    def run(self, round: IdleRound, part: WarmReport) -> WarmReport:
        questions, self.prediction.for_apps = self.prediction.for_apps, []
        shapes = [s for s in shapes_to_fill(self.parts) if s.predicts]
        if not questions or not shapes:
            return part
        retrieve = passages_for(self.parts)
        runner = self.parts.runtime.runner
        for question in questions:
            for shape in shapes:
                round.tick()
                if round.should_stop():
                    raise Preempted("idle round pre-empted between predicted requests")
                passages = retrieve(question, shape.passages)
                if not passages:
                    continue
                spec = TextPrompt(shape.render(passages, question), tuple(passages), shape.add_bos)
                if not shape.relayed and (self.parts.shapes.agreement(shape) or 0.0) >= AGREEMENT_TO_ANSWER:
                    with self.parts.activity.background(round.should_stop):
                        answer = drain(self.request_path.complete(spec.text, spec, self._decoding(shape)))
                    part.prefill_tokens += answer.prefilled_tokens
                    part.decode_tokens += answer.generated_tokens
                    part.app_answers_stored += 1
                else:
                    part.prefill_tokens += runner.prefill_text(spec, should_stop=round.should_stop)
                part.app_requests_run += 1
        return part

    def _decoding(self, shape: RequestShape) -> Decoding:
        return self.parts.config.engine.resolve(decoding_from(shape.decoding))
