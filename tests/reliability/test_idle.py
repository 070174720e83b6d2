"""The idle worker: no rounds without work, time limits kept, users' answers kept."""

from __future__ import annotations

import time

from percache_core.inspection import internals
from percache_core.qa.bank import question_key

QUESTION = "When is the presentation rehearsal for the launch talk?"


def test_no_rounds_without_work_when_prediction_is_off(fake_cache):
    pc = fake_cache(prediction=False, knowledge_prefill=False)
    pc.answer(QUESTION)
    assert not internals(pc).scheduler.has_work()
    worker = pc.start_worker(idle_after_s=0.0)
    time.sleep(1.5)
    pc.stop_worker()
    assert worker.rounds == 0 and sum(internals(pc).engine.calls.values()) > 0


def test_a_round_that_finds_nothing_is_not_repeated_until_something_happens(fake_cache):
    pc = fake_cache(prediction=False)
    worker = pc.start_worker(idle_after_s=0.0)
    time.sleep(2.0)
    rounds = worker.rounds
    time.sleep(1.0)
    pc.stop_worker()
    assert rounds <= 2 and worker.rounds == rounds and worker.errors == 0


def test_the_worker_asks_for_work_once_per_quiet_period(fake_cache, monkeypatch):
    pc = fake_cache()
    asked: list[bool] = []
    monkeypatch.setattr(internals(pc).scheduler, "has_work", lambda own_pipeline=True: asked.append(own_pipeline) or False)
    pc.start_worker(idle_after_s=0.0)  # polls every 0.2 s
    time.sleep(1.0)
    once = len(asked)
    internals(pc).parts.activity.touch()  # something happened: ask again
    time.sleep(1.0)
    pc.stop_worker()
    assert once == 1 and len(asked) == 2


def test_warm_ends_near_its_time_limit(make_cache):
    pc = make_cache()
    started = time.perf_counter()
    report = pc.warm(max_seconds=3, progress=False)
    elapsed = time.perf_counter() - started
    assert report.out_of_time and not report.preempted
    assert elapsed < 3 + 4.0, elapsed  # within about one segment (a prefill or a token step)


def test_an_answered_user_entry_is_never_replaced_by_idle_work(fake_cache):
    pc = fake_cache()
    scope = {"meeting_id": "kickoff"}
    answer = pc.answer(QUESTION, scope=scope)
    entry_id = question_key(QUESTION, {"scope": scope, "binding": pc.caller.binding()})
    stored = internals(pc).qa_bank[entry_id]
    assert stored.answer == answer.text and stored.metadata["origin"] == "user"
    embedding = pc.embedder.embed([QUESTION])[0]
    for answer_text, origin in ((None, "predicted-history"), ("Another text.", "predicted-history"), ("x", "follow-up")):
        kept = internals(pc).qa_bank.put(
            QUESTION, embedding, answer_text, metadata={**stored.metadata, "origin": origin}
        )
        assert kept.answer == answer.text and kept.metadata["origin"] == "user"
