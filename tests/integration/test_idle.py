"""Idle-time prediction, population, conversion, refresh and pre-emption with the real model."""

import threading
import time

import pytest

from percache_core.inspection import internals

IDLE = dict(prediction_stride=2, abstract_batch_chunks=10, max_new_tokens=24)  # one summary call for the demo corpus
# rounds that run only the steps under test (each step has its own tests): prediction and
# its population without the knowledge prefill, the knowledge prefill without the abstract
# and prediction, and the other steps (refresh, follow-ups) without either
PREDICTION_ALONE = dict(IDLE, knowledge_prefill=False)
PREFILL_ALONE = dict(IDLE, prediction=False)
STEP_ALONE = dict(IDLE, prediction=False, knowledge_prefill=False)


def all_nodes_restorable(pc) -> bool:
    """Whether every stored node's path restores (its first state loaded, the slices after it appended)."""
    engine, states = internals(pc).engine, internals(pc).states

    def restores(node) -> bool:
        chain = states.chain(node)
        if not chain:
            return False
        first, *rest = chain
        data = states.get(first)
        if data is None or not engine.load_state(data, first.n_tokens):
            return False
        return all((piece := states.get(n)) is not None and engine.append_slice(piece, n.n_tokens) for n in rest)

    with engine.lock:
        return all(restores(node) for node in internals(pc).tree.nodes)


def test_warm_round_predicts_and_populates_both_tiers_below_the_cutoff(make_cache):
    pc = make_cache(similarity_threshold=0.85, **PREDICTION_ALONE)
    report = pc.warm(progress=False)
    assert report.strategy == "prefill_decode" and not report.preempted
    assert report.chunks_summarised == 10 and internals(pc).scheduler.abstract.lines
    assert 1 <= len(report.predicted) <= 2 and report.populated == len(report.predicted)
    predicted = [e for e in internals(pc).qa_bank.entries if e.metadata.get("origin") == "predicted-knowledge"]
    assert {e.question for e in predicted} == set(report.predicted)
    assert all(e.answer for e in predicted)
    assert len(internals(pc).tree) > 0 and report.prefill_tokens > 0 and report.decode_tokens > 0
    hit = pc.answer(report.predicted[0])
    assert hit.source == "prompt_answer" and hit.matched_question == report.predicted[0]
    idle = pc.stats()["idle"]["prefill_decode"]
    assert idle["rounds"] == 1 and idle["prefill_tokens"] == report.prefill_tokens and idle["seconds"] > 0


def test_prefill_only_above_the_cutoff_stores_pending_entries_that_are_never_served(make_cache):
    pc = make_cache(similarity_threshold=0.9, **PREDICTION_ALONE)
    report = pc.warm(progress=False)
    assert report.strategy == "prefill_only" and report.pending_stored == len(report.predicted) > 0
    assert report.decode_tokens > 0  # the abstract and the prediction itself decode
    pending = [e for e in internals(pc).qa_bank.entries if e.answer is None]
    assert {e.question for e in pending} == set(report.predicted)
    answer = pc.answer(pending[0].question)
    assert not answer.answered_before  # pending entries are never served
    assert answer.reused_chunks == len(answer.chunk_ids)  # but its chunk states were populated

    pc.configure(similarity_threshold=0.8)  # tau falls below the cutoff: convert
    converted = pc.warm(progress=False, max_predictions=0)
    assert converted.strategy == "prefill_decode" and converted.pending_decoded == len(pending) - 1
    assert all(e.answer for e in internals(pc).qa_bank.entries)


def test_new_documents_make_affected_answers_stale_until_refreshed(make_cache):
    pc = make_cache(**IDLE)
    first = pc.answer("When is the presentation rehearsal for the launch talk?")
    assert pc.answer("When is the presentation rehearsal for the launch talk?").source == "prompt_answer"
    pc.add_documents(
        [
            {
                "id": "mail-rehearsal-moved",
                "text": "From: Priya Raman\nSubject: Rehearsal moved\n\nThe presentation rehearsal for the launch talk moved to Friday at 10 am in the Oak room.",
            }
        ]
    )
    entry = next(e for e in internals(pc).qa_bank.entries if e.question.startswith("When is the presentation"))
    assert entry.metadata.get("stale") is True
    again = pc.answer("When is the presentation rehearsal for the launch talk?")
    assert not again.answered_before  # a stale answer is never served
    assert "mail-rehearsal-moved#c000" in again.chunk_ids
    assert first.chunk_ids != again.chunk_ids


