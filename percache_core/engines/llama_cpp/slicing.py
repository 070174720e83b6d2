"""Whether an engine can keep chunk states as slices: a start-up round trip.

With slices, each stored prefix holds only its own segment's positions, and a path is
rebuilt by restoring its first state and appending its descendants' slices
(``Engine.save_slice`` / ``Engine.append_slice``). That is exact only if the rebuilt
sequence gives the same logits, bit for bit, as prefilling live. ``slices_round_trip``
checks that on this engine before any slice is stored; where it fails (another llama.cpp
build, another cache layout), PerCache keeps whole states instead. ``slices_work`` runs it
once per engine (caches that share an engine do not repeat it; a new process with the same
build and model reads the verdict from disk: :class:`~percache_core.kv.engine.EngineVerdicts`).
"""

from __future__ import annotations

import logging

import numpy as np

from ...kv.engine import Engine, EngineVerdicts

logger = logging.getLogger(__name__)

_SEGMENTS = ("Answer from the notes below.\n\n", "Note one: the rehearsal moved to Friday.\n\n", "Note two: bring the keys.\n\n")
_QUESTION = "Question: when is the rehearsal?\nAnswer:"
_verdicts: EngineVerdicts[bool] = EngineVerdicts("state_slices", decode=bool)


def slices_work(engine: Engine) -> bool:
    """:func:`slices_round_trip` of *engine*, run once per engine and remembered.

    >>> slices_work(LlamaEngine(model_path))   # doctest: +SKIP
    True
    """
    known, verdict = _verdicts.known(engine)
    if known:
        return bool(verdict)
    verdict = slices_round_trip(engine)
    _verdicts.keep(engine, verdict)
    return verdict


def slices_round_trip(engine: Engine) -> bool:
    """Prefill three segments and a question live, then again from a whole state and two
    appended slices; True when the last logits are identical (the sequence is emptied).

    >>> slices_round_trip(LlamaEngine(model_path))   # doctest: +SKIP
    True
    """
    try:
        with engine.lock:
            try:
                return _round_trip(engine)
            finally:
                engine.reset()
    except Exception as error:  # any refusal of the engine means: keep whole states
        logger.info("state slices unavailable (%s: %s): keeping whole states", type(error).__name__, error)
        return False


def _round_trip(engine: Engine) -> bool:
    segments = [engine.tokenize(_SEGMENTS[0], True)]
    segments += [engine.tokenize(text) for text in (*_SEGMENTS[1:], _QUESTION)]
    engine.reset()
    saved: list[tuple[bytes, int]] = []
    for tokens in segments[:-1]:
        start = engine.n_past
        engine.eval(tokens)
        saved.append((engine.save_slice(start) if start else engine.save_state(), engine.n_past))
    engine.eval(segments[-1])
    live = np.array(engine.last_logits(), copy=True)

    first, *rest = saved
    if not engine.load_state(*first) or not all(engine.append_slice(*piece) for piece in rest):
        logger.info("the engine refused a state slice: keeping whole states")
        return False
    engine.eval(segments[-1])
    identical = bool(np.array_equal(live, engine.last_logits()))
    if not identical:
        logger.info("a path rebuilt from state slices changed the logits: keeping whole states")
    return identical


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
