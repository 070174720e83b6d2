"""Whether an engine restores its chunk states exactly: a start-up round trip, over short
prompts and over long ones that cross the model's sliding window.

With slices, each stored prefix holds only its own segment's positions, and a path is
rebuilt by restoring its first state and appending its descendants' slices
(``Engine.save_slice`` / ``Engine.append_slice``); whole states are restored alone. Either
is exact only if the rebuilt sequence gives the same logits, bit for bit, as prefilling
live. :func:`state_round_trip` checks both on this engine before any state is stored: a
short prompt, then one of *reach* tokens (default ``min(n_ctx, 2048)``) whose pieces each
pass the model's window, restored and then continued by a prefill that itself crosses the
window (the case a framework's 1,024-token chunks make: a state past Gemma 3's 512-token
window once changed an answer, :mod:`percache_core.kv.state_cells`). The verdict
(:class:`StateLayout`): slices where they rebuild both exactly, else whole states; states
up to the tokens the long prompt proved, else none past the window (never a wrong answer).
``state_layout`` runs it once per engine and reach (a new process with the same build and
model reads the verdict from disk: :class:`~percache_core.kv.engine.EngineVerdicts`); the
engine's self-check extends it to ``n_ctx`` in idle time, and until then no state is kept
past the proved reach.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ...kv.engine import Engine, EngineVerdicts
from ...kv.probe_text import probe_tokens

logger = logging.getLogger(__name__)

_SEGMENTS = ("Answer from the notes below.\n\n", "Note one: the rehearsal moved to Friday.\n\n", "Note two: bring the keys.\n\n")
_QUESTION = "Question: when is the rehearsal?\nAnswer:"
OPENING_REACH = 2048  # the longest prompt the round trip proves when the states open


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


def state_layout(engine: Engine, reach: int | None = None) -> StateLayout:
    """:func:`state_round_trip` of *engine* up to *reach* tokens (default
    ``min(n_ctx, 2048)``), run once per engine and remembered; a verdict that tried a
    shorter prompt is measured again.

    >>> state_layout(LlamaEngine(model_path, n_ctx=2048))   # doctest: +SKIP
    StateLayout(slices=True, reach=2048, tried=2048)
    """
    target = _target(engine, reach)
    known, verdict = _verdicts.known(engine)
    if known and verdict is not None and verdict.tried >= target:
        return verdict
    verdict = state_round_trip(engine, target)
    _verdicts.keep(engine, verdict)
    return verdict


def known_state_layout(engine: Engine) -> StateLayout | None:
    """The verdict :func:`state_layout` keeps for *engine* (no work; None: not measured)."""
    return _verdicts.known(engine)[1]


def _target(engine: Engine, reach: int | None) -> int:
    n_ctx = int(getattr(engine, "n_ctx", OPENING_REACH))
    return min(n_ctx, reach if reach is not None else OPENING_REACH)


def state_round_trip(engine: Engine, reach: int | None = None) -> StateLayout:
    """Prefill a short prompt in segments live, then again from a whole state and from a
    state with slices appended; then a prompt of *reach* tokens (pieces that each pass the
    model's window) the same way. The sequence is left empty.

    >>> state_round_trip(LlamaEngine(model_path))   # doctest: +SKIP
    StateLayout(slices=True, reach=2048, tried=2048)
    """
    target = _target(engine, reach)
    window = int(getattr(engine, "n_swa", 0) or 0)
    try:
        with engine.lock:
            try:
                return _layout(engine, target, window)
            finally:
                engine.reset()
    except Exception as error:  # any refusal of the engine means: keep whole states, none past the window
        logger.info("state round trip failed (%s: %s): whole states within the window only", type(error).__name__, error)
        return StateLayout(False, window, target)


def _layout(engine: Engine, target: int, window: int) -> StateLayout:
    short = [engine.tokenize(_SEGMENTS[0], True)]
    short += [engine.tokenize(text) for text in (*_SEGMENTS[1:], _QUESTION)]
    sliced, whole = _round_trip(engine, short)
    if not whole:
        logger.info("a restored state changed the logits: no chunk states kept past a few tokens")
        return StateLayout(False, 0, target)
    question = window + 29 if window else max(8, target // 4)
    first = (target - question) // 2 + 3
    second = target - question - first
    if min(first, second, question) <= max(window, 8):  # the context is too short to cross the window
        return StateLayout(sliced, window or target, target)
    tokens = probe_tokens(engine, target)
    long = [tokens[:first], tokens[first : first + second], tokens[first + second :]]
    long_sliced, long_whole = _round_trip(engine, long)
    if not long_whole:
        logger.warning("a state of %d tokens restored past the window changed the logits: none kept past %d", first, window)
        return StateLayout(False, window, target)
    if sliced and not long_sliced:
        logger.warning("a long path rebuilt from slices changed the logits: keeping whole states")
    return StateLayout(sliced and long_sliced, target, target)


def _round_trip(engine: Engine, segments: list[list[int]]) -> tuple[bool, bool]:
    """Prefill *segments* live, then the last again after the others' states are restored:
    from a first whole state with the next ones appended as slices, and from one whole
    state of them all. Whether each gives the live last logits."""
    engine.reset()
    saved: list[tuple[bytes, int]] = []
    for tokens in segments[:-1]:
        start = engine.n_past
        engine.eval(tokens)
        saved.append((engine.save_slice(start) if start else engine.save_state(), engine.n_past))
    whole_state = (engine.save_state(), engine.n_past)
    engine.eval(segments[-1])
    live = np.array(engine.last_logits(), copy=True)

    first, *rest = saved
    sliced = engine.load_state(*first) and all(engine.append_slice(*piece) for piece in rest)
    if sliced:
        engine.eval(segments[-1])
        sliced = bool(np.array_equal(live, engine.last_logits()))
    whole = engine.load_state(*whole_state)
    if whole:
        engine.eval(segments[-1])
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
    with engine.lock:
        try:
            engine.reset()
            engine.eval(engine.tokenize(_SEGMENTS[0], True))
            start = engine.n_past
            engine.eval(engine.tokenize(_SEGMENTS[1] * 8))
            measured = len(engine.save_slice(start)) / (engine.n_past - start)
        finally:
            engine.reset()
    _bytes_per_token.keep(engine, measured)
    return measured