def test_refresh_regenerates_stale_entries_in_idle_time(make_cache):
    pc = make_cache(**STEP_ALONE)
    pc.answer("How much budget did finance approve for the Harbor design work?")
    pc.add_documents(
        [
            {
                "id": "budget-update",
                "text": "Update: finance approved a Harbor design budget of 21,000 euros, up from 18,500 euros.",
            }
        ]
    )
    stale = [e for e in internals(pc).qa_bank.entries if e.metadata.get("stale")]
    assert len(stale) == 1
    report = pc.warm(progress=False, max_predictions=0)
    assert report.refreshed == 1
    refreshed = internals(pc).qa_bank[stale[0].id]
    assert not refreshed.metadata.get("stale") and "budget-update#c000" in refreshed.chunk_ids
    assert pc.answer("How much budget did finance approve for the Harbor design work?").answered_before


def test_a_similar_question_served_from_the_bank_gets_its_own_answer_later(make_cache):
    pc = make_cache(qa_mode="semantic", max_error_rate=1.0, **STEP_ALONE)  # exact mode never serves another question's answer
    pc.answer("How much budget did finance approve for the Harbor design work?")
    paraphrase = "How much money did finance approve for Harbor design?"
    assert pc.answer(paraphrase).source == "qa_bank"
    report = pc.warm(progress=False, max_predictions=0)
    assert report.followups_answered == 1
    own = pc.answer(paraphrase)
    assert own.source == "qa_bank" and own.matched_question == paraphrase


def test_a_user_question_preempts_a_running_round(make_cache, engine, monkeypatch):
    reference = make_cache("reference", qa_bank=False, chunk_states=False, **IDLE)
    expected = reference.answer("Why is the booking API late?").text
    # two summary calls: the question arrives while the second one holds the model (asked
    # between the two, it may take the model before the round does: then nothing waits)
    pc = make_cache(**{**IDLE, "prediction_stride": 5, "abstract_batch_chunks": 5})
    scheduler = internals(pc).scheduler
    in_second_call = threading.Event()
    done = {}
    round_eval = engine.eval

    def eval_watched(tokens, should_stop=None, **options):
        report = scheduler.round_report
        if threading.current_thread() is worker and report is not None and report.prefill_tokens:
            in_second_call.set()  # the round holds the model, its first call counted
        return round_eval(tokens, should_stop, **options)

    monkeypatch.setattr(engine, "eval", eval_watched)

    def idle_round():
        done["report"] = pc.warm(progress=False)
        done["warm_end"] = time.monotonic()

    worker = threading.Thread(target=idle_round)
    worker.start()
    assert in_second_call.wait(120)
    answer = pc.answer("Why is the booking API late?")
    answer_end = time.monotonic()
    worker.join()
    report = done["report"]
    # the round gave the model up mid-work, before the answer was done
    assert report.preempted and done["warm_end"] <= answer_end
    assert report.chunks_summarised < 10 and report.populated == 0
    assert answer.text == expected
    assert pc.stats()["idle"]["preemptions"] == 1
    assert all_nodes_restorable(pc)  # nothing half-written


def test_background_worker_runs_only_when_idle_and_allowed(make_cache):
    pc = make_cache(**PREDICTION_ALONE)
    allowed = threading.Event()
    worker = pc.start_worker(idle_after_s=0.3, should_run=allowed.is_set, round_seconds=120)
    time.sleep(1.0)
    assert worker.rounds == 0 and len(internals(pc).qa_bank) == 0  # not on charger: nothing ran
    allowed.set()
    deadline = time.monotonic() + 120
    while worker.rounds == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(internals(pc).qa_bank) > 0 and worker.errors == 0
    pc.stop_worker()
    assert not worker.running


@pytest.mark.parametrize("origin", ["history"])
def test_history_prediction_follows_user_questions(make_cache, origin):
    pc = make_cache(**PREDICTION_ALONE)  # only the history view is under test
    pc.answer("When is my dentist appointment?")
    pc.answer("What is my flight booking reference?")
    report = pc.warm(progress=False, knowledge_prediction=False)
    assert report.history.llm_calls >= 1
    assert internals(pc).parts.activity.new_history == 0
    origins = {e.metadata.get("origin") for e in internals(pc).qa_bank.entries}
    assert f"predicted-{origin}" in origins or report.history.accepted == 0


