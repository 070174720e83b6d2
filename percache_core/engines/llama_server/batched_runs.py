"""Runs that share a llama-server's batches with another request from their start.

On a server that is not batch-invariant, such a run's text is the server's under that
batching whatever it starts from, and nothing it computes is kept (no answer, no state):
so it starts where the server alone would start the same request.

- On a model whose every layer attends to the whole context (no sliding window), the
  request goes to the slot the server picks (``id_slot: -1``, ``cache_prompt``, unchecked),
  after the deepest stored state is restored into the run's slot: the server reuses what it
  holds for it as for its own clients, its RAM prompt cache (``--cache-ram``) included.
  Where a run leased before it is computing a prompt that begins with most of its own (two
  clients asking over the same passages at once), it first waits for that run to be done,
  so that the server finds the shared prefix in the slot it ran in or in its prompt cache
  rather than prefilling it twice side by side (the server alone does). A
  later run that starts alone is still computed as on an empty server, whatever such a
  request left: it empties the other slots first (``SlotPool.clear_others``), and in one
  shared KV cache without a sliding window every cell below the cache's head is occupied
  (placement takes each empty cell it passes, freeing moves the head down to the lowest
  freed cell; read in ``llama-kv-cache.cpp``), so a cache whose cells are all free has its
  head at cell 0, where an empty server's is. Under load, a run that would start alone
  where a batched run would reuse more than a stored state gives it first waits a moment
  for company (:meth:`BatchedRuns.found_company`): clients whose requests ended together
  then go on batched from what the server holds, instead of the first emptying it.
- On a sliding-window model that does not hold: the window's layers overwrite cells the
  window has passed and purge the sequence's older ones, so where a lone run's cells go
  depends on what ran before (measured on Gemma 3 through a default server: 28-32 of 104
  lone replies after such requests were not the fresh text). There a batched run stays in
  its own slot and goes on from what the slot holds (``cache_prompt``, unchecked: the
  server reuses the slot's cells, or its RAM prompt cache's, as for its own clients),
  whether exact cells or those an earlier batched run left (:attr:`ServerSlot.loose`),
  where that reaches further than any stored state, and always where no state may be
  restored (a default server keeps none for Gemma 3); else it runs as a lone run would,
  and keeps nothing. (Until 2026-12-07 only a batched run's leftover cells were gone on
  from: through a default server, Gemma 3's batched runs under 8 clients reused 0 prompt
  tokens where the server alone reused 4,204 of 18,588; now 1,112-1,171.)
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any, Protocol

from ...config import LiveConfig, PerCacheConfig
from ...kv.cuts import CutRule
from ...kv.tiers import TieredStateStore
from ...serving.prompting import PromptLayout
from ...serving.state_runner import RunOptions, RunResult, StopCheck
from .run_start import LIVE_CUT_GAIN, RunStarts, stored_starts
from .server import LlamaServer
from .slot_pool import SlotPool, SlotRun

TWIN_WAIT_S = 60.0  # the longest a batched run waits for a run computing most of its prompt
COMPANY_WAIT_S = 0.1  # the longest a run that would start alone under load waits for another to join it


class Runner(Protocol):
    """What :class:`BatchedRuns` uses of its :class:`~percache_core.engines.llama_server.runner.ServerRunner`."""

    engine: LlamaServer
    config: PerCacheConfig | LiveConfig
    states: TieredStateStore | None
    store_lock: threading.RLock
    starts: RunStarts
    pool: SlotPool
    batched_runs: int
    prefix_waits: int
    company_waits: int

    @property
    def rule(self) -> CutRule | None: ...

    @property
    def budget_bytes(self) -> int: ...

    def _keys(self, layout: PromptLayout, states: TieredStateStore | None) -> list[str]: ...

    def _complete(self, run: SlotRun, result: RunResult, point: int, options: RunOptions, how: Any, *,
                  checked: bool = True, placed: bool = False) -> Generator[str, None, int]: ...


class BatchedRuns:
    """Where *runner*'s runs batched from their start begin (see the module)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        server = runner.engine
        # the server's own placement is safe only where no layer has a sliding window (read from the model file)
        self.server_places = server.model_path is not None and server.sliding_window == 0

    def takes(self, run: SlotRun, layout: PromptLayout, options: RunOptions) -> bool:
        """Whether a run batched from its start, of *layout* with *options*, starts here
        rather than as a lone run does (one asked to reuse nothing never does). Where no
        state may be restored (chunk states off, as on a default server for a sliding-window
        model) it always does: what the server reuses for it (its slot's cells, its RAM
        prompt cache) is all there is to start from."""
        if options.restore_depth is not None:
            return False
        if self.server_places or not self._restores:
            return True
        held = run.slot.held_prefix(layout.tokens)  # exact cells or a batched run's: the server reuses either
        return bool(held) and held > self._deepest_stored(layout)

    def found_company(self, run: SlotRun, layout: PromptLayout, options: RunOptions) -> bool:
        """For a run that would start alone: where the latest run shared the server's batches
        (clients at once) and a batched run would reuse ``LIVE_CUT_GAIN`` tokens more than
        the deepest stored state gives it (the prefix the server likely still holds, in its
        slots or its prompt cache), wait up to ``COMPANY_WAIT_S`` for another run to start
        beside it; returns whether one did. Had it not waited, one starting during its
        run would have made it batched all the same (nothing of it kept); waiting, it starts
        where the server alone would."""
        pool = self.runner.pool
        if options.restore_depth is not None or not options.decode or options.idle or not pool.under_load():
            return False
        reuse = pool.recent_prefix(layout.tokens) if self.server_places else run.slot.held_prefix(layout.tokens)
        stored = self._deepest_stored(layout) if self._restores else 0
        if reuse < stored + LIVE_CUT_GAIN or not pool.leases.wait_batched(run.mark, COMPANY_WAIT_S):
            return False
        with self.runner.store_lock:
            self.runner.company_waits += 1
        return True

    def _deepest_stored(self, layout: PromptLayout) -> int:
        """The tokens of the deepest stored state a run of *layout* may start from (0: none)."""
        runner = self.runner
        with runner.store_lock:
            keys = runner._keys(layout, runner.states)
            stored = stored_starts(runner.states, runner.budget_bytes, layout, keys, len(layout.tokens))
        return stored[0].n_tokens if stored else 0

    def _wait_for_twin(self, run: SlotRun, layout: PromptLayout, should_stop: StopCheck | None) -> None:
        """Where a run leased before this one computes a prompt that begins with most of
        this one's (at least half, and ``LIVE_CUT_GAIN`` tokens more than any stored state
        holds or a recently finished prompt shares, which the server likely still holds),
        wait until it is done (at most ``TWIN_WAIT_S``): the server then finds that prefix
        in the slot it ran in or in its prompt cache, instead of prefilling it a second time
        beside it. A run is waited for by one run at most, and a waiting run by none (no
        chains): of several runs over one prefix at once, they pair up."""
        runner, tokens, pool = self.runner, layout.tokens, self.runner.pool
        held = pool.recent_prefix(tokens)
        if self._restores:
            held = max(held, self._deepest_stored(layout))
        twin = pool.twin(run, tokens, max(len(tokens) // 2, held + LIVE_CUT_GAIN))
        if twin is None:
            return
        with pool.waiting(run, twin):
            waited = pool.leases.wait_done_computing(twin, should_stop, TWIN_WAIT_S)
        if waited:
            with runner.store_lock:
                runner.prefix_waits += 1

    @property
    def _restores(self) -> bool:
        """Whether stored states may be restored (chunk states on, a cut rule measured)."""
        runner = self.runner
        return runner.states is not None and runner.rule is not None and runner.config.tiers.chunk_states

    def run(
        self, run: SlotRun, result: RunResult, options: RunOptions, how: tuple[StopCheck | None, float]
    ) -> Generator[str, None, RunResult]:
        """Run it (*how*: the stop check and when the request started); keeps nothing."""
        runner, layout = self.runner, result.layout
        try:
            if self.server_places:
                self._wait_for_twin(run, layout, how[0])
                if self._restores:
                    with runner.store_lock:
                        keys = runner._keys(layout, runner.states)
                        result.reused_tokens, result.depth = runner.starts.start(run, layout, keys, len(layout.tokens), fresh=False)
                runner.pool.quiet_for(run)  # no slot save of PerCache's left where the server may place it
                yield from runner._complete(run, result, result.reused_tokens, options, how, checked=False, placed=True)
            else:
                yield from runner._complete(run, result, 0, options, how, checked=False)
        finally:
            runner.pool.leases.done_computing(run.mark)
            result.batched, runner.batched_runs = True, runner.batched_runs + 1
            if self.server_places:
                runner.pool.forget_contents(but=run)
                run.slot.content = None
            else:
                run.slot.keep_loose(layout.tokens)
            result.prefilled_tokens = max(0, len(layout.tokens) - result.reused_tokens)
        return result
