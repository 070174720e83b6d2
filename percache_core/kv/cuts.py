"""Where a prompt's prefill may be cut without changing a bit: a start-up self-check.

llama.cpp's CPU matrix products take a kernel by the number of rows (tokens) in a call:
with the bundled model and llama-cpp-python 0.3.36, K-quant weights go to a tiled path
from 8 rows on and to ``vec_dot`` below, other types to llamafile's ``sgemm`` from 2 rows
on, and repacked weights (llama.cpp's default ``use_extra_bufts``) are multiplied 4 rows
at a time with a different kernel for the rest. The kernels round differently, so a
prompt fed as ``[3 tokens, rest]`` can give other logits than the same prompt in one call.
Measured here: without repacking, any cuts that leave pieces of at least 8 tokens give the
one-call logits bit for bit; with repacking, cuts must also fall on multiples of 4 tokens
(60 of 60 random schedules identical; cuts elsewhere were not).

:func:`measure_cut_rule` finds such a :class:`CutRule` for a loaded engine among
:data:`CANDIDATES`: a prompt (two lengths that are not multiples of 4) is prefilled in one
call, then again cut in several ways that obey the rule, and the rule holds when every
last-position logit row is bit-identical; then a long prompt (past two sliding windows, or
1,101 tokens), cut near a third and two thirds, the same way. A caller's prompt may then be cut wherever a
state is worth keeping (within the rule), and its output equals a one-call prefill's with
or without stored states. ``None``: no candidate holds on this build (callers then keep a
layout that does not depend on the cache).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import Preempted
from .engine import Engine, EngineVerdicts
from .probe_text import probe_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CutRule:
    """Cuts that leave a prefill's logits unchanged: pieces of at least *min_tokens*
    tokens, cut at positions that are multiples of *multiple* (counted from the start of
    the sequence)."""

    min_tokens: int
    multiple: int = 1

    def allows(self, start: int, cut: int, end: int) -> bool:
        """Whether a cut at *cut* is allowed after a cut at *start* in a prompt of *end*.

        >>> CutRule(8, 4).allows(0, 12, 30), CutRule(8, 4).allows(0, 10, 30), CutRule(8).allows(0, 10, 15)
        (True, False, False)
        """
        return cut % self.multiple == 0 and cut - start >= self.min_tokens and end - cut >= self.min_tokens


CANDIDATES = (CutRule(8), CutRule(8, 4), CutRule(16, 4), CutRule(16, 16))
# Before the engine's rule is measured: prompts in stock's calls, cut nowhere (no state kept);
# the output of a prompt in stock's calls is the same under any rule that holds
NO_CUTS = CutRule(min_tokens=1 << 30)
_STRICTEST_LEAST = max(rule.min_tokens for rule in CANDIDATES)  # the least piece before a rule is measured
_LENGTHS = (97, 102)  # prompt lengths checked (not multiples of 4: the one call's last rows)
PROBE_PROMPT = (
    "Minutes of the planning call, Tuesday. Present: Lena Okafor, Priya Natarajan, Tom Weiss.\n"
    "1. The quarterly review moved to Thursday at 10 am in room 4; bring the budget sheet.\n"
    "2. Finance approved 18,500 euros for the field study; the invoice goes to Tom by Friday.\n"
    "3. The rehearsal is on Saturday at 4 pm in the Birch room, and the van leaves at 3 pm.\n"
    "4. Priya will send the travel numbers; Lena checks the hiring requests before the review.\n"
    "Question: Who checks the hiring requests, and when is the rehearsal?\nAnswer:"
)


def short_call_start(n_tokens: int, n_batch: int, least: int) -> int | None:
    """Where stock's last call of a prompt of *n_tokens* starts when that call is shorter
    than *least* tokens (stock feeds ``n_batch`` at a time from position 0; a cut rule
    makes pieces of at least *least* tokens round like its full calls, not like a short
    one, so an engine makes that call as it is); None where stock's last call is not short.

    >>> short_call_start(3079, 512, 8), short_call_start(3090, 512, 8), short_call_start(7, 512, 8)
    (3072, None, None)
    """
    last = n_tokens % n_batch
    return n_tokens - last if n_tokens > n_batch and 0 < last < least else None


def prefill_start_allowed(start: int, n_tokens: int, n_batch: int, least: int) -> bool:
    """Whether a prompt of *n_tokens* prefilled from *start* (a restored or kept prefix)
    in pieces of at least *least* tokens can compute as stock's calls do: at least *least*
    tokens after *start*, and stock's short last call (:func:`short_call_start`) left whole
    after a piece of at least *least* tokens, or begun at *start* itself.

    >>> prefill_start_allowed(2472, 3079, 512, 8), prefill_start_allowed(3068, 3079, 512, 8)
    (True, False)
    """
    if n_tokens - start < least:
        return False
    short = short_call_start(n_tokens, n_batch, least)
    return short is None or start == short or short - start >= least


def batch_bounds(n_tokens: int, n_batch: int, align: int = 16) -> list[tuple[int, int]]:
    """(start, end) of the calls that feed *n_tokens* at most *n_batch* at a time: of
    nearly equal size, so that a long piece never ends in a short call, and cut at
    multiples of *align* tokens from the piece's start, so that every cut is one the
    self-check may allow (:data:`CANDIDATES` cut at multiples of 1, 4 or 16) and the calls
    do not depend on where a restored or kept prefix ended.

    >>> batch_bounds(1030, 512)
    [(0, 336), (336, 672), (672, 1030)]
    >>> batch_bounds(300, 512)
    [(0, 300)]
    >>> max(end - start for start, end in batch_bounds(1535, 512)) <= 512
    True
    """
    if n_tokens <= n_batch:
        return [(0, n_tokens)] if n_tokens else []
    step = max(align, n_batch - align)  # room for the cuts' rounding down
    calls = -(-n_tokens // step)
    cuts = [n_tokens * i // calls // align * align for i in range(1, calls)]
    bounds = [0, *cuts, n_tokens]
    return list(zip(bounds, bounds[1:]))


def feed_calls(engine: Engine, start: int, end: int, *, ends_prompt: bool = False) -> list[tuple[int, int]]:
    """(start, end) of the calls in which *engine* feeds positions *start* .. *end* of its
    sequence. Where *end* ends the prompt: stock's calls (``n_batch`` tokens at a time from
    position 0, its last call as it is, however short), from *start* on where the first of
    them after *start* is no piece shorter than the engine's cut rule allows (from 0 always:
    the prompt then computes as stock's does, with or without a rule); else nearly equal
    calls (:func:`batch_bounds`) up to stock's last call, which is made as it is where it is
    short (:func:`short_call_start`; under the engine's cut rule, or the strictest
    candidate's before that is measured). Where *end* is a cut inside a prompt: nearly equal
    calls, none short. The one place that decides an in-process prefill's calls
    (``LlamaEngine.eval``, and where the runner records them).

    >>> class Engine: n_batch = 512
    >>> feed_calls(Engine(), 0, 1030), feed_calls(Engine(), 0, 1030, ends_prompt=True)
    ([(0, 336), (336, 672), (672, 1030)], [(0, 512), (512, 1024), (1024, 1030)])
    >>> feed_calls(Engine(), 480, 1030, ends_prompt=True), feed_calls(Engine(), 1020, 1030, ends_prompt=True)
    ([(480, 512), (512, 1024), (1024, 1030)], [(1020, 1030)])
    >>> feed_calls(Engine(), 1000, 3079, ends_prompt=True)[-2:]
    [(2560, 3072), (3072, 3079)]
    """
    n_batch = engine.n_batch
    even = [(start + a, start + b) for a, b in batch_bounds(end - start, n_batch)]
    if not ends_prompt or end - start <= 1:
        return even
    measured, rule = known_cut_rule(engine)
    least = rule.min_tokens if rule is not None else _STRICTEST_LEAST
    first = min(end, (start // n_batch + 1) * n_batch)  # the end of stock's call that holds start
    if start % n_batch == 0 or first - start >= least or (measured and rule is None):
        bounds = [start, *range(first, end, n_batch), end]
        return list(zip(bounds, bounds[1:]))
    short = short_call_start(end, n_batch, least)
    if short is None or short - start < least:
        return even
    return [(start + a, start + b) for a, b in batch_bounds(short - start, n_batch)] + [(short, end)]


_verdicts: EngineVerdicts[CutRule | None] = EngineVerdicts(
    "cut_rule",
    encode=lambda rule: None if rule is None else [rule.min_tokens, rule.multiple],
    decode=lambda value: None if value is None else CutRule(int(value[0]), int(value[1])),
)


def measure_cut_rule(engine: Engine, should_stop: Callable[[], bool] | None = None) -> CutRule | None:
    """The first rule of :data:`CANDIDATES` under which *engine*'s prefill does not
    depend on where a prompt is cut (None: none holds), measured once per engine (about
    12 s with the bundled model on 2 cores, shown in ``stats()``) and remembered. Takes
    ``engine.lock``; the sequence is left empty. Idle work, never an answer's: when
    *should_stop()* turns true (a user's question waits) it raises
    :class:`~percache_core.errors.Preempted` between two engine calls, keeping nothing.

    >>> rule = measure_cut_rule(LlamaEngine(model_path))   # doctest: +SKIP
    >>> rule.min_tokens, rule.multiple                     # doctest: +SKIP
    (8, 4)
    """
    known, rule = known_cut_rule(engine)
    if known:
        return rule
    with engine.lock:
        known, rule = known_cut_rule(engine)  # measured while this thread waited for the lock
        if known:
            return rule
        started = time.perf_counter()
        try:
            rule = _first_exact_rule(engine, should_stop)
        finally:
            engine.reset()
        _verdicts.keep(engine, rule, since=started)
    if rule is None:
        logger.warning("prefill depends on where a prompt is cut on this build: text prompts stay uncut")
    return rule


def known_cut_rule(engine: Engine) -> tuple[bool, CutRule | None]:
    """Whether :func:`measure_cut_rule` has run for *engine*, and its rule (no work)."""
    return _verdicts.known(engine)


def _first_exact_rule(engine: Engine, should_stop: Callable[[], bool] | None) -> CutRule | None:
    tokens = engine.tokenize(PROBE_PROMPT, True)
    prompts = [tokens[:n] for n in _LENGTHS if n <= len(tokens)]
    references = [_last_logits(engine, [prompt], should_stop) for prompt in prompts]
    long: list[int] | None = None
    for rule in CANDIDATES:
        if all(
            np.array_equal(_last_logits(engine, pieces, should_stop), reference)
            for prompt, reference in zip(prompts, references)
            for pieces in cut_schedules(prompt, rule)
        ):
            long = long if long is not None else probe_tokens(engine, _long_length(engine))
            if _long_cuts_hold(engine, long, rule, should_stop):
                return rule
    return None


def _long_length(engine: Engine) -> int:
    """The long prompt's length: past two sliding windows (pieces that each cross one) or
    1,101 tokens, within the context; not a multiple of 4."""
    window = int(getattr(engine, "n_swa", 0) or 0)
    return min(int(getattr(engine, "n_ctx", 2048)) - 1, max(2 * window + 109, 1101)) // 4 * 4 + 1


def _long_cuts_hold(engine: Engine, tokens: list[int], rule: CutRule, should_stop: Callable[[], bool] | None) -> bool:
    """Whether *tokens* cut near a third and two thirds (under *rule*) give the one call's
    last logits: the cuts a framework's long passages make, past the model's window."""
    n = len(tokens)
    cuts = [position // rule.multiple * rule.multiple for position in (n // 3, 2 * n // 3)]
    if not (rule.allows(0, cuts[0], n) and rule.allows(cuts[0], cuts[1], n)):
        return True  # too short a context to cut: the short prompts decide
    reference = _last_logits(engine, [tokens], should_stop)
    pieces = [tokens[: cuts[0]], tokens[cuts[0] : cuts[1]], tokens[cuts[1] :]]
    return bool(np.array_equal(_last_logits(engine, pieces, should_stop), reference))


def cut_schedules(tokens: list[int], rule: CutRule) -> list[list[list[int]]]:
    """Ways to cut *tokens* under *rule*: the shortest first piece, the shortest last
    piece, three pieces, and cuts near a third and two thirds."""
    n, size, multiple = len(tokens), rule.min_tokens, rule.multiple

    def up(position: int) -> int:
        return -(-position // multiple) * multiple

    def down(position: int) -> int:
        return position // multiple * multiple

    cut_sets = ([up(size)], [down(n - size)], [up(size), up(2 * size)], [up(n // 3), down(2 * n // 3)])
    schedules = []
    for cuts in cut_sets:
        kept: list[int] = []
        for cut in cuts:
            if rule.allows(kept[-1] if kept else 0, cut, n):
                kept.append(cut)
        if kept:
            bounds = [0, *kept, n]
            schedules.append([tokens[a:b] for a, b in zip(bounds, bounds[1:])])
    return schedules


def _last_logits(engine: Engine, pieces: list[list[int]], should_stop: Callable[[], bool] | None = None) -> np.ndarray:
    engine.reset()
    for piece in pieces:
        eval_or_stop(engine, piece, should_stop)
    return np.array(engine.last_logits(), copy=True)


def eval_or_stop(engine: Engine, tokens: Sequence[int], should_stop: Callable[[], bool] | None) -> None:
    """``engine.eval(tokens)``, polled between its calls (idle work: a self-check's step, a
    prefill), which raises :class:`~percache_core.errors.Preempted` when *should_stop()*
    turns true (a user's question waits for the engine)."""
    expected = engine.n_past + len(tokens)
    if should_stop is not None and should_stop():
        raise Preempted("pre-empted by a user question")
    engine.eval(tokens, should_stop)
    if engine.n_past != expected:
        raise Preempted("pre-empted by a user question")

