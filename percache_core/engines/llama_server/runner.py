"""Running prompts on a llama-server through the chunk-state tree, with the server's own text.

The promise is the in-process one: an answer's text is what the same server gives the same
prompt with nothing reused (a fresh prefill, ``cache_prompt: false``). A server prefills
from the point its slot's tokens stop matching, in batches of ``n_ubatch`` tokens from
there, so where a prefill starts decides its batches. :class:`ServerRunner` therefore lets
a prefill start only where a cut changes nothing:

- at 0 (nothing reused);
- at a stored state's end, a *state point* (restored from its slot file), or at the end of
  what the slot holds from the previous prompt; either only where the server's cut rule
  allows it (:func:`~percache_core.engines.llama_server.cuts.measure_server_cut_rule`, measured through the
  server: a multiple of ``rule.multiple``, at least ``rule.min_tokens`` from the start and
  the end) and where the batches after it end as a fresh prefill's do (when a fresh
  prefill's last batch is shorter than ``rule.min_tokens``, only a cut at a multiple of
  ``n_ubatch`` keeps it whole);
- a state is saved only where it was prefilled so (a prefill of the prefix alone, from
  such a start), so that restoring it later is such a start too.

The server reports how many tokens it reused before any text arrives; a request whose
reuse is not the planned one is cancelled and run again from nothing: a miss, never a
different answer. Generated tokens are never reused (they were decoded one at a time).
Drafts and composed (approximate) states need the in-process engine.

Every slot of the server is used (:class:`~percache_core.engines.llama_server.slot_pool.SlotPool`):
runs in different slots go to the server at once, as its own clients' would. A run that
shared the server's batches with another (:mod:`~percache_core.engines.llama_server.slot_leases`)
gets the server's text under that batching, as a client of the server alone would, and
leaves nothing: no stored answer (:attr:`RunResult.batched`), no state, nothing of its slot
kept for the next request. Only what a request computed alone is stored or reused. On a
server started batch-invariant (:class:`~percache_core.engines.llama_server.server_process.ServerLaunch`'s
``batch_invariant``) every request computes as alone, so no run is marked batched and each
is kept as a lone run's; there a run whose prompt starts with a prefix another run is
computing waits for that state and restores it (:mod:`~percache_core.engines.llama_server.run_start`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace

from ...config import LiveConfig, PerCacheConfig
from ...errors import ContextOverflowError
from ...kv.cuts import CutRule
from ...kv.engine import Decoding
from ...kv.stopping import StopStringFilter, stop_strings
from ...kv.tiers import TieredStateStore
from ...serving.prompting import PromptLayout, PromptSpec, TextPrompt, lay_out, lay_out_text, rag_prompt
from ...serving.state_runner import RelayedRequest, RunOptions, RunResult, StateRunner, StopCheck
from ...serving.text_stream import close_source, shown_text
from ...types import Chunk
from .batched_runs import BatchedRuns
from .run_start import RunStarts, StartOptions
from .server import Completion, InSlot, LlamaServer, UnexpectedReuse
from .slot import NO_WINDOW, ServerCuts, SlotContent
from .slot_pool import SlotPool, SlotRun
from .states import EarlySave

logger = logging.getLogger(__name__)



class ServerRunner(StateRunner):
    """Runs prompts on a :class:`~percache_core.engines.llama_server.server.LlamaServer`, restoring and
    keeping chunk states as slot files (see the module docstring). *rule*: the server's cut
    rule (None: no cut is safe, so every prompt is prefilled whole and no state is kept);
    *n_ubatch*: the server's micro-batch (``-ub``)."""

    engine: LlamaServer

    def __init__(
        self,
        server: LlamaServer,
        states: TieredStateStore | None,
        config: PerCacheConfig | LiveConfig,
        *,
        rule: CutRule | None,
        n_ubatch: int = 512,
        budget: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(server, states, config, budget=budget)
        window = server.sliding_window if rule is not None else 0
        self.cuts = ServerCuts(rule, n_ubatch, window or NO_WINDOW)
        self.store_lock = threading.RLock()  # the stored states, shared by runs in several slots and the writer
        self.pool = SlotPool(self, server, self.cuts, self.store_lock)  # every slot, and the states taken from each
        self.unexpected_reuse = 0  # requests the server reused otherwise than planned (run again)
        self.starts = RunStarts(self, self.cuts, self.store_lock)  # where each run starts (and what it waits for)
        self.batched = BatchedRuns(self)  # where a run batched from its start begins

    @property
    def rule(self) -> CutRule | None:
        """The server's cut rule (None: every prompt is prefilled whole, no state kept)."""
        return self.cuts.rule

    @property
    def window(self) -> int:
        """The longest state that restores exactly (a sliding-window model's window)."""
        return self.cuts.window

    # -- laying prompts out -------------------------------------------------------------------

    def lay_out(
        self,
        question: str,
        chunks: Sequence[Chunk],
        *,
        spec: PromptSpec | TextPrompt | None = None,
        max_new_tokens: int,
    ) -> PromptLayout:
        """The prompt's pieces: PerCache's own [system, *chunks, question] with states at the
        rule's state points, or a caller's *spec* cut after its documents."""
        server = self.engine
        spec = spec or rag_prompt(self.config.retrieval.system_prompt, chunks, question)
        max_prompt_tokens = server.n_ctx - max_new_tokens
        if max_prompt_tokens <= 0:
            raise ContextOverflowError(f"max_new_tokens {max_new_tokens} leaves no room in the server's n_ctx {server.n_ctx}")
        rule = self.rule if self.states is not None else None
        if isinstance(spec, TextPrompt):
            # a state is taken after the request, not where a request starts: cut at every
            # document's end (at a multiple of the rule's), and the rule's least piece before
            # the last one (a later prompt may follow the same documents with a question
            # shorter than that); which of them a later prompt may restore is decided then
            # (cut_allowed)
            cuts = CutRule(1, rule.multiple) if rule is not None and spec.documents else None
            lead = rule.min_tokens if rule is not None else 0
            return lay_out_text(spec, server, max_prompt_tokens=max_prompt_tokens, rule=cuts, lead=lead)
        return lay_out(spec, tokenize=server.tokenize, max_prompt_tokens=max_prompt_tokens, rule=rule)

    # -- running a prompt -------------------------------------------------------------------

    def run(
        self,
        layout: PromptLayout,
        options: RunOptions,
        *,
        should_stop: StopCheck | None = None,
        started: float | None = None,
    ) -> Generator[str, None, RunResult]:
        """Run *layout*: restore the deepest usable stored state (or keep the slot's prefix,
        where allowed), prefill to each new state point and save it, then complete the
        prompt; yields answer text, returns a :class:`RunResult`. Drafts, logits and
        composed states are in-process features: options asking for them run without."""
        started = time.perf_counter() if started is None else started
        config = self.config
        options = replace(
            options,
            sampling=options.sampling or config.engine.sampling,
            decode=options.decode and not options.prefix_only,
            approximate=False,
        )
        states = self.states if config.tiers.chunk_states and self.rule is not None else None
        with self.pool.lease(layout.tokens, idle=options.idle) as run:
            self.flush()
            alone = self.pool.leases.alone_now(run.mark)  # (an overlap that ended before it sent anything: alone)
            if alone and self.engine.slots_shared and self.batched.found_company(run, layout, options):
                alone = self.pool.leases.alone_now(run.mark)
            if not alone and options.decode and not options.idle and self.batched.takes(run, layout, options):
                return (yield from self.batched.run(run, RunResult(layout), options, (should_stop, started)))
            if self.engine.slots_shared and not run.mark.batched:  # alone: as on an empty server
                self.pool.clear_others(run)
            if states is not None and states.bytes > self.budget_bytes:
                self.evict_to_budget()  # the budget was lowered: new states evict on their own
            result = RunResult(layout)
            keys = self._keys(layout, states)
            if options.restore_depth is not None:
                keys = keys[: options.restore_depth]
            end = len(layout.tokens)
            if options.prefix_only:  # to the last state point before the question
                end = layout.state_point(len(layout.segments) - 2) if len(layout.segments) > 1 else 0
            with _pinned(states, keys, self.store_lock) if states is not None else nullcontext():
                yield from self._run(run, result, layout, keys, options, (should_stop, started, end))
        return result

    def _run(
        self,
        run: SlotRun,
        result: RunResult,
        layout: PromptLayout,
        keys: list[str],
        options: RunOptions,
        how: tuple[StopCheck | None, float, int],
    ) -> Generator[str, None, None]:
        """:meth:`run` in *run*'s slot; *how*: the stop check, when the request started,
        and where the prompt's prefill ends."""
        should_stop, started, end = how
        tokens, clock = layout.tokens, time.perf_counter()
        fresh = options.restore_depth is not None or not self.config.tiers.chunk_states  # caches off: nothing reused
        keeps = self.states is not None and self.rule is not None  # states are taken at all
        shares = keeps and self.pool.leases.invariant and options.decode and not options.idle and not fresh
        saves_early = shares or (keeps and _window_may_pass(self.window, end, options))
        tail_cut = keeps and layout.caller_prompt and options.decode
        begun = self.starts.begin(run, layout, keys, end, StartOptions(fresh, shares, tail_cut, should_stop))
        point, layout, keys = begun.point, begun.layout, begun.keys
        result.depth, result.reused_tokens, result.layout = begun.depth, point, layout
        result.timings["restore"] = time.perf_counter() - clock
        clock = time.perf_counter()
        complete, early = False, EarlySave()
        try:
            if saves_early:
                point = self._save_early(run, result, (layout, keys), (point, end), early, should_stop)
        finally:  # saved states stored now: a run in another slot may wait for them
            if shares:
                self.starts.publish(run, layout, keys, early, begun, options.idle)
        start = point  # where the last request's prefill started (0 where it was run again)
        span = (start, end)  # the prefill whose cells states are taken from
        try:
            if options.decode:
                split = self.cuts.last_batch_start(point, end) if self.rule is not None else None
                if split is not None:  # to the fresh prefill's short last batch, in a request of its own
                    span = (self._prefill_to(run, result, tokens[:split], point, should_stop), split)
                    point = split
                start = yield from self._complete(run, result, point, options, (should_stop, started))
                span = span if split is not None and start == split else (start, end)
                complete = run.slot.content is not None  # the request ran to its end
            else:
                if end > point:  # (a prefix with no state point to reach has nothing to prefill)
                    start = self._prefill_to(run, result, tokens[:end], point, should_stop)
                span = (start, end)
                complete = True
            result.prefilled_tokens = max(0, end - result.reused_tokens)
        finally:
            self.pool.leases.done_computing(run.mark)
            result.batched = run.mark.batched
            if result.batched:  # what it computed is the server's under batching: nothing kept
                self.batched_runs, complete = self.batched_runs + 1, False
                run.slot.keep_loose(layout.tokens)
            result.timings["prefill"] = result.timings.get("prefill", time.perf_counter() - clock)
            clock = time.perf_counter()
            if complete and keeps:  # (a relayed client's reply first)
                run.taking.store_later(layout, keys, early, span, options.idle, after_reply=options.relay is not None and not options.idle)
            early.discard()  # the files of early saves not stored (store_later took those it stores)
            result.timings["store_states"] = time.perf_counter() - clock

    def _save_early(
        self, run: SlotRun, result: RunResult, prompt: tuple[PromptLayout, list[str]], span: tuple[int, int],
        early: EarlySave, should_stop: StopCheck | None,
    ) -> int:
        """:meth:`SlotStates.save_early` (*prompt*: the layout and its keys); from nothing
        (0) where the server reused otherwise."""
        layout, keys = prompt
        try:
            return run.taking.save_early(layout, keys, span, early, should_stop)
        except UnexpectedReuse as error:  # the slot held other than planned: from nothing
            logger.warning("%s; the prompt is prefilled from the start", error)
            self.unexpected_reuse += 1
            result.reused_tokens = result.depth = 0
            run.slot.content = None
            return 0

    def _prefill_to(
        self, run: SlotRun, result: RunResult, tokens: Sequence[int], point: int, should_stop: StopCheck | None
    ) -> int:
        """Prefill *tokens* from *point* (from 0 when the server reused otherwise);
        returns where the prefill started."""
        try:
            run.slot.prefill(tokens, point, should_stop)
            return point
        except UnexpectedReuse as error:
            logger.warning("%s; the prompt is prefilled from the start", error)
            self.unexpected_reuse += 1
            result.reused_tokens = result.depth = 0
            run.slot.prefill(tokens, 0, should_stop)
            return 0

    def _complete(
        self, run: SlotRun, result: RunResult, point: int, options: RunOptions, how: tuple[StopCheck | None, float],
        *, checked: bool = True, placed: bool = False,
    ) -> Generator[str, None, int]:
        """Complete the prompt from *point* in *run*'s slot; on a reuse other than planned,
        from 0 (*how*: the stop check and when the request started). Not *checked*: from
        whatever the server reuses of its slot (a batched run's, noted in *result*), or with
        *placed* of the slot it picks. Returns where its prefill started."""
        assert options.sampling is not None
        should_stop, started = how
        tokens, relay = result.layout.tokens, options.relay
        stops = stop_strings(self.config.engine.stop if options.stop is None else options.stop) if relay is None else ()
        stop = StopStringFilter(stops, strip=options.trim and relay is None)
        clock = time.perf_counter()
        completion = Completion()
        for attempt in (0, 1):
            run.slot.content = None
            completion = Completion()
            request = self._request(run, tokens, point if checked else None, options, (stops, completion), placed)
            pieces = _timed(request, result, started, clock)
            try:
                yield from shown_text(pieces, stop, should_stop)
                break
            except UnexpectedReuse as error:
                if attempt:
                    raise
                logger.warning("%s; the prompt is prefilled from the start", error)
                self.unexpected_reuse += 1
                point = result.reused_tokens = result.depth = 0
        result.text = stop.text.strip() if options.trim and relay is None else stop.text
        if not checked:
            point = result.reused_tokens = completion.cached or 0
        result.timings["decode"] = time.perf_counter() - clock - result.timings.get("prefill", 0.0)
        self._completed(run, result, (point, completion), relay)
        return point

    def _request(
        self, run: SlotRun, tokens: Sequence[int], point: int | None, options: RunOptions,
        into: tuple[Sequence[str], Completion], placed: bool = False,
    ) -> Iterator[str]:
        """The request that completes *tokens* from *point* in the run's slot (None: from
        whatever the server reuses of it, unchecked; *placed*: in the slot the server picks): the
        server's completion with PerCache's decoding and the stop strings of *into*, or a
        relayed client's request on the server's own endpoint (which lays out, stops and
        parses the reply); its :class:`Completion` is *into*'s."""
        relay, server = options.relay, self.engine
        stops, completion = into
        slot = InSlot(-1 if placed else run.slot.index, completion)  # -1: the slot the server picks
        reuse = point is None or point > 0
        if relay is None:
            decoding = Decoding(options.max_new_tokens, options.sampling, list(stops))
            return server.complete(tokens, decoding, cache_prompt=reuse, expected_cached=point, slot=slot)
        relay.chunks.clear()
        expected = None if point is None else (point, len(tokens))
        return server.relay(relay.path, relay.body, cache_prompt=reuse, expected=expected, chunks=relay.chunks, slot=slot)

    def _completed(
        self, run: SlotRun, result: RunResult, done: tuple[int, Completion], relay: RelayedRequest | None
    ) -> None:
        """Take the finished request's tokens into *result* and note what the slot holds
        (*done*: where its prefill started, and its :class:`Completion`)."""
        point, completion = done
        tokens = result.layout.tokens
        result.tokens = list(completion.tokens)
        result.generated_tokens = len(completion.tokens)
        valid = self.cuts.valid_end(point, len(tokens)) if self.rule else 0
        if relay is not None:
            relay.reply = completion
            result.generated_tokens = int(completion.usage.get("completion_tokens", 0))
            if completion.finish_reason:  # it ran to its end: the slot holds the prompt and a reply
                run.slot.content = SlotContent(tuple(tokens), valid, None)
        elif completion.stop_type:  # the request ran to its end: the slot holds prompt and answer
            run.slot.content = SlotContent(tuple(tokens), valid, tuple(completion.tokens[:-1]))

    def settle(self) -> None:
        """The slot saves relayed replies left (:meth:`SlotPool.settle`)."""
        self.pool.settle()

    def close(self) -> None:
        """Store what is pending; slot saves left for after a reply are dropped (the server
        may be gone), with the files they would have read."""
        for taking in self.pool.takings:
            taking.drop_pending()
        super().close()

    def evict_to_budget(self) -> None:
        self.flush()
        with self.store_lock:
            self.states.evict_to(self.budget_bytes)

    @contextmanager
    def lend_engine(self) -> Iterator[None]:
        """Hold the whole server for a request run outside PerCache (a passed-through one):
        the states of earlier runs are stored first, and every slot's content is unknown
        after (the server picks the request's slot)."""
        with self.engine.lock:
            self.flush()
            self.pool.forget_contents()
            try:
                yield
            finally:
                self.pool.forget_contents()

    def bytes_per_token(self) -> float:
        """The bytes a slot file takes per token, measured once."""
        return self.pool.slots[0].bytes_per_token()

    def complete_plain(
        self, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
    ) -> tuple[str, int, int]:
        """Idle work's LLM calls, with nothing reused, in a slot of their own (see
        :meth:`ServerSlot.complete_plain`)."""
        with self.pool.lease((), idle=True) as run:
            return run.slot.complete_plain(prompt, decoding, chat=chat, should_stop=should_stop)


def _window_may_pass(window: int, end: int, options: RunOptions) -> bool:
    """Whether a sliding *window* may pass the first cells of a prompt of *end* tokens
    before the request ends (the prompt and the most tokens it may generate are longer
    than the window), so that a slot saved after it would lack them: only then are its
    states saved on the way, at the cost of a request and a slot save on its time.
    A state taken later is still checked to hold every cell it needs."""
    if window >= NO_WINDOW:
        return False
    if not options.decode:
        return end > window
    most = options.relay.most_new_tokens if options.relay is not None else options.max_new_tokens
    return most is None or end + most > window


@contextmanager
def _pinned(states: TieredStateStore, keys: list[str], lock: threading.RLock) -> Iterator[None]:
    """The stored states of *keys* pinned (not evicted) while the block runs, changed
    under *lock* (the runner's store lock)."""
    pinned = states.pinned(keys)
    with lock:
        pinned.__enter__()
    try:
        yield
    finally:
        with lock:
            pinned.__exit__(None, None, None)


def _timed(pieces: Iterator[str], result: RunResult, started: float, since: float) -> Iterator[str]:
    """*pieces*, with the time to the first one noted in *result*: from *started* (the
    request's start) as its time to first token, from *since* as its prefill."""
    try:
        for piece in pieces:
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
                result.timings["prefill"] = time.perf_counter() - since
            yield piece
    finally:
        close_source(pieces)  # a stream cut short ends the server's request
