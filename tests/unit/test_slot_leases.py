"""Slot leases: which slot a run gets, who waits for whom, and which runs shared batches."""

from __future__ import annotations

import threading
import time

import pytest

from percache_core.engines.llama_server.slot_leases import SlotLeases


def first(free: list[int]) -> int:
    return free[0]


def test_runs_get_different_slots_and_overlapping_runs_are_batched() -> None:
    leases = SlotLeases(3)
    with leases.one(first) as (a, mark_a):
        assert not mark_a.batched
        with leases.one(first) as (b, mark_b):
            assert (a, b) == (0, 1) and leases.leased == [0, 1]
            assert mark_a.batched and mark_b.batched
    assert leases.leased == []


def test_on_a_batch_invariant_server_overlapping_runs_get_their_slots_and_count_as_alone() -> None:
    leases = SlotLeases(2, invariant=True)
    with leases.one(first) as (a, mark_a):
        with leases.one(first) as (b, mark_b):
            assert (a, b) == (0, 1) and leases.alone_now(mark_b)
    assert not mark_a.batched and not mark_b.batched


def test_a_run_after_another_finished_computing_is_alone() -> None:
    leases = SlotLeases(2)
    with leases.one(first) as (_, mark_a):
        leases.done_computing(mark_a)  # its reply is out; a slot save may follow
        with leases.one(first) as (_, mark_b):
            assert not mark_b.batched
    assert not mark_a.batched


def test_a_run_whose_overlap_ended_before_it_sent_anything_is_alone() -> None:
    leases = SlotLeases(2)
    with leases.one(first) as (_, mark_a):
        with leases.one(first) as (_, mark_b):
            assert mark_b.batched and not leases.alone_now(mark_b)  # the other still computes
            leases.done_computing(mark_a)  # (e.g. its client went away)
            assert leases.alone_now(mark_b) and not mark_b.batched
    assert mark_a.batched  # what it computed may have shared batches: kept as such


def test_a_request_the_server_places_waits_for_saves_of_runs_that_computed_alone() -> None:
    leases = SlotLeases(3)
    sent = threading.Event()
    with leases.one(first) as (_, saving):
        leases.done_computing(saving)  # alone and done computing: its slot save may follow

        def batched_run() -> None:
            with leases.one(first) as (_, mark):
                leases.wait_until_no_saves(mark)
                sent.set()

        with leases.one(first):  # another run computes beside
            thread = threading.Thread(target=batched_run)
            thread.start()
            time.sleep(0.05)
            assert not sent.is_set()  # the first run may still save its slot
        time.sleep(0.05)
        assert not sent.is_set()
    thread.join(5)
    assert sent.is_set()  # the first lease ended: nothing can save any more


def test_a_lone_run_waits_for_a_run_that_is_done_computing_to_give_its_slot_back() -> None:
    leases = SlotLeases(2)
    cleared = threading.Event()
    with leases.one(first) as (_, ending):
        leases.done_computing(ending)  # its cells stay in its slot until its lease ends

        def lone_run() -> None:
            with leases.one(first) as (_, mark):
                assert leases.alone_now(mark)
                leases.wait_while_ending(mark)
                cleared.set()

        thread = threading.Thread(target=lone_run)
        thread.start()
        time.sleep(0.05)
        assert not cleared.is_set()
    thread.join(5)
    assert cleared.is_set()


def test_a_run_waits_while_every_slot_is_leased() -> None:
    leases = SlotLeases(1)
    got: list[float] = []

    def second() -> None:
        with leases.one(first):
            got.append(time.monotonic())

    with leases.one(first):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.2)
        assert not got  # still waiting
        released = time.monotonic()
    thread.join(2)
    assert got and got[0] >= released


def test_the_whole_server_waits_for_leases_and_holds_new_ones_back() -> None:
    leases = SlotLeases(2)
    order: list[str] = []

    def measure() -> None:
        with leases.whole():
            order.append("whole")
            with leases.whole():  # re-entrant in its thread
                with leases.one(first) as (slot, mark):  # the holder may use any slot
                    assert slot == 0 and not mark.batched
            time.sleep(0.1)
        order.append("whole done")

    with leases.one(first):
        thread = threading.Thread(target=measure)
        thread.start()
        time.sleep(0.1)
        order.append("run done")
    thread.join(2)
    with leases.one(first):
        order.append("next run")
    assert order == ["run done", "whole", "whole done", "next run"]


def test_users_wait_for_idle_work_and_idle_work_for_users() -> None:
    leases = SlotLeases(4)
    events: list[str] = []

    def user() -> None:
        with leases.one(first):
            events.append("user")

    with leases.one(first, idle=True) as (_, idle_mark):
        thread = threading.Thread(target=user)
        thread.start()
        time.sleep(0.15)
        events.append("idle yields")
    thread.join(2)
    assert events == ["idle yields", "user"] and not idle_mark.batched


def test_a_free_slot_is_leased_for_a_save_only_when_free() -> None:
    leases = SlotLeases(2)
    with leases.one(first) as (slot, _):
        with leases.if_free(slot) as free:
            assert not free
        with leases.if_free(1) as free:
            assert free and leases.leased == [0, 1]
    assert leases.leased == []


def test_a_server_has_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        SlotLeases(0)


def test_a_new_run_waits_for_a_slot_save_to_be_made() -> None:
    leases = SlotLeases(4)
    started: list[float] = []

    def run() -> None:
        with leases.one(first):
            started.append(time.monotonic())

    with leases.if_free(0) as free:  # the save a reply left, being made
        assert free
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.15)
        assert not started  # (its states are to be found by the next run)
        saved = time.monotonic()
    thread.join(2)
    assert started and started[0] >= saved


def test_a_run_waits_until_another_is_done_computing_or_gives_up() -> None:
    leases = SlotLeases(2)
    with leases.one(first) as (_, leader):
        threading.Timer(0.1, leases.done_computing, args=(leader,)).start()
        started = time.monotonic()
        assert leases.wait_done_computing(leader, None, 10.0) and time.monotonic() - started < 5.0
    with leases.one(first) as (_, leader):
        assert not leases.wait_done_computing(leader, None, 0.1)  # still computing: it gave up
        assert not leases.wait_done_computing(leader, lambda: True, 10.0)  # its client went away


def test_a_run_waiting_for_company_goes_on_once_another_lease_computes_beside_it() -> None:
    leases = SlotLeases(2)
    with leases.one(first) as (_, waiting):
        joined = threading.Event()

        def join() -> None:
            with leases.one(first) as (_, other):
                assert other.batched
                joined.wait(10.0)

        beside = threading.Thread(target=join)
        threading.Timer(0.1, beside.start).start()
        started = time.monotonic()
        assert leases.wait_batched(waiting, 10.0) and waiting.batched and time.monotonic() - started < 5.0
        joined.set()
        beside.join()
    with leases.one(first) as (_, alone):
        assert not leases.wait_batched(alone, 0.05) and not alone.batched  # nobody came: it runs alone
