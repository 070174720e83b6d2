"""Laying a RAG prompt out as segments: [system, chunk 1, ..., chunk k, question].

Each segment is tokenized on its own and fed to the model as a token list, so a stored
KV state of [system, chunk 1, ...] is exactly the state a later prompt with the same
leading segments reaches. The joined string is never re-tokenized. Segments are stripped
text ending in a blank line, which this tokenizer composes exactly; only the first
segment starts with BOS. The template is completion-style ("Question: ... Answer:"),
which suits base models such as the bundled Gemma 3 270M.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .errors import ContextOverflowError
from .types import Chunk

TEMPLATE_VERSION = "completion-v1"

SegmentKind = Literal["system", "chunk", "question"]
Tokenizer = Callable[[str, bool], list[int]]  # (text, add_bos) -> token ids


@dataclass(frozen=True)
class Segment:
    """One separately tokenized piece of a prompt."""

    kind: SegmentKind
    text: str
    tokens: tuple[int, ...]
    chunk_id: str | None = None


def system_text(system_prompt: str) -> str:
    """The system segment's text.

    >>> system_text("  Be brief. ")
    'Be brief.\\n\\n'
    """
    return system_prompt.strip() + "\n\n"


def chunk_text(chunk: Chunk) -> str:
    """A chunk segment's text.

    >>> chunk_text(Chunk("d#c000", "d", "Lunch is at noon. "))
    'Note: Lunch is at noon.\\n\\n'
    """
    return f"Note: {chunk.text.strip()}\n\n"


def question_text(question: str) -> str:
    """The last segment's text, which the answer continues.

    >>> question_text(" When is lunch? ")
    'Question: When is lunch?\\nAnswer:'
    """
    return f"Question: {question.strip()}\nAnswer:"


@dataclass(frozen=True)
class PromptLayout:
    """A prompt as segments, with the chunks that were kept in it."""

    segments: tuple[Segment, ...]
    dropped_chunk_ids: tuple[str, ...] = ()

    @property
    def chunk_ids(self) -> tuple[str, ...]:
        return tuple(s.chunk_id for s in self.segments if s.chunk_id is not None)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    @property
    def text(self) -> str:
        """The prompt as one string (for display and for LLMs without state reuse)."""
        return "".join(s.text for s in self.segments)


@dataclass(frozen=True)
class PromptSpec:
    """A prompt before tokenization: a prefix, chunk segments (id, text), a suffix."""

    prefix: str
    chunks: tuple[tuple[str | None, str], ...]
    suffix: str


def rag_prompt(system_prompt: str, chunks: Sequence[Chunk], question: str) -> PromptSpec:
    """PerCache's own completion-style RAG prompt.

    >>> rag_prompt("Be brief.", [Chunk("d#c000", "d", "Lunch at noon.")], "When is lunch?").chunks
    (('d#c000', 'Note: Lunch at noon.\\n\\n'),)
    """
    return PromptSpec(
        system_text(system_prompt), tuple((c.id, chunk_text(c)) for c in chunks), question_text(question)
    )


def lay_out(
    spec: PromptSpec,
    *,
    tokenize: Tokenizer,
    max_prompt_tokens: int,
) -> PromptLayout:
    """Tokenize the segments of *spec*, dropping chunks so that it fits *max_prompt_tokens*.

    Chunks are kept in the given (rank) order; when the prompt is too long the
    lowest-ranked chunks are dropped with a warning. If the prefix and the suffix alone do
    not fit, :class:`ContextOverflowError` is raised. The first segment starts with BOS.
    """
    first = Segment("system", spec.prefix, tuple(tokenize(spec.prefix, True)))
    last = Segment("question", spec.suffix, tuple(tokenize(spec.suffix, False)))
    fixed = len(first.tokens) + len(last.tokens)
    if fixed > max_prompt_tokens:
        raise ContextOverflowError(
            f"the question needs {fixed} prompt tokens with the system prompt, but only "
            f"{max_prompt_tokens} fit (n_ctx minus max_new_tokens); shorten the question"
        )
    kept: list[Segment] = []
    dropped: list[str] = []
    used = fixed
    for chunk_id, text in spec.chunks:
        if not text:
            continue
        segment = Segment("chunk", text, tuple(tokenize(text, False)), chunk_id)
        if dropped or used + len(segment.tokens) > max_prompt_tokens:
            dropped.append(chunk_id or "?")
            continue
        kept.append(segment)
        used += len(segment.tokens)
    if dropped:
        warnings.warn(
            f"prompt too long for the context: dropped the {len(dropped)} lowest-ranked chunk(s) {dropped}",
            stacklevel=3,
        )
    return PromptLayout((first, *kept, last), tuple(dropped))
