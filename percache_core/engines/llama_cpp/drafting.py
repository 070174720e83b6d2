"""Lossless draft decoding: greedy output, computed faster wherever a draft is right.

Greedy decoding feeds one token at a time. When the next tokens can be guessed (a stored
answer to a similar question, or a phrase that the answer copies from its prompt), the
guess is fed in one batch and every position's logits come back together; each draft
token that greedy decoding would have chosen is accepted, and decoding goes on from the
first one it would not have chosen. The output is the one-token-at-a-time output.

Batching changes floating point: llama.cpp's CPU kernels for a batch of one and for
larger batches round differently, so a logit computed in a batch deviates slightly from
the one-at-a-time value. A token is therefore accepted from batched logits only where it
leads every other token by more than ``bound``, a bound on that deviation measured for
the loaded model and build at first use (:func:`deviation_bound`) with a safety factor.
(Why they differ, measured on this build: ggml's CPU matmul hands batches of two or more
tokens to llamafile's ``sgemm``, which declines single tokens, so those take ``vec_dot``;
with flash attention on, batches of up to 4 tokens were bit-identical on short prompts but
not on a 1,029-token one. A llama-cpp-python built with ``-DGGML_LLAMAFILE=OFF`` may make
batched and single evaluation agree to the bit; the self-check would then give the
minimum bound and drafts would be accepted on argmax alone.)
Where the lead is smaller (a near tie), the tokens since the last exact position are fed
again one at a time, as the reference does, and the choice is made on exact logits; the
rest of that answer is then decoded one token at a time, which bounds what a draft can
cost to one batched pass and one replay. After a batch with a rejected token, the rest of
the answer is decoded one token at a time as well: a wrong draft costs at most one batch.

>>> lookup = PromptLookup([5, 6, 7, 8, 9, 6, 7], ngram=2, max_tokens=3)
>>> lookup.propose([], 3)        # the prompt ends with 6 7, seen before followed by 8 9 6
[8, 9, 6]
>>> AnswerDraft([[4, 5, 6]]).propose([4], 5)
[5, 6]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...kv.engine import Engine, EngineVerdicts
from ...serving.state_runner import DraftStats

logger = logging.getLogger(__name__)

# A batched argmax can only differ from the one-at-a-time argmax if two logits move by
# half the lead each; the bound is twice the largest deviation the self-check saw, times
# a safety factor for prompts that deviate more than the self-check's did.
SAFETY_FACTOR = 2.0
MIN_BOUND = 1e-3  # logits; used when the self-check saw no deviation at all
_SELF_CHECK_TOKENS = 48
TOP_TOKENS = 8
_SELF_CHECK_PROMPT = (
    "Note: The quarterly review moved to Thursday at 10 am in room 4. Bring the budget sheet "
    "and the list of open hiring requests; Lena will present the travel numbers.\n\n"
    "Question: What should I bring to the quarterly review, and who presents?\nAnswer:"
)
_bounds: EngineVerdicts[float] = EngineVerdicts("draft_bound", decode=float)
PAYING_BATCH = 16  # draft tokens verified per batch at most (what a wrong draft can cost)
PAYING_SHARE = 0.7  # drafts pay when a perfect draft decodes in at most this share of the time
_gains: EngineVerdicts[bool] = EngineVerdicts("drafts_pay", decode=bool)


class DraftSource(Protocol):
    """Guesses the tokens that follow the answer tokens produced so far."""

    def propose(self, produced: Sequence[int], limit: int) -> list[int]:
        """At most *limit* tokens expected after *produced*, or [] for no guess."""
        ...


class AnswerDraft:
    """Stored answers as drafts: the first answer that agrees with the tokens produced so
    far proposes its continuation."""

    def __init__(self, answers: Sequence[Sequence[int]]) -> None:
        self.answers = [list(a) for a in answers if a]

    def propose(self, produced: Sequence[int], limit: int) -> list[int]:
        n = len(produced)
        for answer in self.answers:
            if len(answer) > n and answer[:n] == list(produced):
                return answer[n : n + limit]
        return []


class PromptLookup:
    """Prompt-lookup drafts: where the last *ngram* tokens (prompt and answer so far) were
    seen before, propose the tokens that followed them then (RAG answers copy phrases
    from their chunks)."""

    def __init__(self, prompt: Sequence[int], *, ngram: int = 2, max_tokens: int = 8) -> None:
        if ngram < 1 or max_tokens < 1:
            raise ValueError("ngram and max_tokens must be positive")
        self.ngram = ngram
        self.max_tokens = max_tokens
        self._tokens = list(prompt)
        self._prompt_length = len(self._tokens)
        self._seen: dict[tuple[int, ...], int] = {}  # n-gram -> index after its latest occurrence
        self._indexed = ngram  # n-grams ending before this index are in _seen

    def propose(self, produced: Sequence[int], limit: int) -> list[int]:
        tokens = self._tokens
        tokens.extend(produced[len(tokens) - self._prompt_length :])
        n = self.ngram
        for end in range(self._indexed, len(tokens)):  # every n-gram but the tail's own
            self._seen[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))
        follow = self._seen.get(tuple(tokens[-n:])) if len(tokens) > n else None
        if follow is None:
            return []
        return tokens[follow : follow + min(limit, self.max_tokens)]


def _leads(row: np.ndarray, token: int, bound: float) -> bool:
    """Whether *token* leads every other logit of *row* by more than *bound*."""
    return int(np.count_nonzero(row >= row[token] - bound)) == 1


def top_deviation(batched: np.ndarray, reference: np.ndarray, top: int = TOP_TOKENS) -> float:
    """The largest difference between two logit rows over the *top* best tokens of either.

    Only these matter: a batched choice differs from the one-at-a-time choice only if
    the reference's best token (top of *reference*) overtakes the batched best token
    (top of *batched*); low-ranked logits deviate more but never compete.
    """
    candidates = np.union1d(np.argpartition(-batched, top)[:top], np.argpartition(-reference, top)[:top])
    return float(np.max(np.abs(batched[candidates] - reference[candidates])))


def deviation_bound(engine: Engine) -> float:
    """The lead a batched logit needs to stand for the one-at-a-time choice.

    Measured once per engine: a prompt is decoded one token at a time, then the same
    tokens are fed again, half in one batch and half one at a time on top of it, and the
    largest deviation D among top-ranked tokens (:func:`top_deviation`) is taken; the
    bound is ``2 * D * SAFETY_FACTOR`` (``MIN_BOUND`` when the two agree to the bit).
    Measured here (Gemma 3 270M Q4_K_M, llama-cpp-python 0.3.36, CPU): batched logits
    are bit-identical up to the fourth position and deviate from the fifth on. Callers
    hold ``engine.lock``; the sequence is left empty.
    """
    known, bound = _bounds.known(engine)
    if known and bound is not None:
        return bound
    measuring = time.perf_counter()
    engine.reset()
    prompt = engine.tokenize(_SELF_CHECK_PROMPT, True)
    engine.eval(prompt)
    reference, tokens = [], []
    for _ in range(_SELF_CHECK_TOKENS):
        logits = engine.last_logits().copy()
        reference.append(logits)
        tokens.append(int(np.argmax(logits)))
        engine.eval([tokens[-1]])
    reference.append(engine.last_logits().copy())
    half = _SELF_CHECK_TOKENS // 2
    if not engine.truncate(len(prompt)):
        raise RuntimeError("self-check prompt is too long for the model's attention window")
    rows = engine.eval_with_logits(tokens[:half])
    deviation = max(top_deviation(rows[i], reference[i + 1]) for i in range(half))
    for i in range(half, _SELF_CHECK_TOKENS):
        engine.eval([tokens[i]])
        deviation = max(deviation, top_deviation(engine.last_logits(), reference[i + 1]))
    engine.reset()
    bound = max(MIN_BOUND, 2.0 * SAFETY_FACTOR * deviation)
    _bounds.keep(engine, bound, since=measuring)
    return bound


def known_bound(engine: Engine) -> float | None:
    """The bound :func:`deviation_bound` measured for *engine*, or None (no work)."""
    return _bounds.known(engine)[1]


def drafts_pay(engine: Engine) -> bool:
    """Whether draft verification makes decoding faster on *engine*, in the best case: the
    self-check prompt's greedy answer is decoded one token at a time, then again with that
    very answer as the draft (every token right); drafts pay when the drafted decode takes
    at most ``PAYING_SHARE`` of the plain one. Where even a perfect draft does not save
    that much (batch rows cost nearly a decode step, or the batched-logit bound of
    :func:`deviation_bound` rejects most tokens), a wrong draft's batch is never won back.
    Measured once per engine (about two seconds) and remembered; callers hold
    ``engine.lock``; the sequence is left empty.
    """
    known, pays = _gains.known(engine)
    if known and pays is not None:
        return pays
    bound = deviation_bound(engine)
    measuring = time.perf_counter()
    prompt = engine.tokenize(_SELF_CHECK_PROMPT, True)
    timings = []
    answer: list[int] = []
    for drafts in ((), (AnswerDraft([answer]),)):
        engine.reset()
        engine.eval(prompt)
        started = time.perf_counter()
        tokens = list(greedy_tokens(engine, DraftPlan(_SELF_CHECK_TOKENS, drafts, bound)))
        timings.append(time.perf_counter() - started)
        answer[:] = answer or tokens
    engine.reset()
    plain, drafted = timings
    pays = drafted <= PAYING_SHARE * plain
    logger.info("draft decoding: %.3f s with a perfect draft, %.3f s without: %s", drafted, plain, pays)
    _gains.keep(engine, pays, since=measuring)
    return pays


def known_drafts_pay(engine: Engine) -> bool | None:
    """What :func:`drafts_pay` measured for *engine*, or None (no work)."""
    return _gains.known(engine)[1]


class SequenceLost(Exception):
    """The sequence could not be cut back to an exact position (sliding-window cells were
    reused); the caller rebuilds the prompt's state and calls again with the tokens so far."""


