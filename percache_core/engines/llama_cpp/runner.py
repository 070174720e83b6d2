"""Running a prompt through the chunk-state tree: restore, prefill, decode, keep new states.

``PromptRunner.run`` is where PerCache's and callers' prompts meet the model (idle work's
free-form LLM calls use :func:`~percache_core.answering.completion.complete_plain`). It restores the
deepest stored prefix of the prompt's segments, prefills the rest one segment per call
(on hits and misses alike, so outputs do not depend on the cache), keeps the states of
new prefixes, and decodes. Idle work passes ``should_stop`` so that a user's question can
pre-empt it between segments or tokens; a pre-empted prefill stores nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import numpy as np

from ...config import LiveConfig, PerCacheConfig
from ...errors import PerCacheError, Preempted
from ...kv.cuts import (
    NO_CUTS,
    eval_or_stop,
    feed_calls,
    known_cut_rule,
    prefill_start_allowed,
)
from ...kv.engine import Decoding, Engine
from ...kv.tiers import TieredStateStore
from ...kv.tree import StateNode
from ...serving.live_prefix import LiveContext, call_starts
from ...serving.prompting import (
    PromptLayout,
    PromptSpec,
    TextPrompt,
    lay_out,
    lay_out_text,
    rag_prompt,
)
from ...serving.state_runner import NewState, RunOptions, RunResult, StateRunner, StopCheck
from ...types import Chunk
from . import slicing
from .answer_decoder import AnswerDecoder, complete_plain
from .state_restore import StateRestorer

logger = logging.getLogger(__name__)


class PromptRunner(StateRunner):
    """Runs prompts on an in-process *engine*, token by token, reusing and filling the
    stored chunk *states*."""

    engine: Engine

    def __init__(
        self,
        engine: Engine,
        states: TieredStateStore | None,
        config: PerCacheConfig | LiveConfig,
        *,
        budget: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(engine, states, config, budget=budget)
        self._live: LiveContext | None = None  # the prompt this runner left in the engine
        self._asked: tuple[tuple[int, ...], list[str]] | None = None  # the last user prompt: tokens, state keys
        self.restorer = StateRestorer(self)
        self.decoder = AnswerDecoder(engine, lambda: self.config)

    def run(
        self,
        layout: PromptLayout,
        options: RunOptions,
        *,
        should_stop: StopCheck | None = None,
        started: float | None = None,
    ) -> Generator[str, None, RunResult]:
        """Run the prompt *layout* (from :meth:`lay_out`) as *options* say; yields answer
        text, returns a :class:`RunResult`.

        Stored answers' token ids (``options.answer_drafts``) are verified as drafts with
        greedy decoding (the output is the same with or without them). ``options.approximate``
        takes chunks after the restored prefix from their independent [system, chunk] states
        (first ``recompute_tokens`` prefilled live; the result is marked approximate). When
        ``should_stop()`` turns true, :class:`Preempted` is raised (no new state is kept from
        an incomplete prefill). *started* (``perf_counter``) is when the request began."""
        if options.relay is not None:
            raise PerCacheError("an OpenAI request is relayed by a llama-server engine only")
        started = time.perf_counter() if started is None else started
        states = self.states if self.config.tiers.chunk_states else None
        engine = self.engine
        config = self.config
        options = replace(
            options,
            sampling=options.sampling or config.engine.sampling,
            prompt_lookup=config.engine.prompt_lookup if options.prompt_lookup is None else options.prompt_lookup,
            approximate=options.approximate and states is not None,
            recompute_tokens=config.tiers.recompute_tokens if options.recompute_tokens is None else options.recompute_tokens,
            decode=options.decode and not options.prefix_only,
        )
        with engine.lock:
            self.flush()  # the states earlier runs took are stored before any lookup
            live = self._live if self._live is not None and self._live.changes == engine.changes else None
            if options.restore_depth is not None:  # stored states only (calibration, the exactness sweep)
                live = None
            layout, kept = self.restorer.reuse_point(layout, states, live)
            segments = [list(s.tokens) for s in layout.segments]
            keys = self._keys(layout, states)
            if options.restore_depth is not None:  # as if the path were new past that depth
                keys = keys[: options.restore_depth]
            elif not options.idle:
                self._asked = (tuple(layout.tokens), keys)
            if options.prefix_only:
                segments = segments[:-1]
            result = RunResult(layout)
            previous, self._live = self._live, None  # unknown until this prefill is complete
            with states.pinned(keys) if states is not None else nullcontext():
                yield from self._run_segments(result, segments, keys, options, should_stop, started, kept, previous)
            if states is not None and states.bytes > self.budget_bytes:
                self.evict_to_budget()  # the budget was lowered: new states evict on their own
        return result

    def reinstate_asked(self) -> int:
        """The last user prompt's deepest stored prefix back in the engine as its live
        context, where idle work replaced it (stock keeps its last prompt: a next question
        that shares it keeps it instead of restoring it); the tokens reinstated."""
        if self._asked is None or self.states is None:
            return 0
        with self.engine.lock:
            self.flush()  # its states are stored
            if self._live is None or self._live.changes != self.engine.changes:
                self._live = self.restorer.reinstate(*self._asked)
                return len(self._live.tokens) if self._live is not None else 0
            return 0

    @property
    def reach(self) -> int:
        """The deepest a chunk state may end on this engine, in tokens: what its start-up
        round trip proved restores exactly (:func:`~percache_core.engines.llama_cpp.slicing.state_layout`;
        0 before it ran). Deeper states are neither kept nor restored."""
        layout = slicing.known_state_layout(self.engine)
        return layout.reach if layout is not None else 0

    def stored_prefixes(self, keys: Sequence[str]) -> list[StateNode]:
        """The stored prefixes among *keys* within :attr:`reach`, deepest first."""
        if not keys or self.states is None:
            return []
        reach = self.reach
        return [node for node in self.states.candidates(keys, budget_bytes=self.budget_bytes) if node.n_tokens <= reach]

    def bytes_per_token(self) -> float:
        """The bytes a stored state slice takes per token on the engine, measured once."""
        return slicing.state_bytes_per_token(self.engine)

    def complete_plain(
        self, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
    ) -> tuple[str, int, int]:
        """Idle work's LLM calls, with nothing reused (see :func:`complete_plain`)."""
        return complete_plain(self.engine, prompt, decoding, chat=chat, should_stop=should_stop)

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
        keeping, within the cuts that leave the engine's prefill unchanged (measured once, as
        idle work: :func:`~percache_core.kv.cuts.measure_cut_rule`). Until that rule is
        known every prompt runs in one call, stock's, cut nowhere: an answer never waits for
        a self-check."""
        engine = self.engine
        spec = spec or rag_prompt(self.config.retrieval.system_prompt, chunks, question)
        max_prompt_tokens = engine.n_ctx - max_new_tokens
        measured, rule = known_cut_rule(engine)
        if isinstance(spec, TextPrompt):
            # a cut is a call: only where a state is kept, under the measured rule
            cut = bool(spec.documents) and self.config.tiers.chunk_states and measured
            rule = rule if cut else None
            layout = lay_out_text(spec, engine, max_prompt_tokens=max_prompt_tokens, rule=rule)
            # prefilled in stock's calls (the cuts are the rule's), its states taken afterwards
            return replace(layout, rule=rule) if len(layout.segments) > 1 else layout
        # PerCache's own prompt runs in stock's calls where the engine has a cut rule (the
        # self-check runs once per build and model; its verdict is kept on disk)
        return lay_out(spec, tokenize=engine.tokenize, max_prompt_tokens=max_prompt_tokens, rule=rule if measured else NO_CUTS)

    def _run_segments(
        self,
        result: RunResult,
        segments: list[list[int]],
        keys: list[str],
        options: RunOptions,
        should_stop: StopCheck | None,
        started: float,
        kept: int = 0,
        previous: LiveContext | None = None,
    ) -> Generator[str, None, None]:
        """Restore or keep the prompt's known prefix (*kept* tokens of the *previous*
        prompt in the context), prefill the rest, decode, keep the new states."""
        engine = self.engine
        timings = result.timings
        bound = self.decoder.draft_bound(options) if options.decode else None
        clock = time.perf_counter()
        depth, reused = self._restore_known(result, segments, keys, kept, previous)
        timings["restore"] = time.perf_counter() - clock
        clock = time.perf_counter()
        new_states: list[NewState] = []
        prompt = [t for segment in segments for t in segment]
        pending, starts = self._prefill_rest(result, segments, keys, options, should_stop, new_states)
        result.prefilled_tokens = sum(len(s) for s in segments) - reused - result.moved_tokens
        if result.live_tokens and previous is not None:  # the kept part was computed by the previous calls
            starts = [s for s in previous.starts if s < reused] + [s for s in starts if s >= reused]
        if options.keep_logits:
            result.next_token_logits = np.array(engine.last_logits(), copy=True)
        timings["prefill"] = time.perf_counter() - clock
        try:
            if options.decode:
                rebuild = self._rebuilder(result, segments, keys, options)
                yield from self.decoder.decode(result, options, should_stop, started, bound, rebuild)
        finally:
            # The prefill is complete, so its states are whole whatever happened while
            # decoding; they are taken after the answer, while the sequence still holds the
            # prompt, and written by the writer thread, so that they do not delay it.
            if not result.approximate:  # the next prompt may keep what this one prefilled
                self._live = LiveContext(tuple(prompt), tuple(starts), engine.changes)
            clock = time.perf_counter()
            pending = [index for index in pending if result.layout.state_point(index) <= self.reach]
            if pending and not result.approximate:
                new_states = taken_states(engine, self.states, result.layout, keys, new_states, pending)
            if new_states:
                layout, idle = result.layout, options.idle
                self.writer.submit(lambda: self._keep_states(layout, keys, new_states, idle=idle))
            timings["store_states"] = time.perf_counter() - clock

    def _restore_known(
        self, result: RunResult, segments: list[list[int]], keys: list[str], kept: int, previous: LiveContext | None
    ) -> tuple[int, int]:
        """Bring the sequence to the prompt's known prefix (*kept* tokens of the *previous*
        prompt, or a stored state) and note it in *result*: (segments, tokens) in place."""
        end = sum(len(segment) for segment in segments)
        depth, reused, from_context = self.restorer.keep_or_restore(result.layout, keys, kept, previous, end)
        result.depth, result.reused_tokens = depth, reused
        result.live_tokens = reused if from_context else 0
        if keys:
            idle = [
                index for index in range(1, depth)
                if (node := self.states.tree.get(keys[index])) is not None and node.idle
            ]  # fmt: skip
            result.idle_reused_chunks = len(idle)
            result.idle_reused_tokens = sum(len(segments[index]) for index in idle)
        return depth, reused

    def _prefill_rest(
        self,
        result: RunResult,
        segments: list[list[int]],
        keys: list[str],
        options: RunOptions,
        should_stop: StopCheck | None,
        new_states: list[NewState],
    ) -> tuple[list[int], list[int]]:
        """Prefill the prompt from the restored depth to its end: in stock's calls (its
        states taken afterwards: the pending segment indices), one call per segment where
        chunks are composed (an approximate run), or one call per segment. Returns the
        pending indices and where each call started."""
        engine, layout, depth = self.engine, result.layout, result.depth
        prompt = [t for segment in segments for t in segment]
        composing = options.approximate and any(
            node is not None and (options.recompute_tokens or 0) < node.n_tokens - len(segments[0])
            for node in (self.restorer.independent_state(layout, segments, i) for i in range(depth, len(segments)))
        )  # some chunk would be moved in, not all of it recomputed
        if layout.stock_calls and not composing:
            pending, starts = self._prefill_in_stock_calls(result, prompt, keys, options, should_stop, new_states)
            return pending, [0, *starts]
        if layout.stock_calls:  # composed chunks: one call per segment, an approximate run
            held = sum(1 for end in layout.ends[: len(segments)] if end <= engine.n_past)  # whole segments in place
            if held < len(segments) and engine.n_past > (layout.ends[held - 1] if held else 0):
                eval_to(self.engine, prompt, layout.ends[held], should_stop)  # the rest of a segment begun
                held += 1
            self._prefill(result, segments, keys, held, options, should_stop, None)
            result.approximate = True  # not stock's calls, whatever was composed
        else:
            self._prefill(result, segments, keys, depth, options, should_stop, new_states)
        return [], call_starts(engine, [len(segment) for segment in segments], ends_prompt=not options.prefix_only)

    def _prefill(
        self,
        result: RunResult,
        segments: list[list[int]],
        keys: list[str],
        depth: int,
        options: RunOptions,
        should_stop: StopCheck | None,
        new_states: list[NewState] | None,
    ) -> None:
        """Prefill *segments* from *depth* on (after a restore of *depth* segments), one
        call per segment; collect the states of new prefixes into *new_states* (states
        after an approximately reused chunk are never kept)."""
        engine = self.engine
        parent = self.restorer.stored_parent(keys, depth)  # the prefix a new slice follows
        for index in range(depth, len(segments)):
            if should_stop is not None and should_stop():
                raise Preempted("prefill pre-empted by a user question")
            expected = engine.n_past + len(segments[index])
            independent = self.restorer.independent_state(result.layout, segments, index) if options.approximate else None
            if independent is not None:
                assert options.recompute_tokens is not None  # resolved by run()
                moved = self.restorer.compose(
                    independent, segments[index], options.recompute_tokens, len(segments[0])
                )
                result.moved_tokens += moved
                result.approximate = result.approximate or moved > 0
            else:
                last = index == len(segments) - 1 and not options.prefix_only  # a prefix run's end is a cut
                engine.eval(segments[index], should_stop, ends_prompt=last)
            if engine.n_past != expected:
                raise Preempted("prefill pre-empted by a user question")
            keep = index < len(keys) and result.layout.segments[index].keep_state
            if new_states is None or result.approximate or not keep:
                continue
            if keys[index] not in self.states:
                parent = saved_now(self, index, keys[index], parent, new_states)
            parent = (keys[index], engine.n_past)

    def _prefill_in_stock_calls(
        self,
        result: RunResult,
        prompt: list[int],
        keys: list[str],
        options: RunOptions,
        should_stop: StopCheck | None,
        new_states: list[NewState],
    ) -> tuple[list[int], list[int]]:
        """Prefill the prompt from where the sequence is (a restored or kept
        state point) to its end in stock's calls: one call of at most ``n_batch`` tokens
        after another, cut only where the engine's rule allows, so the output is stock
        llama.cpp's. The states of new prefixes are taken at their state points after the
        answer (:func:`taken_states`); only a state whose sliding-window cells the rest of
        the prompt would push out is saved on the way (a cut there changes nothing under
        the rule). Returns the segment indices whose states are to be taken afterwards, and
        where each call started."""
        engine, states, layout = self.engine, self.states, result.layout
        wanted = [
            index for index in range(len(keys))
            if layout.segments[index].keep_state and keys[index] not in states
            and layout.state_point(index) > engine.n_past
        ] if states is not None else []
        window = getattr(engine, "n_swa", 0)
        end_of_answer = len(prompt) + (options.max_new_tokens if options.decode else 0)
        early, last_cut = [], engine.n_past  # states saved on the way, and the last cut made
        assert layout.rule is not None  # stock_calls
        least = layout.rule.min_tokens
        allowed = partial(prefill_start_allowed, n_tokens=len(prompt), n_batch=engine.n_batch, least=least)
        for index in wanted:
            point = layout.state_point(index)
            if window and point < end_of_answer - window and point - last_cut >= least and allowed(point):
                early.append(index)  # a cut there leaves pieces the rule allows (stock's short last call kept)
                last_cut = point
        parent = self.restorer.stored_parent(keys, result.depth)
        starts: list[int] = []
        for index in early:  # a cut at each (allowed by the rule), its state saved now
            starts += eval_to(self.engine, prompt, layout.state_point(index), should_stop)
            parent = saved_now(self, index, keys[index], parent, new_states)
        # to the prompt's end in stock's calls (a prefix run's end is a cut: the question follows)
        starts += eval_to(self.engine, prompt, len(prompt), should_stop, ends_prompt=not options.prefix_only)
        return [i for i in wanted if i not in early], starts

    def _rebuilder(
        self, result: RunResult, segments: list[list[int]], keys: list[str], options: RunOptions
    ) -> Callable[[], None]:
        """A function that brings the sequence back to the end of the prompt (restore the
        deepest stored prefix, prefill the rest as the first time), for when it cannot be
        cut back exactly."""

        def rebuild() -> None:
            layout = result.layout
            candidates = self.stored_prefixes(keys)
            if layout.stock_calls and not options.approximate:
                # what the context held is gone: stored states only, then stock's calls
                end = sum(map(len, segments))
                self.restorer.restore_or_reset(keys, self.restorer.usable(layout, keys, candidates, end))
                eval_to(self.engine, [t for segment in segments for t in segment], end, None, ends_prompt=True)
                return
            depth, _ = self.restorer.restore_or_reset(keys, candidates)
            again = RunResult(layout)
            self._prefill(again, segments, keys, depth, replace(options, keep_logits=False), None, None)

        return rebuild


def eval_to(
    engine: Engine, prompt: list[int], end: int, should_stop: StopCheck | None, *, ends_prompt: bool = False
) -> list[int]:
    """Prefill *prompt* from *engine*'s sequence end to *end* (pre-empted:
    :class:`Preempted`), which *ends_prompt* or is a cut in it, in the calls of
    :func:`~percache_core.kv.cuts.feed_calls` (each fed as one call of its own); where they
    started."""
    calls = feed_calls(engine, engine.n_past, end, ends_prompt=ends_prompt)
    for call_start, call_end in calls:
        eval_or_stop(engine, prompt[call_start:call_end], should_stop)
    return [call_start for call_start, _ in calls]


def saved_now(
    runner: PromptRunner, index: int, key: str, parent: tuple[str, int], new_states: list[NewState]
) -> tuple[str, int]:
    """Save the state *runner*'s sequence ends with now as segment *index*'s (*key*) into
    *new_states*: a slice after *parent* (key, tokens) where slices are kept and there is
    one, else whole. Returns it as the parent of the next."""
    engine, states = runner.engine, runner.states
    assert states is not None
    parent_key, start = parent
    if engine.n_past > runner.reach:  # not proved to restore exactly (nor any deeper one)
        return parent
    data = engine.save_slice(start) if states.slices and start else engine.save_state()
    new_states.append(NewState(index, parent_key or states.root_key, data, engine.n_past))
    return key, engine.n_past


def taken_states(
    engine: Engine, states: TieredStateStore, layout: PromptLayout, keys: list[str], saved: list[NewState], pending: list[int]
) -> list[NewState]:
    """*saved* and the states of the *pending* segments, taken from *engine*'s sequence at
    their state points (it still holds the prompt's KV; the answer's tokens come after it),
    parents first; the deeper ones are left out after one that the sequence no longer holds
    whole."""
    found = {new.index: new for new in saved}
    parent: tuple[str, int] = ("", 0)
    for index in range(len(keys)):
        node = states.tree.get(keys[index])
        if node is not None:
            parent = (keys[index], node.n_tokens)
        elif index in found:
            parent = (keys[index], found[index].n_tokens)
        elif index in pending:
            point = layout.state_point(index)
            start = parent[1] if states.slices else 0
            data = engine.save_prefix(point, start)
            if data is None:
                break
            found[index] = NewState(index, parent[0] or states.root_key, data, point)
            parent = (keys[index], point)
    return [found[index] for index in sorted(found)]
