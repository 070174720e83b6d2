"""Laying prompts out as segments whose KV states can be stored and restored.

PerCache's own RAG prompt is [system, chunk 1, ..., chunk k, question] (``lay_out``). A
caller's finished prompt string (a LlamaIndex or LangChain template, a chat template) is
laid out by ``lay_out_text``: tokenized whole, exactly as llama.cpp tokenizes it, and cut
after its line breaks. The cuts depend on the prompt alone, so the tokens, the batches the
model sees and hence the output are the same with or without a cache; which cut states are
worth keeping (the ends of known documents) is a separate choice that never changes them.

Each segment is tokenized on its own and fed to the model as a token list, so a stored
KV state of [system, chunk 1, ...] is exactly the state a later prompt with the same
leading segments reaches. The joined string is never re-tokenized. Segments are stripped
text ending in a blank line, which this tokenizer composes exactly; only the first
segment starts with BOS. The template is completion-style ("Question: ... Answer:"),
which suits base models such as the bundled Gemma 3 270M.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from .errors import ContextOverflowError, EngineError
from .types import Chunk

TEMPLATE_VERSION = "completion-v1"

SegmentKind = Literal["system", "chunk", "question", "text"]
Tokenizer = Callable[[str, bool], list[int]]  # (text, add_bos) -> token ids


class TextTokenizer(Protocol):
    """What ``lay_out_text`` needs of an engine."""

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]: ...

    def tokenize_chat(self, prompt: str) -> list[int]: ...

    def token_bytes(self, token: int, *, special: bool = False) -> bytes: ...


class ChatFormatter(Protocol):
    """What ``chat_text`` needs of an engine."""

    def format_chat(self, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str: ...


@dataclass(frozen=True)
class Segment:
    """One separately tokenized piece of a prompt."""

    kind: SegmentKind
    text: str
    tokens: tuple[int, ...]
    chunk_id: str | None = None
    keep_state: bool = True  # whether the state after this segment is worth storing


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


@dataclass(frozen=True)
class TextPrompt:
    """A caller's finished prompt string; *documents* are texts in it (retrieved chunks)
    after which a state is worth keeping. They never change the tokens or the output."""

    text: str
    documents: tuple[str, ...] = ()


_LINE_BREAKS = re.compile(r"\n+")


def line_cuts(text: str) -> list[int]:
    """Character offsets just after each run of line breaks in *text* (not at its end).

    >>> line_cuts("Context:\\n\\nA.\\nB.\\nQ?")
    [10, 13, 16]
    """
    return [m.end() for m in _LINE_BREAKS.finditer(text) if m.end() < len(text)]


def _document_ends(text: str, documents: Sequence[str]) -> list[int]:
    """Character offsets where a whole occurrence of a (stripped) document ends."""
    ends: list[int] = []
    for document in documents:
        needle = document.strip()
        if not needle:
            continue
        start = text.find(needle)
        while start >= 0:
            ends.append(start + len(needle))
            start = text.find(needle, start + 1)
    return sorted(ends)


def lay_out_text(prompt: TextPrompt, engine: TextTokenizer, *, max_prompt_tokens: int) -> PromptLayout:
    """*prompt* tokenized whole (markup such as ``<start_of_turn>`` as special tokens, one
    BOS) and cut into segments at the token boundaries that fall right after line breaks
    (every document of a framework's template ends at one).

    A segment whose text ends a document (up to whitespace) keeps its state; the last
    segment never does. When the detokenized pieces do not spell the prompt exactly, the
    prompt is one segment. Raises :class:`ContextOverflowError` when it does not fit.
    """
    text = prompt.text
    tokens = engine.tokenize_chat(text)
    if len(tokens) > max_prompt_tokens:
        raise ContextOverflowError(
            f"the prompt has {len(tokens)} tokens but only {max_prompt_tokens} fit (n_ctx "
            "minus max_new_tokens): shorten it, retrieve fewer chunks or raise n_ctx"
        )
    added = len(tokens) - len(engine.tokenize(text, False, special=True))
    data = text.encode("utf-8")
    boundaries: dict[int, int] = {}  # byte offset -> token index
    offset = 0
    for index in range(added, len(tokens)):
        offset += len(engine.token_bytes(tokens[index], special=True))
        boundaries[offset] = index + 1
    if offset != len(data):
        return PromptLayout((Segment("text", text, tuple(tokens), keep_state=False),))
    document_ends = _document_ends(text, prompt.documents)
    segments: list[Segment] = []
    start_char, start_token = 0, 0
    for cut in line_cuts(text):
        cut_token = boundaries.get(len(text[:cut].encode("utf-8")))
        if cut_token is None or cut_token <= start_token:
            continue
        piece = text[start_char:cut]
        ends_document = any(start_char < end <= cut and not text[end:cut].strip() for end in document_ends)
        segments.append(Segment("text", piece, tuple(tokens[start_token:cut_token]), keep_state=ends_document))
        start_char, start_token = cut, cut_token
    segments.append(Segment("text", text[start_char:], tuple(tokens[start_token:]), keep_state=False))
    return PromptLayout(tuple(segments))


PLAIN_CHAT_STOPS = ("\nuser:", "\nsystem:", "\nassistant:")  # a new turn in ``role: content`` lines


def chat_text(engine: ChatFormatter, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str:
    """(role, content) *messages* as one prompt for the assistant's reply: in *template*
    (a llama.cpp built-in name or template text) or the GGUF file's chat template; for a
    model without one (and no *template*), as ``role: content`` lines ending with
    ``assistant:`` (an answer then ends at one of ``PLAIN_CHAT_STOPS``). Roles are ``system``, ``user``, ``assistant`` (others pass through).
    """
    if not messages:
        raise ValueError("no messages to lay out")
    try:
        return engine.format_chat(messages, template=template)
    except EngineError:
        if template is not None:
            raise
    lines = [f"{role}: {content}" for role, content in messages]
    return "\n".join([*lines, "assistant: "])


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
