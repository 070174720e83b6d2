"""Laying prompts out as segments whose KV states can be stored and restored.

PerCache's own RAG prompt is [system, chunk 1, ..., chunk k, question] (``lay_out``). A
caller's finished prompt string (a LlamaIndex or LangChain template, a chat template) is
laid out by ``lay_out_text``: tokenized whole, exactly as llama.cpp tokenizes it, and cut
only where a state is worth keeping (after a retrieved document, a system message or an
earlier chat turn), into pieces no shorter than the size from which the engine's prefill
does not depend on the cuts (a start-up self-check, :mod:`percache_core.kv.cuts`). The
output is then a one-call prefill's, with or without stored states, inside or outside a
framework's engine. On a build where no cut is safe, the prompt is one piece (no state is
kept: the output stays the one-call output).

Each segment is tokenized on its own and fed to the model as a token list, so a stored
KV state of [system, chunk 1, ...] is exactly the state a later prompt with the same
leading segments reaches. The joined string is never re-tokenized. Segments are stripped
text ending in a blank line, which this tokenizer composes exactly; only the first
segment starts with BOS. The template is completion-style ("Question: ... Answer:"),
which suits base models such as the bundled Gemma 3 270M.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

from ..errors import ContextOverflowError
from ..kv.cuts import CutRule
from ..kv.engine import ChatPrompt, TextModel
from ..types import Chunk

TEMPLATE_VERSION = "completion-v1"

SegmentKind = Literal["system", "chunk", "question", "text"]
Tokenizer = Callable[[str, bool], list[int]]  # (text, add_bos) -> token ids


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
    """A prompt as segments, with the chunks that were kept in it.

    *rule*: the prompt runs in stock's calls under the engine's cut rule (one prefill from
    the restore point on; the state after segment *k* is taken at :meth:`state_point` ``k``
    afterwards). Without it (no rule on this build, or an engine that feeds each piece as
    a request of its own), one call per segment.
    """

    segments: tuple[Segment, ...]
    dropped_chunk_ids: tuple[str, ...] = ()
    rule: CutRule | None = None

    @property
    def stock_calls(self) -> bool:
        """Whether the prompt is prefilled in stock's calls (under *rule*), its states taken
        afterwards, rather than one call per segment."""
        return self.rule is not None

    def state_point(self, index: int) -> int:
        """Where the state of the prefix through segment *index* is taken: that segment's
        end, or under *rule* the last multiple of ``rule.multiple`` at or before it (the
        few tokens after it are prefilled with the rest; 0: no state there, for a point
        before ``rule.min_tokens``). A run that restores it must still prefill at least
        ``rule.min_tokens`` after it.

        >>> segments = tuple(Segment("chunk", "", tuple(range(n))) for n in (10, 11, 12))
        >>> [PromptLayout(segments, rule=CutRule(8, 4)).state_point(i) for i in range(3)]
        [8, 20, 32]
        """
        end = self.ends[index]
        if not self.stock_calls:
            return end
        assert self.rule is not None
        point = end // self.rule.multiple * self.rule.multiple
        return point if point >= self.rule.min_tokens else 0

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

    @property
    def caller_prompt(self) -> bool:
        """Whether this is a caller's finished prompt (:func:`lay_out_text`: cut only where
        a state is kept, under the engine's rule) rather than PerCache's own."""
        return all(s.kind == "text" for s in self.segments)

    @cached_property
    def tokens(self) -> list[int]:
        """The prompt's token ids (computed once per layout: do not change the list)."""
        return [t for s in self.segments for t in s.tokens]

    @cached_property
    def ends(self) -> list[int]:
        """Where each segment ends, in tokens from the prompt's start."""
        ends: list[int] = []
        for segment in self.segments:
            ends.append((ends[-1] if ends else 0) + len(segment.tokens))
        return ends


@dataclass(frozen=True)
class PromptSpec:
    """A prompt before tokenization: a prefix, chunk segments (id, text), a suffix."""

    prefix: str
    chunks: tuple[tuple[str | None, str], ...]
    suffix: str

    @property
    def text(self) -> str:
        """The prompt as one string (what a stock LLM call completes).

        >>> PromptSpec("Notes:\\n", (("c", "Lunch at noon.\\n"),), "Q: When?").text
        'Notes:\\nLunch at noon.\\nQ: When?'
        """
        return self.prefix + "".join(text for _, text in self.chunks) + self.suffix


@dataclass(frozen=True)
class TextPrompt:
    """A caller's finished prompt string; *documents* are texts in it (retrieved chunks,
    a system message, earlier chat turns) after which a state is worth keeping. They never
    change the tokens or the output."""

    text: str
    documents: tuple[str, ...] = ()
    add_bos: bool | None = None  # None: BOS unless the text starts with it (tokenize_chat)


