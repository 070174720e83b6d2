"""Whether an engine restores its chunk states exactly: a start-up round trip, over short
prompts and over long ones that cross the model's sliding window.

With slices, each stored prefix holds only its own segment's positions, and a path is
rebuilt by restoring its first state and appending its descendants' slices
(``Engine.save_slice`` / ``Engine.append_slice``); whole states are restored alone. Either
is exact only if the rebuilt sequence gives the same logits, bit for bit, as prefilling
live. :func:`state_round_trip` checks both on this engine before any state is stored: a
short prompt, then one of *reach* tokens (default: the engine's ``n_ctx``) whose pieces each
pass the model's window, restored and then continued by a prefill that itself crosses the
window (the case a framework's 1,024-token chunks make: a state past Gemma 3's 512-token
window once changed an answer, :mod:`percache_core.kv.state_cells`); where ``n_ctx`` is too
short for three such pieces (between about one and three windows), two trips prove it
instead: a state past the window, then a continuation that crosses it. The verdict
(:class:`StateLayout`): slices where they rebuild both exactly, else whole states; states
up to the tokens the long prompt proved, else none past the window (never a wrong answer).
``state_layout`` runs it once per engine, as idle work (an idle round's first step, or
``preload()``; a user's question pre-empts it): until then no chunk state is kept or
restored. A new process with the same build and model reads the verdict from disk
(:class:`~percache_core.kv.engine.EngineVerdicts`); a verdict proved for a shorter context
is extended to ``n_ctx``, the shorter reach serving until then. Measured on 2 cores with the
bundled model: 26 s at 4,096 tokens (a live prefill of the whole prompt, at ~215 tokens/s,
is most of it), 13 s at 2,048.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ...errors import Preempted
from ...kv.cuts import eval_or_stop
from ...kv.engine import Engine, EngineVerdicts
from ...kv.probe_text import probe_tokens
from ...serving.state_runner import StopCheck

logger = logging.getLogger(__name__)

_SEGMENTS = ("Answer from the notes below.\n\n", "Note one: the rehearsal moved to Friday.\n\n", "Note two: bring the keys.\n\n")
_QUESTION = "Question: when is the rehearsal?\nAnswer:"


@dataclass(frozen=True)
class StateLayout:
    """What :func:`state_round_trip` proved: whether paths are kept as *slices* (else
    whole states), the deepest a state may end (*reach*, tokens: a state past it is not
    kept or restored) and the longest prompt the check *tried*."""

    slices: bool
    reach: int
    tried: int


_verdicts: EngineVerdicts[StateLayout] = EngineVerdicts(
    "state_layout",
    encode=lambda layout: [layout.slices, layout.reach, layout.tried],
    decode=lambda value: StateLayout(bool(value[0]), int(value[1]), int(value[2])),
)


def state_layout(engine: Engine, reach: int | None = None, should_stop: StopCheck | None = None) -> StateLayout:
    """:func:`state_round_trip` of *engine* up to *reach* tokens (default: its ``n_ctx``),
    run once per engine and remembered with what it cost; a verdict that tried a shorter
    prompt is measured again. Idle work: *should_stop* pre-empts it (see
    :func:`state_round_trip`).

    >>> state_layout(LlamaEngine(model_path, n_ctx=2048))   # doctest: +SKIP
    StateLayout(slices=True, reach=2048, tried=2048)
    """
    target = _target(engine, reach)
    known, verdict = _verdicts.known(engine)
    if known and verdict is not None and verdict.tried >= target:
        return verdict
    started = time.perf_counter()
    verdict = state_round_trip(engine, target, should_stop)
    _verdicts.keep(engine, verdict, since=started)
    return verdict


def known_state_layout(engine: Engine) -> StateLayout | None:
    """The verdict :func:`state_layout` keeps for *engine* (no work; None: not measured)."""
    return _verdicts.known(engine)[1]


def _target(engine: Engine, reach: int | None) -> int:
    n_ctx = int(getattr(engine, "n_ctx", 2048))
    return min(n_ctx, reach) if reach is not None else n_ctx


def state_round_trip(engine: Engine, reach: int | None = None, should_stop: StopCheck | None = None) -> StateLayout:
    """Prefill a short prompt in segments live, then again from a whole state and from a
    state with slices appended; then a prompt of *reach* tokens (default ``n_ctx``; pieces
    that each pass the model's window) the same way, its whole state tried only where its
    slices did not rebuild it (a path of slices begins with a whole state). The sequence
    is left empty. When *should_stop()* turns true between two engine calls (a user's
    question waits), :class:`~percache_core.errors.Preempted` is raised and nothing kept.

    >>> state_round_trip(LlamaEngine(model_path, n_ctx=2048))   # doctest: +SKIP
    StateLayout(slices=True, reach=2048, tried=2048)
    """
    target = _target(engine, reach)
    window = int(getattr(engine, "n_swa", 0) or 0)
    try:
        with engine.lock:
            try:
                return _layout(engine, target, window, should_stop)
            finally:
                engine.reset()
    except Preempted:
        raise
    except Exception as error:  # any refusal of the engine means: keep whole states, none past the window
        logger.info("state round trip failed (%s: %s): whole states within the window only", type(error).__name__, error)
        return StateLayout(False, window, target)


def _layout(engine: Engine, target: int, window: int, should_stop: StopCheck | None) -> StateLayout:
    short = [engine.tokenize(_SEGMENTS[0], True)]
    short += [engine.tokenize(text) for text in (*_SEGMENTS[1:], _QUESTION)]
    sliced, whole = _round_trip(engine, short, should_stop)
    if not whole:
        logger.info("a restored state changed the logits: no chunk states kept past a few tokens")
        return StateLayout(False, 0, target)
    trips = long_trips(target, window)
    if not trips:  # the context is too short for a state and its continuation to pass the window
        return StateLayout(sliced, window or target, target)
    tokens = probe_tokens(engine, target)
    long_sliced = True
    for pieces in trips:
        ends = np.cumsum(pieces)
        long = [tokens[end - size : end] for size, end in zip(pieces, ends)]
        trip_sliced, trip_whole = _round_trip(engine, long, should_stop, whole_if_sliced=not sliced)
        if not trip_whole:
            logger.warning("a state of %d tokens restored past the window changed the logits: none kept past %d",
                           int(ends[-2]), window)
            return StateLayout(False, window, target)
        long_sliced = long_sliced and trip_sliced
    if sliced and not long_sliced:
        logger.warning("a long path rebuilt from slices changed the logits: keeping whole states")
    return StateLayout(sliced and long_sliced, target, target)


def long_trips(target: int, window: int) -> list[tuple[int, int, int]]:
    """The long round trips that prove a reach of *target* tokens on a model with a sliding
    *window* (0: none): pieces (first, second, continuation) of *target* tokens in all, the
    first two restored (the second as a slice) and the continuation prefilled after them.
    One trip where each piece passes the window; where the context is too short for that
    (between about one and three windows), two: a state of all but 8 tokens past the
    window, then a continuation that itself crosses the window; none where neither fits.

    >>> long_trips(4096, 512)
    [(1780, 1775, 541)]
    >>> long_trips(1024, 512)
    [(508, 508, 8), (241, 242, 541)]
    >>> long_trips(540, 512)
    []
    """
    question = window + 29 if window else max(8, target // 4)
    first = (target - question) // 2 + 3
    second = target - question - first
    if min(first, second, question) > max(window, 8):
        return [(first, second, question)]
    if not window or target - question < 16:
        return []
    state = target - question
    return [((target - 8) // 2, target - 8 - (target - 8) // 2, 8), (state // 2, state - state // 2, question)]


def _round_trip(
    engine: Engine, segments: list[list[int]], should_stop: StopCheck | None, *, whole_if_sliced: bool = True
) -> tuple[bool, bool]:
    """Prefill *segments* live, then the last again after the others' states are restored:
    from a first whole state with the next ones appended as slices, and from one whole
    state of them all (where the slices did not rebuild it, or *whole_if_sliced*). Whether
    each gives the live last logits (a whole state not tried counts as rebuilt: its slices
    were, from a whole first state)."""
    engine.reset()
    saved: list[tuple[bytes, int]] = []
    for tokens in segments[:-1]:
        start = engine.n_past
        eval_or_stop(engine, tokens, should_stop)
        saved.append((engine.save_slice(start) if start else engine.save_state(), engine.n_past))
    whole_state = (engine.save_state(), engine.n_past)
    eval_or_stop(engine, segments[-1], should_stop)
    live = np.array(engine.last_logits(), copy=True)

    first, *rest = saved
    sliced = engine.load_state(*first) and all(engine.append_slice(*piece) for piece in rest)
    if sliced:
        eval_or_stop(engine, segments[-1], should_stop)
        sliced = bool(np.array_equal(live, engine.last_logits()))
    if sliced and not whole_if_sliced:
        return True, True
    whole = engine.load_state(*whole_state)
    if whole:
        eval_or_stop(engine, segments[-1], should_stop)
        whole = bool(np.array_equal(live, engine.last_logits()))
    if not sliced:
        logger.info("a path rebuilt from state slices (%d tokens) changed the logits or was refused", whole_state[1])
    return sliced, whole


_bytes_per_token: EngineVerdicts[float] = EngineVerdicts("state_bytes_per_token", decode=float)


def state_bytes_per_token(engine: Engine) -> float:
    """The bytes a stored state slice takes per token on *engine* (measured once per
    engine over a 100-odd-token segment after a first one; the sequence is emptied). The
    bundled Gemma 3 270M takes about 18 KB.

    >>> state_bytes_per_token(LlamaEngine(model_path)) > 10_000   # doctest: +SKIP
    True
    """
    known, measured = _bytes_per_token.known(engine)
    if known and measured is not None:
        return measured
    started = time.perf_counter()
    with engine.lock:
        try:
            engine.reset()
            engine.eval(engine.tokenize(_SEGMENTS[0], True))
            start = engine.n_past
            engine.eval(engine.tokenize(_SEGMENTS[1] * 8))
            measured = len(engine.save_slice(start)) / (engine.n_past - start)
        finally:
            engine.reset()
    _bytes_per_token.keep(engine, measured, since=started)
    return measured
