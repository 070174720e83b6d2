"""Splitting documents into chunks of about N words, on sentence and line boundaries."""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _sentences(text: str) -> list[tuple[str, bool]]:
    """Sentences of *text*, each with a flag: does a line break follow it?"""
    pieces: list[tuple[str, bool]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        parts = [part.strip() for part in _SENTENCE_END.split(line) if part.strip()]
        for index, part in enumerate(parts):
            pieces.append((part, index == len(parts) - 1))
    return pieces


def split_into_chunks(text: str, chunk_words: int = 100) -> list[str]:
    """Split *text* into chunks of at most about *chunk_words* words.

    Sentences are kept whole unless one alone is longer than *chunk_words*; line breaks
    inside a chunk are kept. Every chunk is stripped and non-empty.

    >>> split_into_chunks("One two three. Four five six.", chunk_words=3)
    ['One two three.', 'Four five six.']
    >>> split_into_chunks("a b c d e", chunk_words=2)
    ['a b', 'c d', 'e']
    >>> split_into_chunks("   ")
    []
    """
    if chunk_words <= 0:
        raise ValueError(f"chunk_words must be positive, got {chunk_words}")
    chunks: list[str] = []
    current: list[str] = []
    current_words = 0

    def flush() -> None:
        nonlocal current, current_words
        joined = "".join(current).strip()
        if joined:
            chunks.append(joined)
        current, current_words = [], 0

    for sentence, ends_line in _sentences(text):
        words = sentence.split()
        separator = "\n" if ends_line else " "
        if len(words) > chunk_words:
            flush()
            for start in range(0, len(words), chunk_words):
                chunks.append(" ".join(words[start : start + chunk_words]))
            continue
        if current_words + len(words) > chunk_words:
            flush()
        current.append(sentence + separator)
        current_words += len(words)
    flush()
    return chunks
