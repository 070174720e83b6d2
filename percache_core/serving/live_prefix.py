"""What the context already holds: the previous prompt's KV, reused up to the longest
common token prefix, as stock ``llama_cpp.Llama`` reuses it, but only where the output
cannot change.

Stock llama.cpp keeps its last prompt in the context and, for the next prompt, evaluates
only what follows the longest common token prefix. PerCache does the same (for PerCache's
own prompt, a caller's prompt and a chat alike), with one more condition: the positions it
keeps must hold what the new prompt's own prefill would compute, bit for bit. A position's
KV depends on the calls that computed it (llama.cpp's CPU kernels take a path by the number
of rows in a call: see :mod:`percache_core.kv.cuts`), so the kept part must have been
computed by calls that the new prompt's prefill could have made, and decoded tokens (one
call each) are never kept.

- A caller's prompt (a :class:`~percache_core.serving.prompting.TextPrompt`) is prefilled
  as one call, cut only where the engine's self-check allows (multiples of
  ``rule.multiple`` from the start, pieces of ``rule.min_tokens`` or more). A previous
  prompt prefilled the same way may be kept up to any such cut within the common prefix.
- PerCache's own prompt is prefilled one segment per call, so it is kept only up to a
  segment boundary where the previous prompt's calls were the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..kv.cuts import CutRule, feed_calls, short_call_start
from ..kv.engine import Engine


@dataclass(frozen=True)
class LiveContext:
    """The prompt a runner left in the engine's sequence: its prefilled *tokens* (tokens
    decoded after them are not reusable), where each prefill call started (*starts*), and
    ``engine.changes`` when it was recorded (any later change makes it unknown);
    *reinstated*: a stored state an idle round restored at its end (kept where it is as
    deep as any stored state, and counted as the restore it is)."""

    tokens: tuple[int, ...]
    starts: tuple[int, ...]
    changes: int
    reinstated: bool = False


def call_starts(engine: Engine, lengths: Sequence[int], *, ends_prompt: bool = True) -> list[int]:
    """Where *engine*'s calls that prefill a prompt in pieces of these *lengths*, one
    after another, start (:func:`~percache_core.kv.cuts.feed_calls`; the last piece ends
    the prompt unless *ends_prompt* is false: a prefix with more to follow).

    >>> class Engine: n_batch = 512
    >>> call_starts(Engine(), [5, 1030]), call_starts(Engine(), [520, 1030])  # the last piece in stock's calls
    ([0, 5, 512, 1024], [0, 256, 520, 1024, 1536])
    """
    starts: list[int] = []
    position = 0
    for index, length in enumerate(lengths):
        calls = feed_calls(engine, position, position + length, ends_prompt=ends_prompt and index == len(lengths) - 1)
        starts.extend(start for start, _ in calls)
        position += length
    return starts


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    left, right = np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64)
    differ = np.flatnonzero(left != right)
    return int(differ[0]) if len(differ) else n


def text_cut(live: LiveContext, tokens: Sequence[int], rule: CutRule, n_batch: int) -> int:
    """How many leading *tokens* of a caller's prompt (prefilled as one call, cut only
    under *rule*) may be kept from *live* (0: none): the largest cut of *rule* within the
    common prefix that the live calls also allow, leaving at least ``rule.min_tokens`` to
    prefill, and stock's short last call (of ``n_batch``-token calls) whole after a piece
    of at least that many (:func:`~percache_core.kv.cuts.prefill_start_allowed`).

    >>> live = LiveContext(tuple(range(40)), (0, 16), 0)
    >>> text_cut(live, list(range(30)) + [99] * 20, CutRule(8, 4), 512)
    28
    >>> live = LiveContext(tuple(range(1100)), (0, 512, 1024), 0)
    >>> text_cut(live, list(range(1030)), CutRule(8, 4), 512)  # stock's last call: 6 tokens
    1016
    """
    m, least = rule.multiple, rule.min_tokens
    limit = min(common_prefix(live.tokens, tokens), len(tokens) - least)
    short = short_call_start(len(tokens), n_batch, least)
    if short is not None:  # a cut inside the piece before stock's short last call would shorten it
        limit = min(limit, short - least)
    cut = limit // m * m
    if cut < least:
        return 0
    before = [s for s in live.starts if s < cut]
    if any(s % m for s in before):
        return 0  # the live prompt was not prefilled under the rule (PerCache's own prompt)
    last = max(before, default=0)
    if cut - last < least:  # the live call that holds the cut would be cut too short
        cut = last
    return cut if cut >= least else 0


def segment_cut(live: LiveContext, tokens: Sequence[int], starts: Sequence[int], boundaries: Sequence[int]) -> int:
    """How many leading *tokens* of a prompt prefilled by calls at *starts* may be kept
    from *live* (0: none): the largest of *boundaries* (segment ends before the last
    segment) within the common prefix where the live prompt was prefilled by the same calls.

    >>> live = LiveContext((1, 2, 3, 4, 5), (0, 2, 4), 0)
    >>> segment_cut(live, [1, 2, 3, 4, 9], [0, 2, 4], [2, 4])
    4
    """
    common = common_prefix(live.tokens, tokens)
    live_ends = set(live.starts) | {len(live.tokens)}
    for boundary in sorted(boundaries, reverse=True):
        if 0 < boundary <= common and boundary in live_ends:
            if [s for s in live.starts if s < boundary] == [s for s in starts if s < boundary]:
                return boundary
    return 0