def test_knowledge_prefill_gives_every_prompt_its_first_chunk_exactly(make_cache):
    pc = make_cache("prefilled", **PREFILL_ALONE)
    report = pc.warm(progress=False, max_predictions=0)
    first_chunks = {chunk.id for chunk in internals(pc).knowledge.chunks}
    stored = {node.label for node in internals(pc).tree.nodes if node.depth == 2}
    assert report.chunks_prefilled == len(first_chunks) and stored == first_chunks
    question = "When does my flight to Lisbon leave?"
    answer = pc.answer(question)
    assert answer.source == "chunk_states" and answer.reused_chunks >= 1
    plain = make_cache("plain", chunk_states=False, qa_bank=False, prediction=False, max_new_tokens=24)
    assert answer.text == plain.answer(question).text  # restoring never changes the answer
    assert all_nodes_restorable(pc)


def test_knowledge_prefill_pairs_give_a_prompt_its_first_two_chunks_exactly(make_cache):
    pc = make_cache("pairs", **PREFILL_ALONE)
    report = pc.warm(progress=False, max_predictions=0)
    assert report.pairs_prefilled >= 1 and all_nodes_restorable(pc)
    plain = make_cache("plain", chunk_states=False, qa_bank=False, prediction=False, max_new_tokens=24)
    question = internals(pc).knowledge.chunks[0].text  # ranks the chunk first and its neighbour second
    answer = pc.answer(question)
    assert answer.source == "chunk_states" and answer.reused_chunks >= 2
    assert answer.text == plain.answer(question).text


def test_a_knowledge_larger_than_the_budget_gets_the_paths_the_next_question_likely_needs(make_cache):
    budget = 12 * 1024 * 1024  # far less than every chunk's state
    pc = make_cache(chunk_state_budget_bytes=budget, **PREFILL_ALONE)
    report = pc.warm(progress=False, max_predictions=0)
    assert report.chunks_prefilled == 0 and report.predicted_paths_prefilled == 0  # no bulk, no question yet
    pc.answer("When does my flight to Lisbon leave?")
    report = pc.warm(progress=False, max_predictions=0)
    assert report.predicted_paths_prefilled >= 1 and report.chunks_prefilled == 0
    assert internals(pc).tree.bytes <= budget and all_nodes_restorable(pc)
    assert pc.warm(progress=False, max_predictions=0).predicted_paths_prefilled == 0  # nothing new asked
    question = "What time is the flight to Lisbon?"
    answer = pc.answer(question)
    plain = make_cache("plain", chunk_states=False, qa_bank=False, prediction=False, max_new_tokens=24)
    assert answer.text == plain.answer(question).text  # restoring never changes the answer
    prediction = pc.stats()["prediction"]
    assert prediction["questions"] == 1 and prediction["predicted_paths_prefilled"] == report.predicted_paths_prefilled


def test_history_predictions_are_asked_in_the_latest_questions_scope(make_cache):
    pc = make_cache(documents=False, **IDLE)
    pc.add_documents(
        [
            {
                "id": "kiln",
                "text": "The kiln firing is on Wednesday at 6 pm in the studio.",
                "metadata": {"meeting": "pottery"},
            },
            {
                "id": "glaze",
                "text": "Lee brings the blue glaze samples to the pottery studio.",
                "metadata": {"meeting": "pottery"},
            },
            {
                "id": "budget",
                "text": "The marketing budget for the spring launch is 4,000 euros.",
                "metadata": {"meeting": "launch"},
            },
        ],
        split=False,
    )
    pc.answer("When is the kiln firing?", scope={"meeting": "pottery"})
    report = pc.warm(progress=False, knowledge_prediction=False)
    history = [e for e in internals(pc).qa_bank.entries if e.metadata.get("origin") == "predicted-history"]
    assert report.history.llm_calls == 1 and history
    assert all(e.metadata["scope"] == {"meeting": "pottery"} for e in history)
    assert all(chunk_id.startswith(("kiln", "glaze")) for e in history for chunk_id in e.chunk_ids)
    assert pc.caller.lookup(history[0].question) is None  # scoped entries serve only that scope
    assert pc.caller.lookup(history[0].question, scope={"meeting": "pottery"}) is not None
