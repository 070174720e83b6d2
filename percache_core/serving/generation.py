"""Running a prompt through the chunk-state tree: restore, prefill, decode, keep new states.

``PromptRunner.run`` is the one place where prompts meet the model. It restores the
deepest stored prefix of the prompt's segments, prefills the rest one segment per call
(on hits and misses alike, so outputs do not depend on the cache), keeps the states of
new prefixes, and decodes. Idle work passes ``should_stop`` so that a user's question can
pre-empt it between segments or tokens; a pre-empted prefill stores nothing.
"""

from __future__ import annotations

import codecs
import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np

from ..config import PerCacheConfig
from ..errors import PerCacheError, StorageWriteError
from ..kv.engine import Engine, Sampling
from ..kv.pieces import exact_pieces
from ..kv.tiers import TieredStateStore
from ..kv.tree import StateNode, path_keys
from ..prediction.budget import BUDGET_FLOOR_BYTES
from ..types import Chunk
from .drafting import (
    AnswerDraft,
    DraftSource,
    DraftStats,
    PromptLookup,
    SequenceLost,
    deviation_bound,
    greedy_tokens,
    known_bound,
    known_drafts_pay,
)
from .prompting import (
    PromptLayout,
    PromptSpec,
    TextPrompt,
    chunk_text,
    lay_out,
    lay_out_text,
    rag_prompt,
    system_text,
)
from .stopping import StopStringFilter
from .streaming import drain

logger = logging.getLogger(__name__)

StopCheck = Callable[[], bool]


class Preempted(PerCacheError):
    """Idle work stopped because a user's question is waiting."""


@dataclass
class RunResult:
    """What one prompt run did."""

    layout: PromptLayout
    text: str = ""
    depth: int = 0  # segments restored
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # decoded ids, end of generation included
    drafts: DraftStats = field(default_factory=DraftStats)
    next_token_logits: np.ndarray | None = None  # after the prompt, when asked for (keep_logits)
    moved_tokens: int = 0  # chunk tokens taken from independent states (approximate reuse)
    approximate: bool = False  # some chunk was reused approximately: may differ from cache-off
    idle_reused_chunks: int = 0  # of the restored chunks, those whose states idle work stored

    @property
    def reused_chunks(self) -> int:
        return max(0, self.depth - 1)


@dataclass(frozen=True)
class _NewState:
    """A prefix state saved during a prefill, stored after the answer."""

    index: int  # its last segment
    parent_key: str  # the nearest stored (or newly saved) shorter prefix, or the root key
    data: bytes  # whole, or with slices only the positions after the parent's
    n_tokens: int


@dataclass(frozen=True)
class _Prefill:
    """How one run prefills."""

    keep_logits: bool = False
    approximate: bool = False  # compose chunks from independent states (reuse="approximate")
    recompute_tokens: int = 0  # of each composed chunk, prefilled live
    idle: bool = False  # the states kept are idle work's (StateNode.idle)


@dataclass(frozen=True)
class _Decoding:
    """How one run decodes."""

    max_new_tokens: int
    sampling: Sampling
    prompt_lookup: bool
    stop: Sequence[str] | None
    answer_drafts: Sequence[Sequence[int]]
    trim: bool  # drop white space around the answer (else llama.cpp's text as decoded)

    @property
    def drafting(self) -> bool:
        """Whether decoding verifies drafts (greedy only; sampling decodes one at a time)."""
        return self.sampling.temperature == 0 and (self.prompt_lookup or bool(self.answer_drafts))


