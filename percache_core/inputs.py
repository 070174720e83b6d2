"""Checks of what users pass in, done before any work (so a bad call costs nothing)."""

from __future__ import annotations

import hashlib
import math
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
    """*scope* as a plain dict (None when empty), or a clear error: keys are strings and
    values are strings, numbers, booleans or None (a scope is stored with the answer).

    >>> validated_scope({"meeting": "kickoff"}), validated_scope({})
    ({'meeting': 'kickoff'}, None)
    >>> validated_scope({"meeting": {1, 2}})
    Traceback (most recent call last):
    ...
    TypeError: scope value of 'meeting' must be a string, number, boolean or None, got set
    """
    if scope is not None and not isinstance(scope, Mapping):
        raise TypeError(f"scope must be a mapping, got {type(scope).__name__}")
    for key, value in (scope or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"scope keys must be strings, got {type(key).__name__}")
        finite = not isinstance(value, float) or math.isfinite(value)
        if not (value is None or isinstance(value, (str, int, float, bool))) or not finite:
            raise TypeError(
                f"scope value of {key!r} must be a string, number, boolean or None, got {type(value).__name__}"
            )
    return dict(scope) if scope else None


def positive_override(name: str, value: object, default: int) -> int:
    """A per-call integer setting: *default* when None, else a positive int (0 is an
    error, not "use the default").

    >>> positive_override("top_k", None, 3), positive_override("top_k", 2, 3)
    (3, 2)
    >>> positive_override("top_k", 0, 3)
    Traceback (most recent call last):
    ...
    ValueError: top_k must be a positive integer, got 0
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value

def similarity_override(value: float | None, default: float) -> float:
    """A per-call tau, checked (in [0, 1]), or *default*.

    >>> similarity_override(None, 0.85), similarity_override(0.9, 0.85)
    (0.85, 0.9)
    """
    if value is None:
        return default
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"similarity_threshold must be in [0, 1], got {value}")
    return float(value)
