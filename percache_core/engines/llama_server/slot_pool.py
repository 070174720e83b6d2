"""The slots of a llama-server as a :class:`~percache_core.engines.llama_server.runner.ServerRunner`
uses them: one :class:`~percache_core.engines.llama_server.slot.ServerSlot` (what it holds)
and one :class:`~percache_core.engines.llama_server.states.SlotStates` (the states a
request leaves in it) per slot, leased run by run (:meth:`SlotPool.lease`).

A run gets the free slot that holds the longest prefix of its prompt (its prefill may go on
from there), else the least recently used one (a stored state restores into any slot, and
the others keep what they hold for their own next requests), as llama-server picks a slot
for a request that names none. The slot save a relayed reply left for after it is made
before anything else uses that slot (:meth:`SlotPool.lease`) or when the runner settles
(:meth:`SlotPool.settle`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...serving.live_prefix import common_prefix
from .server_http import ServerError
from .slot import ServerCuts, ServerSlot
from .slot_leases import RunMark, SlotLeases
from .slot_probe import prefill_fresh
from .states import SlotStates

RECENT_PROMPTS = 32  # finished leases' prompts kept to tell what a server likely still holds

if TYPE_CHECKING:
    from ...serving.state_runner import StateRunner
    from .server import LlamaServer


@dataclass(frozen=True)
class SlotRun:
    """One run's slot, the states it takes from it, and its :class:`RunMark`."""

    slot: ServerSlot
    taking: SlotStates
    mark: RunMark


