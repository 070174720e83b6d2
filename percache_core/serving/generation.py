"""Running a prompt through the chunk-state tree: restore, prefill, decode, keep new states.

``PromptRunner.run`` is where PerCache's and callers' prompts meet the model (idle work's
free-form LLM calls use :func:`~percache_core.serving.completion.complete_plain`). It restores the
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
from dataclasses import replace

import numpy as np

from ..config import LiveConfig, PerCacheConfig
from ..errors import PerCacheError
from ..kv.cuts import CutRule, batch_bounds, known_cut_rule, measure_cut_rule
from ..kv.engine import Decoding, Engine
from ..kv.stopping import StopStringFilter
from ..kv.tiers import TieredStateStore
from ..kv.tree import StateNode, path_keys, prefix_keys
from ..types import Chunk
from .drafting import (
    AnswerDraft,
    DraftPlan,
    DraftSource,
    PromptLookup,
    SequenceLost,
    deviation_bound,
    greedy_tokens,
    known_bound,
    known_drafts_pay,
)
from .live_prefix import LiveContext, call_starts, segment_cut, text_cut
from .prompting import (
    PromptLayout,
    PromptSpec,
    TextPrompt,
    lay_out,
    lay_out_text,
    rag_prompt,
    with_cut,
)
from .state_runner import NewState, Preempted, RunOptions, RunResult, StateRunner, StopCheck

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
        greedy decoding; the output is the same with or without them. With
        ``options.approximate`` (``reuse="approximate"``), chunks after the restored prefix
        are taken from their independent [system, chunk] states where stored (their first
        ``recompute_tokens`` prefilled live); the result is then marked approximate. When
        ``should_stop()`` turns true, :class:`Preempted` is raised and, if the prefill was
        not complete, no new state is kept. *started* (``time.perf_counter()``) is when the
        request began, for the time to first token.
        """
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
            layout, kept = self._reuse_point(layout, states)
            segments = [list(s.tokens) for s in layout.segments]
            keys = self._keys(layout, states)
            if options.restore_depth is not None:  # (calibrating composed states: as if the path were new)
                keys, kept = keys[: options.restore_depth], 0
            if options.prefix_only:
                segments = segments[:-1]
            result = RunResult(layout)
            previous, self._live = self._live, None  # unknown until this prefill is complete
            with states.pinned(keys) if states is not None else nullcontext():
                yield from self._run_segments(result, segments, keys, options, should_stop, started, kept, previous)
            if states is not None and states.bytes > self.budget_bytes:
                self.evict_to_budget()  # the budget was lowered: new states evict on their own
        return result

    # -- what the context and the stored states already hold ----------------------------------

    def _reuse_point(self, layout: PromptLayout, states: TieredStateStore | None) -> tuple[PromptLayout, int]:
        """*layout* and how many of its leading tokens the engine's sequence already holds,
        exactly as this prompt's own prefill would compute them (0: none; see
        :mod:`percache_core.serving.live_prefix`). A caller's prompt also gets a cut at the
        end of the longest stored state it starts with, when that is deeper."""
        engine = self.engine
        live = self._live if self._live is not None and self._live.changes == engine.changes else None
        tokens = layout.tokens
        rule = known_cut_rule(engine)[1] if layout.caller_prompt else layout.rule
        if rule is None:  # PerCache's own prompt on a build without a rule: same calls only
            if live is None:
                return layout, 0
            starts = call_starts([len(s.tokens) for s in layout.segments], engine.n_batch)
            return layout, segment_cut(live, tokens, starts, layout.ends[:-1])
        kept = text_cut(live, tokens, rule) if live is not None else 0
        if layout.stock_calls:  # PerCache's own prompt: its states are at its state points
            return layout, kept
        stored = self._stored_text_prefix(tokens, rule) if states is not None else 0
        point = max(kept, stored)
        if point and point not in layout.ends:
            layout = with_cut(layout, point, rule)
        return layout, kept

    def _stored_text_prefix(self, tokens: Sequence[int], rule: CutRule) -> int:
        """The length of the longest stored state of a caller's prompt that *tokens* start
        with and that leaves at least ``rule.min_tokens`` to prefill (0: none)."""
        limit = len(tokens) - rule.min_tokens
        lengths = sorted({n.n_tokens for n in self.states.tree.nodes if n.label == "text" and n.n_tokens <= limit})
        lengths = [n for n in lengths if n % rule.multiple == 0 and n >= rule.min_tokens]
        if not lengths:
            return 0
        keys = prefix_keys(self.states.root_key, tokens, lengths)
        return next((n for n, key in zip(reversed(lengths), reversed(keys)) if key in self.states), 0)

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
        see :func:`~percache_core.kv.cuts.measure_cut_rule`)."""
        engine = self.engine
        spec = spec or rag_prompt(self.config.retrieval.system_prompt, chunks, question)
        max_prompt_tokens = engine.n_ctx - max_new_tokens
        if isinstance(spec, TextPrompt):
            # a cut is a call: only where a state is kept. The self-check (seconds, once per
            # engine) runs here only for such a prompt; otherwise preload() or an idle round
            # runs it, and until then the context is kept only where the calls were the same
            cut = bool(spec.documents) and self.config.tiers.chunk_states
            rule = measure_cut_rule(engine) if cut else None
            return lay_out_text(spec, engine, max_prompt_tokens=max_prompt_tokens, rule=rule)
        # PerCache's own prompt runs in stock's calls where the engine has a cut rule (the
        # self-check runs once per build and model; its verdict is kept on disk)
        rule = measure_cut_rule(engine)
        return lay_out(spec, tokenize=engine.tokenize, max_prompt_tokens=max_prompt_tokens, rule=rule)

    def complete_plain(
        self, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
    ) -> tuple[str, int, int]:
        """Idle work's free-form completion on the engine (see
        :func:`~percache_core.serving.completion.complete_plain`)."""
        from .completion import complete_plain  # completion builds on this module

        return complete_plain(self.engine, prompt, decoding, chat=chat, should_stop=should_stop)

    def _draft_bound(self, options: RunOptions) -> float | None:
        """The lead a batched logit needs for drafts to be verified (None: decode one token
        at a time). ``draft_decoding="auto"`` drafts only where the engine's self-check
        (run by ``preload()`` and idle rounds, never inside an answer) measured the bound
        and found that batches pay; "on" measures the bound on first use; "off" never."""
        mode = self.config.engine.draft_decoding
        if not options.drafting or mode == "off":
            return None
        if mode == "on":
            return deviation_bound(self.engine)
        return known_bound(self.engine) if known_drafts_pay(self.engine) else None

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
        bound = self._draft_bound(options) if options.decode else None
        clock = time.perf_counter()
        end = sum(len(segment) for segment in segments)
        depth, reused, from_context = self._keep_or_restore(result.layout, keys, kept, previous, end)
        result.depth, result.reused_tokens = depth, reused
        result.live_tokens = reused if from_context else 0
        if keys:
            idle = [
                index for index in range(1, depth)
                if (node := self.states.tree.get(keys[index])) is not None and node.idle
            ]
            result.idle_reused_chunks = len(idle)
            result.idle_reused_tokens = sum(len(segments[index]) for index in idle)
        timings["restore"] = time.perf_counter() - clock

        clock = time.perf_counter()
        new_states: list[NewState] = []
        prompt = [t for segment in segments for t in segment]
        layout = result.layout
        composing = options.approximate and any(
            node is not None and (options.recompute_tokens or 0) < node.n_tokens - len(segments[0])
            for node in (self._independent_state(layout, segments, i) for i in range(depth, len(segments)))
        )  # some chunk would be moved in, not all of it recomputed
        pending: list[int] = []
        if layout.stock_calls and not composing:
            pending, starts = self._prefill_in_stock_calls(result, prompt, keys, options, should_stop, new_states)
            starts = [0, *starts]
        elif layout.stock_calls:  # composed chunks: one call per segment, an approximate run
            held = sum(1 for end in layout.ends[: len(segments)] if end <= engine.n_past)  # whole segments in place
            if held < len(segments) and engine.n_past > (layout.ends[held - 1] if held else 0):
                self._eval_to(prompt, layout.ends[held], should_stop)  # the rest of a segment begun
                held += 1
            self._prefill(result, segments, keys, held, options, should_stop, None)
            result.approximate = True  # not stock's calls, whatever was composed
            starts = call_starts([len(segment) for segment in segments], engine.n_batch)
        else:
            self._prefill(result, segments, keys, depth, options, should_stop, new_states)
            starts = call_starts([len(segment) for segment in segments], engine.n_batch)
        result.prefilled_tokens = sum(len(s) for s in segments) - reused - result.moved_tokens
        if result.live_tokens and previous is not None:  # the kept part was computed by the previous calls
            starts = [s for s in previous.starts if s < reused] + [s for s in starts if s >= reused]
        if options.keep_logits:
            result.next_token_logits = np.array(engine.last_logits(), copy=True)
        timings["prefill"] = time.perf_counter() - clock
        try:
            if options.decode:
                rebuild = self._rebuilder(result, segments, keys, options)
                yield from self._decode(result, options, should_stop, started, bound, rebuild)
        finally:
            # The prefill is complete, so its states are whole whatever happened while
            # decoding; they are written after the answer so that they do not delay it.
            if not result.approximate:  # the next prompt may keep what this one prefilled
                self._live = LiveContext(tuple(prompt), tuple(starts), engine.changes)
            clock = time.perf_counter()
            if pending and not result.approximate:
                new_states = self._taken_states(result.layout, keys, new_states, pending)
            self._keep_states(result.layout, keys, new_states, idle=options.idle)
            timings["store_states"] = time.perf_counter() - clock

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
        parent = self._stored_parent(keys, depth)  # the prefix a new slice follows
        for index in range(depth, len(segments)):
            if should_stop is not None and should_stop():
                raise Preempted("prefill pre-empted by a user question")
            expected = engine.n_past + len(segments[index])
            independent = self._independent_state(result.layout, segments, index) if options.approximate else None
            if independent is not None:
                assert options.recompute_tokens is not None  # resolved by run()
                moved = self._prefill_approximately(
                    independent, segments[index], options.recompute_tokens, len(segments[0])
                )
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
                parent = self._save_now(index, keys[index], parent, new_states)
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
        """Prefill PerCache's own prompt from where the sequence is (a restored or kept
        state point) to its end in stock's calls: one call of at most ``n_batch`` tokens
        after another, cut only where the engine's rule allows, so the output is stock
        llama.cpp's. The states of new prefixes are taken at their state points after the
        answer (:meth:`_taken_states`); only a state whose sliding-window cells the rest of
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
        early: list[int] = []
        last_cut = engine.n_past
        assert layout.rule is not None  # stock_calls
        least = layout.rule.min_tokens
        for index in wanted:
            point = layout.state_point(index)
            if window and point < end_of_answer - window and point - last_cut >= least and len(prompt) - point >= least:
                early.append(index)  # a cut there leaves pieces the rule allows
                last_cut = point
        parent = self._stored_parent(keys, result.depth)
        starts: list[int] = []
        for index in early:  # a cut at each (allowed by the rule), its state saved now
            starts += self._eval_to(prompt, layout.state_point(index), should_stop)
            parent = self._save_now(index, keys[index], parent, new_states)
        starts += self._eval_to(prompt, len(prompt), should_stop)
        return [i for i in wanted if i not in early], starts

    def _eval_to(self, prompt: list[int], end: int, should_stop: StopCheck | None) -> list[int]:
        """Prefill *prompt* from the sequence's end to *end* (pre-empted: :class:`Preempted`);
        where its calls started."""
        engine = self.engine
        if should_stop is not None and should_stop():
            raise Preempted("prefill pre-empted by a user question")
        start = engine.n_past
        engine.eval(prompt[start:end], should_stop)
        if engine.n_past != end:
            raise Preempted("prefill pre-empted by a user question")
        return [start + offset for offset, _ in batch_bounds(end - start, engine.n_batch)]

    def _save_now(
        self, index: int, key: str, parent: tuple[str, int], new_states: list[NewState]
    ) -> tuple[str, int]:
        """Save the state the sequence ends with now as segment *index*'s (*key*): a slice
        after *parent* (key, tokens) where slices are kept and there is one, else whole.
        Returns it as the parent of the next."""
        engine, states = self.engine, self.states
        parent_key, start = parent
        data = engine.save_slice(start) if states.slices and start else engine.save_state()
        new_states.append(NewState(index, parent_key or states.root_key, data, engine.n_past))
        return key, engine.n_past

    def _taken_states(
        self, layout: PromptLayout, keys: list[str], saved: list[NewState], pending: list[int]
    ) -> list[NewState]:
        """*saved* and the states of the *pending* segments, taken from the sequence at their
        state points (it still holds the prompt's KV; the answer's tokens come after it),
        parents first; the deeper ones are left out after one that the sequence no longer
        holds whole."""
        engine, states = self.engine, self.states
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

    def _stored_parent(self, keys: list[str], depth: int) -> tuple[str, int]:
        """The deepest stored prefix among the first *depth* (key, tokens) that a new slice
        may follow, or ("", 0) (a whole state then)."""
        for key in reversed(keys[:depth]):
            node = self.states.tree.get(key) if self.states is not None else None
            if node is not None:
                return key, node.n_tokens
        return "", 0

    def _independent_state(self, layout: PromptLayout, segments: list[list[int]], index: int) -> StateNode | None:
        """The stored [system, chunk] state of chunk segment *index* (index >= 2: the first
        chunk's is an exact prefix, restored as such), or None."""
        if self.states is None or index < 2 or layout.segments[index].kind != "chunk":
            return None
        if layout.segments[0].kind != "system":
            return None
        key = path_keys(self.states.root_key, [segments[0], segments[index]])[1]
        return self.states.tree.get(key)

    def _prefill_approximately(self, node: StateNode, tokens: list[int], recompute: int, offset: int) -> int:
        """Prefill a chunk segment of *tokens* from its independent [system, chunk] state
        *node* (where the chunk starts at *offset*): its first *recompute* tokens live (they
        see the real context before them), the rest the state holds moved in, and what it
        does not hold (a state taken at a state point before the chunk's end) live. Falls
        back to a live prefill of the rest when the state cannot be used. Returns the tokens
        moved in."""
        engine = self.engine
        held = min(len(tokens), node.n_tokens - offset)  # of the chunk's tokens, in the state
        head = min(recompute, held)
        if head:
            engine.eval(tokens[:head])
        data = self.states.get(node) if head < held else None
        if data is None or not engine.append_moved(data, node.n_tokens, offset + head):
            if head < len(tokens):
                engine.eval(tokens[head:])
            return 0
        self.states.record_use(node)
        if held < len(tokens):
            engine.eval(tokens[held:])
        return held - head

    def _rebuilder(
        self, result: RunResult, segments: list[list[int]], keys: list[str], options: RunOptions
    ) -> Callable[[], None]:
        """A function that brings the sequence back to the end of the prompt (restore the
        deepest stored prefix, prefill the rest as the first time), for when it cannot be
        cut back exactly."""

        def rebuild() -> None:
            layout = result.layout
            candidates = self.states.candidates(keys, budget_bytes=self.budget_bytes) if keys else []
            if layout.stock_calls and not options.approximate:
                # what the context held is gone: stored states only, then stock's calls
                end = sum(map(len, segments))
                self._restore_or_reset(keys, self._usable(layout, keys, candidates, end))
                self._eval_to([t for segment in segments for t in segment], end, None)
                return
            depth, _ = self._restore_or_reset(keys, candidates)
            again = RunResult(layout)
            self._prefill(again, segments, keys, depth, replace(options, keep_logits=False), None, None)

        return rebuild

    def _decode(
        self,
        result: RunResult,
        options: RunOptions,
        should_stop: StopCheck | None,
        started: float,
        bound: float | None,
        rebuild: Callable[[], None],
    ) -> Generator[str, None, None]:
        clock = time.perf_counter()
        stop = StopStringFilter(self.config.engine.stop if options.stop is None else options.stop, strip=options.trim)
        max_new_tokens = options.max_new_tokens

        def count_token(token: int) -> None:
            result.tokens.append(token)
            if self.engine.is_end_of_generation(token):
                return
            result.generated_tokens += 1
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started

        if bound is None:
            assert options.sampling is not None  # resolved by run()
            tokens = self.engine.generate(max_new_tokens=max_new_tokens, sampling=options.sampling)
        else:
            sources: list[DraftSource] = [AnswerDraft(options.answer_drafts)]
            if options.prompt_lookup:
                sources.append(PromptLookup(result.layout.tokens))
            tokens = self._greedy_with_drafts(result, max_new_tokens, sources, bound, should_stop, rebuild)
        yield from decode_text(self.engine, tokens, stop, should_stop, count_token)
        result.text = stop.text.strip() if options.trim else stop.text
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
                plan = DraftPlan(max_new_tokens, sources, bound, should_stop, result.drafts, replay)
                for token in greedy_tokens(self.engine, plan):
                    produced.append(token)
                    yield token
                return
            except SequenceLost:
                logger.debug("draft decoding lost the sequence after %d tokens: rebuilt", len(produced))
                rebuild()
                replay = list(produced)

    def _keep_or_restore(
        self, layout: PromptLayout, keys: list[str], kept: int, live: LiveContext | None, end: int
    ) -> tuple[int, int, bool]:
        """Bring the sequence to the deepest prefix of *layout* (prefilled up to *end*) that
        a stored state restores or the context holds (its first *kept* tokens, cut back to;
        used where no stored state is as deep), else empty it: (segments, tokens) in place,
        and whether they are the context's."""
        ends = layout.ends
        candidates = self.states.candidates(keys, budget_bytes=self.budget_bytes) if keys else []
        live_ok = live is not None and live.changes == self.engine.changes
        if layout.stock_calls:  # the context is kept where it holds more state points
            assert layout.rule is not None
            candidates = self._usable(layout, keys, candidates, end)
            depth = sum(1 for index in range(len(layout.segments) - 1) if 0 < layout.state_point(index) <= kept)
            stored = keys.index(candidates[0].key) + 1 if candidates else 0
            keep = kept and end - kept >= layout.rule.min_tokens and (stored < depth or not candidates)
            if keep and live_ok and self.engine.truncate(kept):
                return depth, kept, True
        elif kept and kept in ends and live_ok:
            depth = ends.index(kept) + 1
            stored = keys.index(candidates[0].key) + 1 if candidates else 0
            if stored < depth and self.engine.truncate(kept):
                return depth, kept, True
        return (*self._restore_or_reset(keys, candidates), False)

    @staticmethod
    def _usable(layout: PromptLayout, keys: list[str], candidates: list[StateNode], end: int) -> list[StateNode]:
        """Of the stored prefixes *candidates* of PerCache's own prompt in stock's calls,
        those that end at their state point in *layout* and leave at least
        ``rule.min_tokens`` to prefill before *end* (the cut a restore makes is then one the
        rule allows)."""
        assert layout.rule is not None
        least = layout.rule.min_tokens
        return [
            node for node in candidates
            if layout.state_point(keys.index(node.key)) == node.n_tokens and end - node.n_tokens >= least
        ]

    def _restore_or_reset(self, keys: list[str], candidates: list[StateNode] | None = None) -> tuple[int, int]:
        """Restore the deepest usable stored prefix of *keys* (of *candidates*, the stored
        ones among them when already looked up), or empty the sequence when none is
        stored: (segments, tokens) restored."""
        depth, reused = self._restore(keys, candidates) if keys else (0, 0)
        if depth == 0:
            self.engine.reset()
        return depth, reused

    def _restore(self, keys: list[str], candidates: list[StateNode] | None = None) -> tuple[int, int]:
        """Restore the deepest usable stored prefix of *keys* (from any tier; *candidates*:
        the stored ones among them, when already looked up): (segments, tokens) restored.
        A node's depth is its place among *keys* (a caller's prompt is keyed by its leading
        tokens, so the same node ends other segments in other layouts)."""
        if candidates is None:
            candidates = self.states.candidates(keys, budget_bytes=self.budget_bytes)
        for node in candidates:
            chain = self.states.chain(node)
            if chain is None:
                continue  # a slice whose ancestor was evicted: a shorter prefix may do
            restored = self._restore_chain(chain)
            if restored is not None and restored.key in keys:
                return keys.index(restored.key) + 1, restored.n_tokens
            # a link failed and what was restored ends inside a segment here: look further
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