def _document_ends(text: str, documents: Sequence[str]) -> list[int]:
    """Character offsets where the (stripped) *documents* end in *text*, one place each:
    documents are taken in prompt order (each found after the one before it, else its
    first place), so that a short text (a chat reply such as "10 am") is matched where it
    stands as a document, not inside an earlier one.

    >>> _document_ends("Notes: at 10 am. Reply: 10 am", ["Notes: at 10 am.", "10 am"])
    [16, 29]
    """
    ends: list[int] = []
    cursor = 0
    for document in documents:
        needle = document.strip()
        if not needle:
            continue
        start = text.find(needle, cursor)
        if start < 0:
            start = text.find(needle)
        if start >= 0:
            ends.append(start + len(needle))
            cursor = start + len(needle)
    return sorted(set(ends))


def lay_out_text(
    prompt: TextPrompt, engine: TextModel, *, max_prompt_tokens: int, rule: CutRule | None, lead: int = 0
) -> PromptLayout:
    """*prompt* tokenized whole (markup such as ``<start_of_turn>`` as special tokens, BOS
    as ``prompt.add_bos`` says) and cut only where a state is worth keeping: at the last position *rule* allows
    at or before the end of one of its ``documents`` (and the white space after it).

    *rule* (see :func:`~percache_core.kv.cuts.measure_cut_rule`) says which cuts leave the
    engine's prefill unchanged, so the output is that of a one-call prefill, with or
    without stored states, inside or outside a framework's engine. Without documents, or
    without a rule (a build where no cut is safe), or when the detokenized tokens do not
    spell the prompt exactly, the prompt is one piece. A piece that ends at a document keeps
    its state; the last piece never does. With *lead*, the last document's end also gets a
    cut *lead* tokens before it: where a cut must leave at least *lead* tokens after it (a
    llama-server's rule), a later prompt that follows the same documents with a shorter
    question can still restore that much. Raises :class:`ContextOverflowError` when the prompt does not
    fit.
    """
    text = prompt.text
    if prompt.add_bos is None:
        tokens = engine.tokenize_chat(text)
    else:
        tokens = engine.tokenize(text, prompt.add_bos, special=True)
    if len(tokens) > max_prompt_tokens:
        raise ContextOverflowError(
            f"the prompt has {len(tokens)} tokens but only {max_prompt_tokens} fit (n_ctx "
            "minus max_new_tokens): shorten it, retrieve fewer chunks or raise n_ctx"
        )
    whole = PromptLayout((Segment("text", text, tuple(tokens), keep_state=False),))
    document_ends = _document_ends(text, prompt.documents)
    if rule is None or not document_ends:
        return whole
    data = text.encode("utf-8")
    pieces = [engine.token_bytes(token, special=True) for token in tokens]
    sizes = [len(piece) for piece in pieces]
    added, spelled = 0, sum(sizes)  # the tokens the tokenizer added before the text (BOS): those
    while spelled != len(data) and added < min(2, len(tokens)):  # whose bytes the text lacks
        spelled -= sizes[added]
        added += 1
    if spelled != len(data) or b"".join(pieces[added:]) != data:
        return whole
    boundaries: dict[int, int] = {}  # byte offset -> token index
    offset = 0
    for index in range(added, len(tokens)):
        offset += sizes[index]
        boundaries[offset] = index + 1
    at_char = _char_boundaries(text, boundaries)
    cuts = _keep_cuts(text, document_ends, at_char, len(tokens), rule, lead)
    offsets = {token: char for char, token in at_char.items()}
    segments: list[Segment] = []
    start_token, start_char = 0, 0
    for cut_token in cuts:
        cut_char = offsets[cut_token]
        piece = Segment("text", text[start_char:cut_char], tuple(tokens[start_token:cut_token]), keep_state=True)
        segments.append(piece)
        start_token, start_char = cut_token, cut_char
    segments.append(Segment("text", text[start_char:], tuple(tokens[start_token:]), keep_state=False))
    return PromptLayout(tuple(segments))


def split_at(layout: PromptLayout, cuts: Sequence[int]) -> PromptLayout:
    """A caller's prompt laid out by :func:`lay_out_text`, each piece that holds one of
    *cuts* (token positions inside it) split there, the state at each cut kept. The text is
    unchanged (each piece's text goes with the piece its end falls in).

    >>> whole = PromptLayout((Segment("text", "abcdef", (1, 2, 3, 4, 5, 6), keep_state=False),))
    >>> [(s.tokens, s.keep_state) for s in split_at(whole, [2, 4]).segments]
    [((1, 2), True), ((3, 4), True), ((5, 6), False)]
    """
    segments: list[Segment] = []
    start = 0
    for segment in layout.segments:
        stop = start + len(segment.tokens)
        edges = [start, *(c for c in cuts if start < c < stop), stop]
        for a, b in zip(edges[:-2], edges[1:-1]):
            segments.append(replace(segment, text="", tokens=segment.tokens[a - start : b - start], keep_state=True))
        segments.append(replace(segment, tokens=segment.tokens[edges[-2] - start :]))
        start = stop
    return replace(layout, segments=tuple(segments))


