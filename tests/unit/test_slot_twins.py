"""Twins on a server's slots: which run a batched run waits for, what a server likely
still holds (``SlotPool.twin``, ``SlotPool.recent_prefix``), and whether the server is under
load (``SlotPool.under_load``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from percache_core.engines.llama_server.slot_leases import SlotLeases
from percache_core.engines.llama_server.slot_pool import SlotPool

SHARED = list(range(600))  # the passages several clients ask over


def slot_pool(count: int) -> SlotPool:
    server: Any = SimpleNamespace(leases=SlotLeases(count))
    return SlotPool(runner=None, server=server, cuts=None, store_lock=threading.RLock())  # type: ignore[arg-type]


def test_runs_over_one_prefix_pair_up_and_never_wait_in_chains() -> None:
    pool = slot_pool(4)
    with pool.lease(SHARED + [1]) as first, pool.lease(SHARED + [2]) as second, pool.lease(SHARED + [3]) as third:
        assert pool.twin(first, SHARED + [1], 300) is None  # none leased before it
        assert pool.twin(second, SHARED + [2], 300) is first.mark
        assert pool.twin(second, SHARED + [2], 601) is None  # shares fewer tokens than asked
        with pool.waiting(second, first.mark):
            assert pool.twin(third, SHARED + [3], 300) is None  # neither the waiting one nor the one waited for
        assert pool.twin(third, SHARED + [3], 300) is first.mark
        pool.leases.done_computing(first.mark)
        assert pool.twin(third, SHARED + [3], 300) is second.mark  # the first is done: nothing to wait for there


def test_finished_prompts_are_what_the_server_likely_still_holds() -> None:
    pool = slot_pool(2)
    assert pool.recent_prefix(SHARED) == 0
    with pool.lease(SHARED + [1]):
        assert pool.recent_prefix(SHARED + [2]) == 0  # still running: not finished
    assert pool.recent_prefix(SHARED + [2]) == len(SHARED)
    assert pool.recent_prefix([7, 8]) == 0


def test_the_server_is_under_load_while_the_latest_finished_run_was_batched() -> None:
    pool = slot_pool(2)
    assert not pool.under_load()  # nothing ran yet
    with pool.lease(SHARED + [1]), pool.lease(SHARED + [2]):
        pass
    assert pool.under_load()  # the two shared the server's batches
    with pool.lease(SHARED + [3]):
        pass
    assert not pool.under_load()  # the latest ran alone

