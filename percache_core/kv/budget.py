"""A chunk-state budget that matches the knowledge (``chunk_state_budget_bytes=None``).

The knowledge prefill stores [system, chunk] for every chunk and then [system, chunk,
neighbour] for ``knowledge_prefill_neighbours`` neighbours of each; how much of a
question's chunk tokens a stored prefix covers grows with the pairs that fit
(``benchmarks/paths.py``: on QMSum users, 0.36 at 1 GiB, 0.43 at 2, 0.49 at 4, 0.54 at 8).
So the default budget is what those states take at the loaded model's bytes per token,
over the prefill's share of the budget, within bounds: at most :data:`BUDGET_DISK_SHARE`
of the free disk, and at least :data:`SMALL_KNOWLEDGE_HEADROOM` times what the prefill
takes (room for the questions' own paths), between :data:`BUDGET_MIN_BYTES` (a few notes)
and :data:`BUDGET_FLOOR_BYTES` (a knowledge whose prefill takes 256 MiB or more).

>>> sized_state_budget(needed_bytes=2 * 1024**3, free_disk_bytes=100 * 1024**3) / 1024**3
2.5
>>> sized_state_budget(needed_bytes=64 * 1024**3, free_disk_bytes=40 * 1024**3) / 1024**3  # a quarter of the disk
10.0
>>> sized_state_budget(needed_bytes=2 * 1024**2, free_disk_bytes=100 * 1024**3) / 1024**2  # a few notes
64.0
>>> sized_state_budget(needed_bytes=100 * 1024**2, free_disk_bytes=100 * 1024**3) / 1024**2
400.0

Apps that bring their own prompts (a LangChain chat, an OpenAI client through ``percache
serve``) store states of prompts the knowledge does not predict: the budget then also
follows what requests stored (:func:`demand_budget`), so a user's conversations are not
evicted while the disk has room:

>>> demand_budget(knowledge_bytes=0, request_bytes=300 * 1024**2, free_disk_bytes=100 * 1024**3) / 1024**2
600.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BUDGET_FLOOR_BYTES = 1024**3  # the budget before it is sized, and the most a small knowledge gets
BUDGET_MIN_BYTES = 64 * 1024**2  # the least any knowledge gets
SMALL_KNOWLEDGE_HEADROOM = 4  # a small knowledge's budget: this many times its prefill's bytes
BUDGET_DISK_SHARE = 0.25
PREFILL_BUDGET_SHARE = 0.8  # idle population fills the chunk-state budget up to this share
REQUEST_HEADROOM = 2  # the budget holds this many times the bytes of the states requests stored
_TOKEN_SAMPLE = 32  # segments tokenized to estimate the knowledge's tokens per character


def knowledge_tokens(segments: Sequence[str], tokenize: Callable[[str], list[int]]) -> int:
    """The prompt tokens of every chunk's segment (its text in the prompt), estimated from
    the tokens per character of an even sample of :data:`_TOKEN_SAMPLE` segments (exact
    when there are no more).

    >>> knowledge_tokens(["a b", "c d e"], str.split)
    5
    """
    if not segments:
        return 0
    sample = list(segments[:: max(1, len(segments) // _TOKEN_SAMPLE)])[:_TOKEN_SAMPLE]
    sample_chars = sum(len(text) for text in sample)
    sample_tokens = sum(len(tokenize(text)) for text in sample)
    if len(sample) == len(segments):
        return sample_tokens
    return round(sample_tokens / max(1, sample_chars) * sum(len(text) for text in segments))


def prefill_state_bytes(tokens: int, *, bytes_per_token: float, neighbours: int, slices: bool) -> int:
    """The bytes of the knowledge prefill's states for chunks of *tokens* prompt tokens in
    all.

    >>> prefill_state_bytes(1000, bytes_per_token=18_000, neighbours=8, slices=True) / 1e6
    162.0
    """
    per_pair = 1 if slices else 2
    return round(tokens * (1 + per_pair * neighbours) * bytes_per_token)


def sized_state_budget(*, needed_bytes: int, free_disk_bytes: int) -> int:
    """The budget that holds *needed_bytes* within the prefill's share, at most
    :data:`BUDGET_DISK_SHARE` of *free_disk_bytes* (the free disk plus what the states
    already take), at least :data:`SMALL_KNOWLEDGE_HEADROOM` times *needed_bytes* within
    [:data:`BUDGET_MIN_BYTES`, :data:`BUDGET_FLOOR_BYTES`]."""
    wanted = needed_bytes / PREFILL_BUDGET_SHARE
    floor = max(BUDGET_MIN_BYTES, min(BUDGET_FLOOR_BYTES, SMALL_KNOWLEDGE_HEADROOM * needed_bytes))
    return int(max(floor, min(wanted, BUDGET_DISK_SHARE * free_disk_bytes)))


def demand_budget(*, knowledge_bytes: int, request_bytes: int, free_disk_bytes: int) -> int:
    """The budget that holds the knowledge prefill's *knowledge_bytes* within the prefill's
    share and :data:`REQUEST_HEADROOM` times the *request_bytes* that requests' states
    (not idle work's) take, at most :data:`BUDGET_DISK_SHARE` of *free_disk_bytes*: a
    request's states are evicted only once the disk share is reached."""
    wanted = knowledge_bytes / PREFILL_BUDGET_SHARE + REQUEST_HEADROOM * request_bytes
    return int(min(wanted, BUDGET_DISK_SHARE * free_disk_bytes))
