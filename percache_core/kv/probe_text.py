"""Long prompts for the engines' start-up checks: varied meeting-note text of any length,
made here (no data file), so that a check can cross a model's sliding window and reach the
lengths real prompts have (a framework's 1,024-token chunks, prompts up to ``n_ctx``).
"""

from __future__ import annotations

from .engine import Engine

_NAMES = ("Lena", "Priya", "Tom", "Ana", "Karim", "Mei", "Jonas", "Rosa", "Idris", "Sofia")
_THINGS = ("budget sheet", "field study", "invoice", "rehearsal", "hiring plan", "van", "report", "survey", "roof repair", "launch")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
_VERBS = ("moved", "was approved", "needs a review", "is late", "was cancelled", "goes ahead", "costs more")


def probe_sentences(count: int) -> list[str]:
    """*count* sentences of meeting notes, each different (a fixed pseudo-random walk).

    >>> probe_sentences(2)
    ['Item 1: Karim said the report was cancelled, Monday at 15, room 23.', 'Item 2: Priya said the van needs a review, Wednesday at 9, room 22.']
    """
    sentences, state = [], 7
    for index in range(1, count + 1):
        picks = []
        for options in (_NAMES, _THINGS, _VERBS, _DAYS):
            state = (state * 1103515245 + 12345) % 2**31
            picks.append(options[(state >> 16) % len(options)])
        name, thing, verb, day = picks
        sentences.append(f"Item {index}: {name} said the {thing} {verb}, {day} at {9 + state % 9}, room {1 + state % 23}.")
    return sentences


def probe_tokens(engine: Engine, n_tokens: int) -> list[int]:
    """*n_tokens* tokens of :func:`probe_sentences` text on *engine*'s tokenizer, BOS first.

    >>> len(probe_tokens(LlamaEngine(model_path), 1100))   # doctest: +SKIP
    1100
    """
    count = max(8, n_tokens // 12)
    while True:
        tokens = engine.tokenize("\n".join(probe_sentences(count)) + "\n", True)
        if len(tokens) >= n_tokens:
            return tokens[:n_tokens]
        count *= 2