class PromptRunner:
    """Runs prompts on *engine*, reusing and filling the stored chunk *states*."""

    def __init__(self, engine: Engine, states: TieredStateStore | None, config: PerCacheConfig) -> None:
        self.engine = engine
        self.states = states
        self.config = config
        # the chunk-state budget in force (the configured one, or the one ModelRuntime
        # sized from the knowledge)
        self.budget_bytes = config.chunk_state_budget_bytes or BUDGET_FLOOR_BYTES
        self.restore_failures = 0
        self.storage_failures = 0

    def run(
        self,
        question: str,
        chunks: Sequence[Chunk],
        *,
        spec: PromptSpec | TextPrompt | None = None,
        layout: PromptLayout | None = None,
        stop: Sequence[str] | None = None,
        max_new_tokens: int,
        decode: bool = True,
        should_stop: StopCheck | None = None,
        started: float | None = None,
        prefix_only: bool = False,
        answer_drafts: Sequence[Sequence[int]] = (),
        sampling: Sampling | None = None,
        prompt_lookup: bool | None = None,
        keep_logits: bool = False,
        approximate: bool = False,
        trim: bool = True,
        idle: bool = False,
    ) -> Generator[str, None, RunResult]:
        """Run [system, *chunks, question]; yields answer text, returns a :class:`RunResult`.

        *spec* replaces PerCache's own prompt: segments of a caller's template
        (:class:`PromptSpec`) or a finished prompt string (:class:`TextPrompt`); *layout*
        is the prompt already laid out by :meth:`lay_out`.
        *answer_drafts* (token ids of stored answers) are verified as drafts with greedy
        decoding; the output is the same with or without them. *sampling* and
        *prompt_lookup* replace the configured ones.

        With ``decode=False`` only the prefill runs (to populate chunk states); with
        ``prefix_only=True`` the question is not prefilled either. With ``keep_logits`` a
        copy of the logits after the prompt is kept in the result. With *approximate*
        (``reuse="approximate"``), chunks after the restored prefix are taken from their
        independent [system, chunk] states where stored (their first
        ``recompute_tokens`` prefilled live); the result is then marked approximate. When
        ``should_stop()`` turns true, :class:`Preempted` is raised and, if the prefill was
        not complete, no new state is kept. With *trim* the white space around the answer
        is dropped; without, the text is llama.cpp's as decoded, up to the first stop string.
        *idle* marks the states it keeps as idle work's (``StateNode.idle``), so that
        answers can tell what prediction saved them.
        """
        started = time.perf_counter() if started is None else started
        states = self.states if self.config.chunk_states else None
        engine = self.engine
        config = self.config
        sampling = sampling or config.sampling
        lookup = config.prompt_lookup if prompt_lookup is None else prompt_lookup
        if layout is None:
            layout = self.lay_out(question, chunks, spec=spec, max_new_tokens=max_new_tokens)
        with engine.lock:
            segments = [list(s.tokens) for s in layout.segments]
            keys = path_keys(states.root_key, segments[:-1]) if states is not None else []
            if prefix_only:
                segments, decode = segments[:-1], False
            result = RunResult(layout)
            decoding = _Decoding(max_new_tokens, sampling, lookup, stop, answer_drafts, trim)
            prefill = _Prefill(keep_logits, approximate and states is not None, config.recompute_tokens, idle)
            with states.pinned(keys) if states is not None else nullcontext():
                yield from self._run_segments(result, segments, keys, decode, should_stop, started, decoding, prefill)
            if states is not None and states.bytes > self.budget_bytes:
                self.evict_to_budget()  # the budget was lowered: new states evict on their own
        return result

    def lay_out(
        self,
        question: str,
        chunks: Sequence[Chunk],
        *,
        spec: PromptSpec | TextPrompt | None = None,
        max_new_tokens: int,
    ) -> PromptLayout:
        """The pieces *run* feeds for this prompt: PerCache's own [system, *chunks,
        question] or *spec*. A finished prompt string is cut only where a state is worth
        keeping, within the cuts that leave the engine's prefill unchanged (measured once,
        see :func:`~percache_core.kv.pieces.exact_pieces`)."""
        engine = self.engine
        spec = spec or rag_prompt(self.config.system_prompt, chunks, question)
        max_prompt_tokens = engine.n_ctx - max_new_tokens
        if isinstance(spec, TextPrompt):
            rule = exact_pieces(engine) if spec.documents else None  # no documents: one piece
            return lay_out_text(spec, engine, max_prompt_tokens=max_prompt_tokens, rule=rule)
        return lay_out(spec, tokenize=engine.tokenize, max_prompt_tokens=max_prompt_tokens)

    def _draft_bound(self, decoding: _Decoding) -> float | None:
        """The lead a batched logit needs for drafts to be verified (None: decode one token
        at a time). ``draft_decoding="auto"`` drafts only where the engine's self-check
        (run by ``preload()`` and idle rounds, never inside an answer) measured the bound
        and found that batches pay; "on" measures the bound on first use; "off" never."""
        mode = self.config.draft_decoding
        if not decoding.drafting or mode == "off":
            return None
        if mode == "on":
            return deviation_bound(self.engine)
        return known_bound(self.engine) if known_drafts_pay(self.engine) else None

    def _run_segments(
        self,
        result: RunResult,
        segments: list[list[int]],
        keys: list[str],
        decode: bool,
        should_stop: StopCheck | None,
        started: float,
        decoding: _Decoding,
        prefill: _Prefill,
    ) -> Generator[str, None, None]:
        engine = self.engine
        timings = result.timings
        bound = self._draft_bound(decoding) if decode else None
        clock = time.perf_counter()
        depth, reused = self._restore_or_reset(keys)
        result.depth, result.reused_tokens = depth, reused
        result.idle_reused_chunks = sum(
            1 for key in keys[1:depth] if (node := self.states.tree.get(key)) is not None and node.idle
        )
        timings["restore"] = time.perf_counter() - clock

        clock = time.perf_counter()
        new_states: list[_NewState] = []
        self._prefill(result, segments, keys, depth, prefill, should_stop, new_states)
        result.prefilled_tokens = sum(len(s) for s in segments) - reused - result.moved_tokens
        if prefill.keep_logits:
            result.next_token_logits = np.array(engine.last_logits(), copy=True)
        timings["prefill"] = time.perf_counter() - clock
        try:
            if decode:
                rebuild = self._rebuilder(result, segments, keys, prefill)
                yield from self._decode(result, decoding, should_stop, started, bound, rebuild)
        finally:
            # The prefill is complete, so its states are whole whatever happened while
            # decoding; they are written after the answer so that they do not delay it.
            clock = time.perf_counter()
            self._keep_states(result.layout, keys, new_states, idle=prefill.idle)
            timings["store_states"] = time.perf_counter() - clock

    def _prefill(
        self,
        result: RunResult,
        segments: list[list[int]],
        keys: list[str],
        depth: int,
        prefill: _Prefill,
        should_stop: StopCheck | None,
        new_states: list[_NewState] | None,
    ) -> None:
        """Prefill *segments* from *depth* on (after a restore of *depth* segments), one
        call per segment; collect the states of new prefixes into *new_states* (states
        after an approximately reused chunk are never kept)."""
        engine = self.engine
        parent = (keys[depth - 1], engine.n_past) if depth else ("", 0)  # the prefix a new slice follows
        for index in range(depth, len(segments)):
            if should_stop is not None and should_stop():
                raise Preempted("prefill pre-empted by a user question")
            expected = engine.n_past + len(segments[index])
            independent = self._independent_state(result.layout, segments, index) if prefill.approximate else None
            if independent is not None:
                moved = self._prefill_approximately(independent, segments[index], prefill.recompute_tokens)
                result.moved_tokens += moved
                result.approximate = result.approximate or moved > 0
            else:
                engine.eval(segments[index], should_stop)
            if engine.n_past != expected:
                raise Preempted("prefill pre-empted by a user question")
            keep = index < len(keys) and result.layout.segments[index].keep_state
            if new_states is None or result.approximate or not keep:
                continue
            if keys[index] not in self.states:
                parent_key, start = parent
                data = engine.save_slice(start) if self.states.slices and start else engine.save_state()
                new_states.append(_NewState(index, parent_key or self.states.root_key, data, engine.n_past))
            parent = (keys[index], engine.n_past)

    def _independent_state(self, layout: PromptLayout, segments: list[list[int]], index: int) -> StateNode | None:
        """The stored [system, chunk] state of chunk segment *index* (index >= 2: the first
        chunk's is an exact prefix, restored as such), or None."""
        if self.states is None or index < 2 or layout.segments[index].kind != "chunk":
            return None
        if layout.segments[0].kind != "system":
            return None
        key = path_keys(self.states.root_key, [segments[0], segments[index]])[1]
        return self.states.tree.get(key)

    def _prefill_approximately(self, node: StateNode, tokens: list[int], recompute: int) -> int:
        """Prefill a chunk segment of *tokens* from its independent [system, chunk] state
        *node*: its first *recompute* tokens live (they see the real context before them),
        the rest moved in from the state. Falls back to a live prefill of the rest when the
        state cannot be used. Returns the tokens moved in."""
        engine = self.engine
        head = min(recompute, len(tokens))
        if head:
            engine.eval(tokens[:head])
        if head == len(tokens):
            return 0
        data = self.states.get(node)
        start = node.n_tokens - len(tokens) + head  # where the rest begins in the stored state
        if data is None or not engine.append_moved(data, node.n_tokens, start):
            engine.eval(tokens[head:])
            return 0
        self.states.record_use(node)
        return len(tokens) - head

    def _rebuilder(
        self, result: RunResult, segments: list[list[int]], keys: list[str], prefill: _Prefill
    ) -> Callable[[], None]:
        """A function that brings the sequence back to the end of the prompt (restore the
        deepest stored prefix, prefill the rest as the first time), for when it cannot be
        cut back exactly."""

        def rebuild() -> None:
            depth, _ = self._restore_or_reset(keys)
            again = RunResult(result.layout)
            self._prefill(again, segments, keys, depth, replace(prefill, keep_logits=False), None, None)

        return rebuild

    def _decode(
        self,
        result: RunResult,
        decoding: _Decoding,
        should_stop: StopCheck | None,
        started: float,
        bound: float | None,
        rebuild: Callable[[], None],
    ) -> Generator[str, None, None]:
        clock = time.perf_counter()
        stop = StopStringFilter(self.config.stop if decoding.stop is None else decoding.stop, strip=decoding.trim)
        max_new_tokens = decoding.max_new_tokens

        def count_token(token: int) -> None:
            result.tokens.append(token)
            if self.engine.is_end_of_generation(token):
                return
            result.generated_tokens += 1
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started

        if bound is None:
            tokens = self.engine.generate(max_new_tokens=max_new_tokens, sampling=decoding.sampling)
        else:
            sources: list[DraftSource] = [AnswerDraft(decoding.answer_drafts)]
            if decoding.prompt_lookup:
                prompt = [t for segment in result.layout.segments for t in segment.tokens]
                sources.append(PromptLookup(prompt))
            tokens = self._greedy_with_drafts(result, max_new_tokens, sources, bound, should_stop, rebuild)
        yield from decode_text(self.engine, tokens, stop, should_stop, count_token)
        result.text = stop.text.strip() if decoding.trim else stop.text
        result.timings["decode"] = time.perf_counter() - clock

    def _greedy_with_drafts(
        self,
        result: RunResult,
        max_new_tokens: int,
        sources: list[DraftSource],
        bound: float,
        should_stop: StopCheck | None,
        rebuild: Callable[[], None],
    ) -> Iterator[int]:
        """Greedy tokens with drafts; if the sequence is lost, rebuild it and go on."""
        produced: list[int] = []
        replay: list[int] = []
        while True:
            try:
                for token in greedy_tokens(
                    self.engine,
                    max_new_tokens=max_new_tokens,
                    drafts=sources,
                    bound=bound,
                    should_stop=should_stop,
                    stats=result.drafts,
                    replay=replay,
                ):
                    produced.append(token)
                    yield token
                return
            except SequenceLost:
                logger.debug("draft decoding lost the sequence after %d tokens: rebuilt", len(produced))
                rebuild()
                replay = list(produced)

    def prefill_prefix(self, chunks: Sequence[Chunk], *, should_stop: StopCheck | None = None) -> int:
        """Prefill [system, *chunks] and keep its states, with no question and no decode
        (idle-time population of the tree); returns the tokens prefilled (0 when stored)."""
        events = self.run("", chunks, max_new_tokens=1, prefix_only=True, should_stop=should_stop, idle=True)
        return drain(events).prefilled_tokens

    def path_is_stored(self, question: str, chunks: Sequence[Chunk], max_new_tokens: int) -> bool:
        """Whether the full [system, *chunks] prefix of this prompt has a stored state."""
        layout = self.lay_out(question, chunks, max_new_tokens=max_new_tokens)
        keys = path_keys(self.states.root_key, [list(s.tokens) for s in layout.segments[:-1]])
        return keys[-1] in self.states

    def stored_order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """*chunks* reordered to follow the deepest stored path of PerCache's prompt: at each
        position, a chunk whose prefix state is stored comes first; the rest keep their order."""
        tokenize = self.engine.tokenize
        parent = path_keys(self.states.root_key, [tokenize(system_text(self.config.system_prompt), True)])[0]
        remaining = list(chunks)
        ordered: list[Chunk] = []
        while remaining and parent in self.states:
            for chunk in remaining:
                key = path_keys(parent, [tokenize(chunk_text(chunk), False)])[0]
                if key in self.states:
                    ordered.append(chunk)
                    remaining.remove(chunk)
                    parent = key
                    break
            else:
                break
        return ordered + remaining

    def _restore_or_reset(self, keys: list[str]) -> tuple[int, int]:
        """Restore the deepest usable stored prefix of *keys*, or empty the sequence when
        none is stored: (segments, tokens) restored."""
        depth, reused = self._restore(keys) if keys else (0, 0)
        if depth == 0:
            self.engine.reset()
        return depth, reused

    def _restore(self, keys: list[str]) -> tuple[int, int]:
        """Restore the deepest usable stored prefix of *keys* (from any tier):
        (segments, tokens) restored."""
        for node in self.states.candidates(keys, budget_bytes=self.budget_bytes):
            chain = self.states.chain(node)
            if chain is None:
                continue  # a slice whose ancestor was evicted: a shorter prefix may do
            restored = self._restore_chain(chain)
            if restored is not None:
                return restored.depth, restored.n_tokens
        return 0, 0

    def _restore_chain(self, chain: list[StateNode]) -> StateNode | None:
        """Load the first state of *chain* and append the others' slices; the deepest node
        restored (the sequence then holds exactly its prefix), or None. A state that cannot
        be read or restored is dropped (and counted); the prefix before it stays."""
        restored: StateNode | None = None
        for node in chain:
            data = self.states.get(node)
            if restored is None:
                loaded = data is not None and self.engine.load_state(data, node.n_tokens)
            else:
                loaded = data is not None and self.engine.append_slice(data, node.n_tokens)
            if not loaded:
                logger.warning("chunk state %s could not be restored: treated as a miss", node.key)
                self.states.delete(node.key)
                self.restore_failures += 1
                break
            self.states.record_use(node)
            restored = node
        return restored

    def _keep_states(
        self, layout: PromptLayout, keys: list[str], new_states: list[_NewState], *, idle: bool = False
    ) -> None:
        """Store the states of new prefixes, parents first (as complete nodes: file, record,
        tree). A failed write (disk full, read-only) is logged and counted, and the deeper
        ones are not stored (their slices would lack a parent); the answer is kept."""
        segments = layout.segments
        for new in new_states:
            index = new.index
            label = segments[index].chunk_id or segments[index].kind
            node = StateNode(keys[index], new.parent_key, index + 1, new.n_tokens, label, len(new.data), idle=idle)
            try:
                self.states.put(node, new.data, budget_bytes=self.budget_bytes)
            except StorageWriteError as error:
                self.storage_failures += 1
                logger.warning("chunk state not stored (%s); the answer is unaffected", error)
                return

    def evict_to_budget(self) -> None:
        """Evict least frequently used unpinned leaves down to the chunk-state budget."""
        self.states.evict_to(self.budget_bytes)


def decode_text(
    engine: Engine,
    tokens: Iterator[int],
    stop: StopStringFilter,
    should_stop: StopCheck | None,
    on_token: Callable[[int], None],
) -> Generator[str, None, None]:
    """Turn decoded *tokens* into text, yielding what *stop* lets through (held back while
    it may begin a stop string); *on_token* sees every token, end of generation included.
    Raises :class:`Preempted` when *should_stop* turns true."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        for token in tokens:
            on_token(token)
            if engine.is_end_of_generation(token):
                break
            shown = stop.feed(decoder.decode(engine.token_bytes(token)))
            if shown:
                yield shown
            if stop.stopped:
                break
            if should_stop is not None and should_stop():
                raise Preempted("decoding pre-empted by a user question")
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
    tail = stop.finish()
    if tail:
        yield tail
