"""Who uses which of a llama-server's slots, and which runs shared the server's batches.

A llama-server runs the requests of its slots together: a step of one request's prefill or
decode is batched with the others', and a batch's arithmetic differs from a lone request's
(measured: the same prompt's next-token log-probabilities change in the third decimal when
another slot decodes beside it, and Gemma 3's greedy text changes). A request that runs
alone is computed as a fresh server computes it, whichever slot it is in and whatever the
other slots hold (measured on both bundled models: identical log-probabilities in slot 0
of an empty server and in slot 3 beside two slots holding 4,000 tokens).

:class:`SlotLeases` hands the slots out: a run leases one (:meth:`SlotLeases.one`, the
slot its chooser picks among the free ones; it waits while every slot is leased), a
measurement or a passed-through request the whole server (:meth:`SlotLeases.whole`). Each
lease carries a :class:`RunMark` that says whether another lease was computing at any time
while it was (:attr:`RunMark.batched`): what such a run computed is the server's arithmetic
under that batching, so it is neither stored nor reused. Idle work's leases and users'
do not overlap: a user's lease waits for idle work to yield (idle work stops at its next
check once a user waits), and idle work waits for users.

On a server started batch-invariant (``ServerLaunch.batch_invariant``) a request computes
as alone whatever runs beside it, so there no run is marked batched.

Requests that other clients send the server directly are not seen here.

>>> leases = SlotLeases(2)
>>> with leases.one(lambda free: free[0]) as (first, mark):
...     with leases.one(lambda free: free[0]) as (second, other):
...         pass
>>> first, second, mark.batched, other.batched
(0, 1, True, True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .prefix_claims import WAIT_POLL_S


@dataclass(eq=False)
class RunMark:
    """One lease's run: whether it shared the server's batches with another
    (:attr:`batched`), as far as this process sees its traffic."""

    batched: bool = False
    computing: bool = True


class SlotLeases:
    """The slots of a server with *count* of them (see the module); *invariant*: a
    batch-invariant server's, whose runs are never marked batched."""

    def __init__(self, count: int, *, invariant: bool = False) -> None:
        if count < 1:
            raise ValueError(f"a server has at least one slot (got {count})")
        self.count = count
        self.invariant = invariant
        self._cond = threading.Condition()
        self._leased: dict[int, tuple[RunMark, str]] = {}  # slot -> (its run, "user", "idle" or "save")
        self._whole_owner: int | None = None  # the thread that holds the whole server
        self._whole_depth = 0
        self._whole_waiting = 0

    @property
    def leased(self) -> list[int]:
        """The slots leased now."""
        with self._cond:
            return sorted(self._leased)

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Hold every slot (re-entrant in one thread): waits until none is leased, and new
        leases wait until it is given back."""
        me = threading.get_ident()
        with self._cond:
            if self._whole_owner != me:
                self._whole_waiting += 1
                try:
                    self._cond.wait_for(lambda: self._whole_owner is None and not self._leased)
                finally:
                    self._whole_waiting -= 1
                self._whole_owner = me
            self._whole_depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._whole_depth -= 1
                if not self._whole_depth:
                    self._whole_owner = None
                    self._cond.notify_all()

    @contextmanager
    def one(self, choose: Callable[[list[int]], int], *, idle: bool = False) -> Iterator[tuple[int, RunMark]]:
        """Lease one slot: *choose* picks it among the free ones (called under the lease
        lock: keep it quick). Yields (slot, the run's :class:`RunMark`). Where this thread
        holds the whole server, any slot is its (and no other run computes)."""
        mark = RunMark()
        with self._cond:
            if self._whole_owner == threading.get_ident():
                slot = choose(list(range(self.count)))
                mark.computing = False
            else:
                self._cond.wait_for(lambda: self._may_lease(idle))
                slot = choose([s for s in range(self.count) if s not in self._leased])
                if not self.invariant and any(other.computing for other, _ in self._leased.values()):
                    mark.batched = True
                    for other, _ in self._leased.values():
                        other.batched = other.batched or other.computing
                    self._cond.notify_all()  # (a run waiting for company: wait_batched)
                self._leased[slot] = (mark, "idle" if idle else "user")
        try:
            yield slot, mark
        finally:
            with self._cond:
                if self._leased.get(slot, (None,))[0] is mark:
                    del self._leased[slot]
                mark.computing = False
                self._cond.notify_all()

    @contextmanager
    def if_free(self, slot: int) -> Iterator[bool]:
        """Lease *slot* if it is free now, without waiting (for a slot save, which computes
        nothing: new runs wait until it is made, so that they find its states); yields
        whether it was."""
        with self._cond:
            mine = self._whole_owner == threading.get_ident()
            free = mine or (self._whole_owner is None and slot not in self._leased)
            if free and not mine:
                self._leased[slot] = (RunMark(computing=False), "save")
        try:
            yield free
        finally:
            if free and not mine:
                with self._cond:
                    del self._leased[slot]
                    self._cond.notify_all()

    def done_computing(self, mark: RunMark) -> None:
        """Say that *mark*'s run sends the server nothing more that computes (a slot save
        may follow): leases taken from now on do not share its batches."""
        with self._cond:
            mark.computing = False
            self._cond.notify_all()

    def wait_done_computing(self, mark: RunMark, should_stop: Callable[[], bool] | None, timeout_s: float) -> bool:
        """Wait until *mark*'s run is done computing (True), *should_stop* says stop or
        *timeout_s* passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while mark.computing:
                left = deadline - time.monotonic()
                if left <= 0 or (should_stop is not None and should_stop()):
                    return False
                self._cond.wait(min(WAIT_POLL_S, left))
        return True

    def wait_batched(self, mark: RunMark, timeout_s: float) -> bool:
        """Wait until a lease taken from now on computes beside *mark*'s run, at most
        *timeout_s*; returns whether one does."""
        with self._cond:
            return self._cond.wait_for(lambda: mark.batched, timeout_s)

    def wait_until_no_saves(self, mark: RunMark) -> None:
        """Wait until every lease other than *mark*'s computes or shares batches (a run that
        computed alone and is done computing may still save its slot; a save's lease too)."""
        with self._cond:
            self._cond.wait_for(lambda: all(other.computing or other.batched for other, _ in self._leased.values() if other is not mark))

    def wait_while_ending(self, mark: RunMark) -> None:
        """Wait while a lease other than *mark*'s is held by a run that is done computing
        (it ends at once; a computing one makes *mark*'s run batched instead)."""
        with self._cond:
            self._cond.wait_for(lambda: all(other.computing for other, _ in self._leased.values() if other is not mark))

    def alone_now(self, mark: RunMark) -> bool:
        """For a run that has sent the server nothing yet: whether no other lease computes
        now; if so it runs alone, and a batched mark that an overlap now ended set is
        cleared (e.g. a run whose client went away, ending as this one was leased)."""
        with self._cond:
            if not any(other.computing for other, _ in self._leased.values() if other is not mark):
                mark.batched = False
            return not mark.batched

    def _may_lease(self, idle: bool) -> bool:
        if self._whole_owner is not None or self._whole_waiting or len(self._leased) >= self.count:
            return False
        if any(kind == "save" for _, kind in self._leased.values()):
            return False
        kinds = {kind for mark, kind in self._leased.values() if mark.computing}
        return not kinds or kinds == {"idle" if idle else "user"}