@dataclass(frozen=True)
class DraftPlan:
    """How :func:`greedy_tokens` decodes.

    Attributes:
        max_new_tokens: the most tokens that are not end of generation.
        drafts: where draft tokens come from, tried in order.
        bound: the lead a batched logit needs for its token to be taken.
        should_stop: stops decoding when it turns true.
        stats: counts batches, proposed and accepted tokens, replays (default: a new one).
        replay: tokens already produced (after :class:`SequenceLost`): fed one at a time,
            not yielded again; decoding goes on after them without drafts.
    """

    max_new_tokens: int
    drafts: Sequence[DraftSource]
    bound: float
    should_stop: Callable[[], bool] | None = None
    stats: DraftStats | None = None
    replay: Sequence[int] = ()


def greedy_tokens(engine: Engine, plan: DraftPlan) -> Iterator[int]:
    """Greedy decoding after the evaluated prompt, with drafts verified in batches.

    Yields the tokens one-at-a-time greedy decoding yields (the end-of-generation token
    too, then stops), at most ``plan.max_new_tokens`` that are not end of generation.
    """
    decoder = _GreedyDecoder(engine, plan)
    while True:
        token = decoder.next_token()
        decoder.produced.append(token)
        yield token
        # Past this check every produced token counts towards max_new_tokens (an end of
        # generation has returned), so len(produced) is the answer's length.
        if engine.is_end_of_generation(token) or len(decoder.produced) >= plan.max_new_tokens:
            return
        if decoder.pending:
            continue
        if engine.n_past >= engine.n_ctx or (plan.should_stop is not None and plan.should_stop()):
            return
        decoder.advance(token)


