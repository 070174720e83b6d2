"""Checks of what users pass in, done before any work (so a bad call costs nothing)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from .errors import InvalidQuestionError
from .types import Chunk

MAX_QUESTION_CHARS = 100_000


def validated_question(question: object) -> str:
    """*question* without surrounding spaces, or a clear error.

    >>> validated_question("  When is it? ")
    'When is it?'
    >>> validated_question("   ")
    Traceback (most recent call last):
    ...
    percache_core.errors.InvalidQuestionError: question is empty
    """
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    if not question.strip():
        raise InvalidQuestionError("question is empty")
    if len(question) > MAX_QUESTION_CHARS:
        raise InvalidQuestionError(f"question has {len(question):,} characters (max {MAX_QUESTION_CHARS:,})")
    return question.strip()


def text_chunk(text: object) -> Chunk:
    """A chunk for a caller's text, with an id derived from its content."""
    if not isinstance(text, str) or not text.strip():
        raise TypeError("chunks must be Chunk objects or non-empty strings")
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
    return Chunk(f"text-{digest}", f"text-{digest}", text)


def as_chunks(items: object) -> list[Chunk]:
    """*items* (chunks or strings) as a list of chunks; a lone string is an error (it would
    otherwise become one chunk per character)."""
    if isinstance(items, (str, bytes)):
        raise TypeError("chunks must be a list of Chunk objects or strings, not a single string")
    return [c if isinstance(c, Chunk) else text_chunk(c) for c in items]  # type: ignore[union-attr]


def validated_scope(scope: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """*scope* as a plain dict (None when empty), or a clear error."""
    if scope is not None and not isinstance(scope, Mapping):
        raise TypeError(f"scope must be a mapping, got {type(scope).__name__}")
    return dict(scope) if scope else None