def with_cut(layout: PromptLayout, cut: int, rule: CutRule | None) -> PromptLayout:
    """A caller's prompt laid out by :func:`lay_out_text`, with a cut at token *cut* (a
    cut *rule* allows, where a kept or stored state ends): the pieces before it become one,
    and the later cuts stay where *rule* allows them after it. The text is unchanged (each
    piece's text goes with the piece its end falls in).

    >>> layout = PromptLayout((Segment("text", "ab", (1, 2)), Segment("text", "cd", (3, 4), keep_state=False)))
    >>> [s.tokens for s in with_cut(layout, 1, None).segments]
    [(1,), (2,), (3, 4)]
    """
    tokens, ends = layout.tokens, layout.ends
    kept_cuts = [cut]
    for end, segment in zip(ends[:-1], layout.segments):
        if end > cut and segment.keep_state and (rule is None or rule.allows(kept_cuts[-1], end, len(tokens))):
            kept_cuts.append(end)
    bounds = [0, *kept_cuts, len(tokens)]
    pieces: list[Segment] = []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        text = "".join(s.text for s, e in zip(layout.segments, ends) if start < e <= end)
        keep = 0 < index < len(bounds) - 2  # ends at a document the layout kept a state after
        pieces.append(Segment("text", text, tuple(tokens[start:end]), keep_state=keep))
    return PromptLayout(tuple(pieces), layout.dropped_chunk_ids, layout.rule)


def _char_boundaries(text: str, boundaries: dict[int, int]) -> dict[int, int]:
    """Character offsets of *text* that are token boundaries -> token index."""
    if text.isascii():  # (a character is a byte)
        return boundaries
    found: dict[int, int] = {}
    offset = 0
    for index, character in enumerate(text):
        offset += len(character.encode("utf-8"))
        token = boundaries.get(offset)
        if token is not None:
            found[index + 1] = token
    return found


def _keep_cuts(
    text: str, document_ends: list[int], at_char: dict[int, int], n_tokens: int, rule: CutRule, lead: int = 0
) -> list[int]:
    """Token indices of the cuts after documents: after a document's end and the white
    space that follows it (else at the first token boundary after its end), and *lead*
    tokens before the last of them (when given), moved back to a multiple of
    ``rule.multiple``, and only where ``rule`` allows the pieces it leaves. *at_char*:
    character offset -> token index."""
    ordered = sorted(at_char)
    wanted: set[int] = set()
    for end in document_ends:
        after_space = end + len(text[end:]) - len(text[end:].lstrip())
        for char in (after_space, end):
            if char in at_char:
                wanted.add(at_char[char])
                break
        else:
            index = bisect.bisect_left(ordered, end)
            if index < len(ordered):
                wanted.add(at_char[ordered[index]])
    if lead and wanted:  # the last document: what a later prompt may follow with a short question
        last = max(wanted)
        wanted |= {last - lead} if last > lead else set()
    cuts: list[int] = []
    for token in sorted({t // rule.multiple * rule.multiple for t in wanted}):
        if rule.allows(cuts[-1] if cuts else 0, token, n_tokens):
            cuts.append(token)
    return cuts


def chat_prompt(engine: TextModel, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> ChatPrompt:
    """(role, content) *messages* as one prompt for the assistant's reply. Without
    *template*, as stock ``llama_cpp.Llama.create_chat_completion`` lays them out (the GGUF
    file's chat template through llama-cpp-python's formatter, or its ``llama-2`` fallback
    for a file without one: :meth:`~percache_core.kv.engine.TextModel.stock_chat`), so a
    chat gives stock's text; with *template* (a llama.cpp built-in name or template text),
    in llama.cpp's own rendering of it. Roles are ``system``, ``user``, ``assistant``.
    """
    if not messages:
        raise ValueError("no messages to lay out")
    if template is None:
        return engine.stock_chat(messages)
    return ChatPrompt(engine.format_chat(messages, template=template), add_bos=None)


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
    rule: CutRule | None = None,
) -> PromptLayout:
    """Tokenize the segments of *spec*, dropping chunks so that it fits *max_prompt_tokens*;
    with the engine's cut *rule*, the prompt runs in stock's calls (:class:`PromptLayout`).

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
    return PromptLayout((first, *kept, last), tuple(dropped), rule)