class _GreedyDecoder:
    """The state of one :func:`greedy_tokens` run: the tokens produced, how many were fed
    one at a time, the logits in hand (and whether they are the one-at-a-time logits), and
    accepted draft tokens not yet yielded."""

    def __init__(self, engine: Engine, plan: DraftPlan) -> None:
        self.engine, self.plan = engine, plan
        self.stats = plan.stats if plan.stats is not None else DraftStats()
        self.start = engine.n_past
        self.produced: list[int] = []
        for token in plan.replay:  # the reference schedule: one token at a time
            self.produced.append(token)
            engine.eval([token])
        self.drafts: Sequence[DraftSource] = () if plan.replay else plan.drafts
        self.exact_upto = len(self.produced)  # produced[:exact_upto] were fed one at a time
        self.logits = engine.last_logits().copy()
        self.exact = True  # logits are the one-at-a-time logits
        self.pending: list[int] = []  # accepted draft tokens not yet yielded (already evaluated)

    def next_token(self) -> int:
        """The next token: an accepted draft's, or the logits' top one where it leads by the
        bound (else the tokens since the last exact position are fed again one at a time)."""
        if self.pending:
            return self.pending.pop(0)
        token = int(np.argmax(self.logits))
        if self.exact or _leads(self.logits, token, self.plan.bound):
            return token
        engine = self.engine
        if not engine.truncate(self.start + self.exact_upto):
            raise SequenceLost()
        for earlier in self.produced[self.exact_upto :]:
            engine.eval([earlier])
        self.exact_upto = len(self.produced)
        self.logits = engine.last_logits().copy()
        self.exact = True
        self.stats.replays += 1
        self.drafts = ()  # near ties here: the rest decodes one at a time (bounded cost)
        return int(np.argmax(self.logits))

    def advance(self, token: int) -> None:
        """Feed *token*: alone, or with a draft of the next tokens in one batch whose
        leading tokens are taken where their logits lead by the bound."""
        engine, plan = self.engine, self.plan
        room = min(plan.max_new_tokens - len(self.produced), engine.n_ctx - engine.n_past - 1, PAYING_BATCH)
        draft = next((d for d in (s.propose(self.produced, room) for s in self.drafts) if d), [])
        if not draft:
            all_exact = self.exact_upto == len(self.produced) - 1
            engine.eval([token])
            self.logits = engine.last_logits().copy()
            self.exact = all_exact
            self.exact_upto += all_exact
            return
        rows = engine.eval_with_logits([token, *draft])
        self.stats.batches += 1
        self.stats.proposed += len(draft)
        accepted = 0
        for i, guess in enumerate(draft):
            if not _leads(rows[i], guess, plan.bound):
                break
            accepted += 1
            if engine.is_end_of_generation(guess):
                break
        self.stats.accepted += accepted
        if accepted < len(draft):
            self.drafts = ()  # a wrong guess: the rest decodes one at a time (at most one batch lost)
        self.pending = list(draft[:accepted])
        if not engine.truncate(self.start + len(self.produced) + accepted):
            # Cutting off the rejected tail never needs cells the window had left: the
            # reused cells were outside the window of the batch's first position.
            raise SequenceLost()
        self.logits = rows[accepted]
        self.exact = False