class SlotPool:
    """Every slot of *server* for *runner* (see the module); the states each slot leaves are
    stored under *store_lock*."""

    def __init__(self, runner: StateRunner, server: LlamaServer, cuts: ServerCuts, store_lock: threading.RLock) -> None:
        self.leases: SlotLeases = server.leases
        self.slots = [ServerSlot(server, cuts, index) for index in range(self.leases.count)]
        self.takings = [SlotStates(runner, slot, store_lock) for slot in self.slots]
        self._uses = 0
        self._erased: set[int] = set()  # slots emptied by clear_others and not leased since
        self._prompts: dict[int, tuple[int, Sequence[int], RunMark]] = {}  # leased slot -> (lease order, prompt, run)
        self._finished: deque[tuple[Sequence[int], RunMark]] = deque(maxlen=RECENT_PROMPTS)  # the latest leases' prompts
        self._waiting: dict[RunMark, RunMark] = {}  # a run waiting for a twin -> that twin (see twin)
        self._prompts_lock = threading.Lock()

    def chooser(self, tokens: Sequence[int]) -> Callable[[list[int]], int]:
        """Picks, among free slots, the one holding the longest prefix of *tokens*, the
        least recently used among equals."""

        def choose(free: list[int]) -> int:
            return max(free, key=lambda index: (self.slots[index].held_prefix(tokens), -self.slots[index].last_used))

        return choose

    @contextmanager
    def lease(self, tokens: Sequence[int], *, idle: bool = False) -> Iterator[SlotRun]:
        """Lease a slot for a run of *tokens* (waits while every slot is leased, and while
        the other kind of work, idle or a user's, computes); the slot save its last reply
        left is made first."""
        with self.leases.one(self.chooser(tokens), idle=idle) as (index, mark):
            self._uses += 1
            self.slots[index].last_used = self._uses
            self._erased.discard(index)
            run = SlotRun(self.slots[index], self.takings[index], mark)
            with self._prompts_lock:
                self._prompts[index] = (self._uses, tokens, mark)
            try:
                run.taking.settle()
                yield run
            finally:
                with self._prompts_lock:
                    self._prompts.pop(index, None)
                    self._finished.append((tokens, mark))

    def recent_prefix(self, tokens: Sequence[int]) -> int:
        """The most leading tokens of *tokens* that the prompt of one of the latest
        ``RECENT_PROMPTS`` finished leases shares (a server keeps those in its slots or its
        prompt cache, as far as another request has not pushed them out)."""
        with self._prompts_lock:
            return max((common_prefix(prompt, tokens) for prompt, _ in self._finished), default=0)

    def under_load(self) -> bool:
        """Whether the latest finished lease shared the server's batches with another."""
        with self._prompts_lock:
            return bool(self._finished) and self._finished[-1][1].batched

    def twin(self, run: SlotRun, tokens: Sequence[int], least: int) -> RunMark | None:
        """The run leased before *run*, still computing, not itself waiting for a twin and
        not yet waited for, whose prompt shares the most leading tokens with *tokens*, at
        least *least* of them; None where there is none. (One follower a run: the slot a
        run leaves holds its prompt for one next request; the server saves it for others
        only once another request starts while it is idle.)"""
        with self._prompts_lock:
            mine = self._prompts.get(run.slot.index)
            if mine is None:
                return None
            taken = set(self._waiting) | set(self._waiting.values())
            shared = [
                (common_prefix(prompt, tokens), mark)
                for order, prompt, mark in self._prompts.values()
                if order < mine[0] and mark.computing and mark not in taken
            ]
        found = max(shared, key=lambda pair: pair[0], default=(0, None))
        return found[1] if found[0] >= least else None

    @contextmanager
    def waiting(self, run: SlotRun, twin: RunMark) -> Iterator[None]:
        """*run* waits for *twin* within this block: no other run waits for either
        meanwhile (a run after them goes on beside them, or waits for another run, rather
        than behind a chain of waits or a run already waited for)."""
        with self._prompts_lock:
            self._waiting[run.mark] = twin
        try:
            yield
        finally:
            with self._prompts_lock:
                self._waiting.pop(run.mark, None)

    def settle(self) -> None:
        """Make the slot saves that relayed replies left, in the slots free now (a leased
        slot's is made by its lease)."""
        for index, taking in enumerate(self.takings):
            if taking.pending:
                with self.leases.if_free(index) as free:
                    if free:
                        taking.settle()

    def clear_others(self, run: SlotRun) -> None:
        """Empty every other free slot (their pending saves made first), for a run on a
        server whose slots share one KV cache: a run computes as on an empty server only so
        (:mod:`~percache_core.engines.llama_server.slot_probe`). Where the run's slot holds
        nothing PerCache may go on from, a one-token request in it has the server save its
        idle slots to its RAM prompt cache and clear them (:func:`clear_idle_slots`:
        the requests of other clients over those prompts, batched later, still find them,
        as on the server alone); the slots it did not clear, and all of them where the run's
        slot holds such cells, are erased. Slots emptied before and not leased since are
        left alone. A slot still leased by a run that is done computing (ending) is waited
        for: its cells would otherwise stay beside this run's."""
        self.leases.wait_while_ending(run.mark)
        with ExitStack() as held:
            free = [
                index for index, slot in enumerate(self.slots)
                if slot is not run.slot and index not in self._erased and held.enter_context(self.leases.if_free(index))
            ]  # (held until emptied: no slot save runs meanwhile)
            if not free:
                return
            for index in free:
                self.takings[index].settle()
            server = run.slot.server
            left = clear_idle_slots(server, run.slot.index) if run.slot.content is None else free
            for index in free:
                if index in left:
                    server.erase_slot(index)
                self.slots[index].content = None
                self._erased.add(index)

    def quiet_for(self, run: SlotRun) -> None:
        """Before *run* sends a request that the server places in a slot of its choice: wait
        until no other lease may still save its slot (each other run is computing, or shares
        batches and so keeps nothing), then make the slot saves that relayed replies left in
        the free slots; otherwise the request could land in a slot before its save, and the
        save would take its cells."""
        self.leases.wait_until_no_saves(run.mark)
        self.settle()

    def forget_contents(self, *, but: SlotRun | None = None) -> None:
        """Mark every slot's content unknown (a request PerCache did not run, or one the
        server placed, may have changed any of them), *but*'s own slot aside."""
        for index, slot in enumerate(self.slots):
            if but is None or slot is not but.slot:
                slot.content = None
                self._erased.discard(index)


def clear_idle_slots(server: LlamaServer, slot: int) -> list[int]:
    """Start a one-token request in *slot* of *server* (prefill only, nothing reused): a
    server with ``--cache-idle-slots`` (its default, with ``--cache-ram``, in one KV cache)
    saves every idle slot to its RAM prompt cache and clears it as the request starts, so
    that its requests over those prompts find them there. Returns the other slots still
    holding tokens (``GET /slots``; every other slot where that endpoint is off)."""
    prefill_fresh(server, [0], slot)
    others = [index for index in range(server.total_slots) if index != slot]
    try:
        listed = server.http.call("GET", "/slots")
    except ServerError:
        return others
    if not isinstance(listed, list):
        return others
    held = {int(entry.get("id", -1)) for entry in listed if isinstance(entry, dict) and entry.get("n_prompt_tokens")}
    return [index for index in others if index in held]
