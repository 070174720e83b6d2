"""Streams never keep the model: abandoned, closed or dropped, the next question runs."""

from __future__ import annotations

import gc
import threading

QUESTION = "When is the presentation rehearsal for the launch talk?"
OTHER = "Who is presenting the quarterly budget?"


def finishes(work, timeout_s: float = 300.0):
    """Run *work* in a thread; its result, or fail when it does not finish (a hang)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "blocked: the model was not released"
    return result[0]


def test_a_stream_left_after_one_piece_does_not_block_its_own_thread(make_cache):
    pc = make_cache()
    reference = make_cache("reference", qa_bank=False, chunk_states=False)
    expected = reference.answer(OTHER).text
    stream = pc.answer_stream(QUESTION)
    for _piece in stream:
        break  # the caller stops reading and keeps the object
    answer = pc.answer(OTHER)  # same thread: must not hang
    assert answer.text == expected
    repeat = pc.answer(QUESTION)  # the abandoned stream's answer was finished and stored
    assert repeat.source == "prompt_answer" and repeat.text == reference.answer(QUESTION).text
    assert stream is not None


def test_dropped_and_closed_streams_release_the_model_for_other_threads(make_cache):
    pc = make_cache()
    dropped = pc.answer_stream(QUESTION)
    next(iter(dropped))
    del dropped
    gc.collect()
    closed = pc.answer_stream(OTHER)
    next(iter(closed))
    closed.close()
    answer = finishes(lambda: pc.answer("Where is the offsite?"))
    assert answer.text
    assert finishes(lambda: pc.warm(max_seconds=5, progress=False)) is not None
