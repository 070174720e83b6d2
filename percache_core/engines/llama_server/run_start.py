"""Where a run on a llama-server starts: the deepest stored state it may go on from
(restored into its slot), or what its slot still holds when that reaches further, or
nothing; and on a batch-invariant server, a prefix that a run in another slot computes now.

Prefix-aware order (batch-invariant servers only, where what a run computes beside another
is kept): a run that will save states on the way claims them (:class:`PrefixClaims`) and
hands them to the writer as soon as they are saved, not after its answer; a run whose prompt
starts with a claimed prefix reaching at least ``LIVE_CUT_GAIN`` tokens past its deepest
stored state waits for it, then restores it, instead of prefilling the same tokens beside
the first run. Its text is unchanged: a restored state is a lone prefill's cells (the cut
rule allows going on from it), as on a server where the first run had finished.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...kv.tiers import TieredStateStore
from ...kv.tree import StateNode, prefix_keys
from ...serving.prompting import PromptLayout
from ...serving.state_runner import StopCheck
from .prefix_claims import PrefixClaims, wait_for
from .slot import ServerCuts
from .slot_pool import SlotRun
from .states import EarlySave

if TYPE_CHECKING:
    from ...serving.state_runner import StateRunner

LIVE_CUT_GAIN = 128  # the slot is cut back (a save and a restore), or a prefix waited for, only to keep this many more tokens
PREFIX_WAIT_S = 120.0  # the longest a run waits for another run's prefix (then it computes it)


@dataclass
class Start:
    """Where a run starts: tokens in place, the segments they end, the layout and keys
    (a caller's prompt cut again after its start), and the prefixes it claimed."""

    point: int
    depth: int
    layout: PromptLayout
    keys: list[str]
    claimed: list[str]


@dataclass(frozen=True)
class StartOptions:
    """How a run starts: *fresh* (nothing reused), *shares* (prefix-aware order: waits for
    claimed prefixes, claims its own), *tail_cut* (a caller's prompt cut again after its
    start), and the run's stop check."""

    fresh: bool = False
    shares: bool = False
    tail_cut: bool = False
    should_stop: StopCheck | None = None


class RunStarts:
    """Starts the runs of *runner* (its stored states, budget, keys and restore-failure
    count) on slots cut by *cuts*, under *store_lock* (see the module)."""

    def __init__(self, runner: StateRunner, cuts: ServerCuts, store_lock: threading.RLock) -> None:
        self.runner = runner
        self.cuts = cuts
        self.store_lock = store_lock
        self.claims = PrefixClaims()

    def begin(self, run: SlotRun, layout: PromptLayout, keys: list[str], end: int, how: StartOptions) -> Start:
        """Bring *run*'s slot to its start for a prefill to *end* (:meth:`start`); where it
        shares (``how.shares``: prefix-aware order), wait first for a claimed prefix of its
        prompt, and claim the states it saves on the way. With ``how.tail_cut`` a caller's
        prompt is cut again after its start (``ServerCuts.with_tail_cut``)."""
        fresh, shares, awaiting = how.fresh, how.shares, how.shares
        while True:
            with self.store_lock:
                awaited = self._awaited(layout, keys, end) if awaiting else None
                if awaited is None:
                    point, depth = self.start(run, layout, keys, end, fresh=fresh)
                    if how.tail_cut:
                        layout = self.cuts.with_tail_cut(layout, point)
                        keys = self.runner._keys(layout, self.runner.states)
                    claimed = self._claim(run, layout, keys, (point, end)) if shares else []
                    return Start(point, depth, layout, keys, claimed)
            if wait_for(awaited, how.should_stop, PREFIX_WAIT_S):
                with self.store_lock:
                    self.runner.prefix_waits += 1
            else:  # waited too long, or its client went away: it computes on its own
                awaiting = False

    def start(self, run: SlotRun, layout: PromptLayout, keys: list[str], end: int, *, fresh: bool) -> tuple[int, int]:
        """Bring the run's slot to the deepest allowed start: a stored state restored, or
        the slot's own prefix when it reaches further (kept as is), else nothing (the next
        request prefills from 0). Returns (tokens in place, segments they end). The caller
        holds the store lock."""
        slot, states = run.slot, self.runner.states
        live = 0 if fresh else slot.live_reuse(layout.tokens[:end])
        usable = self._usable(layout, keys, end)
        deepest = usable[0].n_tokens if usable else 0
        if live < 0 and not fresh:  # the slot holds more than may be kept: cut it back
            kept = slot.cut_back(layout.tokens[:end], deepest + LIVE_CUT_GAIN)
            if kept:
                return kept, depth_at(layout, kept)
        for node in usable:
            if live > 0 and live >= node.n_tokens:
                break
            if slot.restore(node, layout.tokens, states):
                return node.n_tokens, depth_at(layout, node.n_tokens)
            self.runner.restore_failures += 1  # (the state dropped)
        if live > 0:
            return live, depth_at(layout, live)
        slot.content = None  # whatever it holds, the next request is fresh
        return 0, 0

    def publish(self, run: SlotRun, layout: PromptLayout, keys: list[str], early: EarlySave, start: Start, idle: bool) -> None:
        """Hand the states *run* saved on the way (*early*) to the writer now; *start*'s
        claims are released once they are stored (or at once when none was saved)."""
        if not early.saves:
            self.release(start.claimed)
            return
        try:
            run.taking.store_early(layout, keys, early, idle, lambda: self.release(start.claimed))
        except BaseException:
            self.release(start.claimed)
            raise

    def release(self, keys: list[str]) -> None:
        """The claimed *keys*' states are stored or will not be: their waiters go on."""
        if keys:
            with self.store_lock:
                self.claims.release(keys)

    def _awaited(self, layout: PromptLayout, keys: list[str], end: int) -> threading.Event | None:
        """The event of the deepest claimed prefix of *layout* that this run may go on from
        and that reaches ``LIVE_CUT_GAIN`` tokens past its deepest stored state."""
        lengths, states = self.claims.lengths(), self.runner.states
        if not lengths or states is None:
            return None
        candidates = {key: layout.state_point(i) for i, key in enumerate(keys)}
        if layout.caller_prompt:
            fitting = [n for n in lengths if n < end]
            candidates.update(zip(prefix_keys(states.root_key, layout.tokens, fitting), fitting))
        allowed = {key: n for key, n in candidates.items() if self.cuts.cut_allowed(n, end, past_window=True)}
        usable = self._usable(layout, keys, end)
        deepest = usable[0].n_tokens if usable else 0
        return self.claims.awaited(allowed, deeper_than=deepest + LIVE_CUT_GAIN - 1)

    def _usable(self, layout: PromptLayout, keys: list[str], end: int) -> list[StateNode]:
        """The stored states a prefill of *layout* to *end* may go on from, deepest first."""
        states = self.runner.states
        stored = stored_starts(states, self.runner.budget_bytes, layout, keys, end) if states is not None else []
        return [node for node in stored if self.cuts.cut_allowed(node.n_tokens, end, past_window=True)]

    def _claim(self, run: SlotRun, layout: PromptLayout, keys: list[str], span: tuple[int, int]) -> list[str]:
        """Claim the states *run* saves on the way from *span* (:meth:`SlotStates.early_targets`);
        returns the keys claimed (those no other run claimed)."""
        point, end = span
        ends = {layout.state_point(i): key for i, key in enumerate(keys)}
        targets = run.taking.early_targets(layout, keys, point, end)
        return [ends[n] for n in targets if n in ends and self.claims.claim(ends[n], n)]


def stored_starts(states: TieredStateStore, budget_bytes: int, layout: PromptLayout, keys: list[str], end: int) -> list[StateNode]:
    """The states in *states* a run of *layout* (prefilled to *end*) may start from, deepest
    first: those of its *keys* at their state points, and for a caller's prompt any stored
    state of its leading tokens (keyed by leading tokens, wherever the earlier prompt's cuts
    were: which of them the prompt may go on from is ``cut_allowed``'s, since a batch
    boundary may be a few tokens before its end). The caller holds the store lock."""
    if not keys:
        return []
    stored = [
        node for node in states.candidates(keys, budget_bytes=budget_bytes)
        if layout.state_point(keys.index(node.key)) == node.n_tokens
    ]
    if not layout.caller_prompt:
        return stored
    lengths = sorted({n.n_tokens for n in states.tree.nodes if n.label == "text" and n.n_tokens < end})
    prefixes = prefix_keys(states.root_key, layout.tokens, lengths) if lengths else []
    found = {node.key: node for node in stored}
    found.update((key, node) for key in prefixes if key in states and (node := states.tree.get(key)) is not None)
    return sorted(found.values(), key=lambda node: -node.n_tokens)


def depth_at(layout: PromptLayout, point: int) -> int:
    """The segments whose state points lie within the first *point* tokens."""
    return sum(1 for i in range(len(layout.segments) - 1) if 0 < layout.state_point(i) <= point)

