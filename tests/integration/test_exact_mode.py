"""Exact mode (the default): every answer is the cache-off answer, token for token, whatever
the QA bank holds; semantic mode never serves below tau, across bindings, or stale entries.

Real model and embedder, greedy decoding. The cache-off reference is the same pipeline
with the QA bank, chunk states and drafts off: one token at a time after the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from percache_core.config import DEFAULT_SYSTEM_PROMPT
from percache_core.engines.llama_cpp.drafting import (
    AnswerDraft,
    DraftPlan,
    PromptLookup,
    deviation_bound,
    greedy_tokens,
)
from percache_core.inspection import internals

# (stored question, paraphrases, near misses) over the demo corpus; written for this
# test, apart from tests/data/verify_pairs.jsonl.
FAMILIES = [
    (
        "When is the presentation rehearsal for the launch talk?",
        ["When will the launch talk rehearsal take place?", "What day is the rehearsal of the launch talk?"],
        [
            "When is the presentation rehearsal for the launch talk not happening?",  # negation
            "When is the launch party for the presentation?",  # attribute
        ],
    ),
    (
        "How much did finance approve for the Harbor design work?",
        ["What amount did finance approve for Harbor's design work?"],
        [
            "How much is reserved for illustration licences in the Harbor budget?",  # attribute
            "How much did Jonas approve for the Harbor contractor hours?",  # name
        ],
    ),
    (
        "When does my flight land in Lisbon?",
        ["At what time does my flight arrive in Lisbon?"],
        [
            "When does my flight leave Amsterdam?",  # place
            "Which seat do I have on the flight to Lisbon?",  # attribute
        ],
    ),
    (
        "Who will build the booking API for Harbor?",
        ["Who is building Harbor's booking API?"],
        [
            "When is the first version of the booking API due?",  # date
            "Who presented the goal of Harbor at the kickoff?",  # swapped role
        ],
    ),
]

REFERENCE = {"qa_bank": False, "chunk_states": False, "prompt_lookup": False}


@pytest.fixture
def reference(make_cache):
    return make_cache("reference", **REFERENCE, max_new_tokens=32)


def test_default_mode_gives_the_cache_off_answer_for_paraphrases_and_near_misses(make_cache, reference):
    pc = make_cache("exact", max_new_tokens=32)
    assert pc.config.tiers.qa_mode == "exact"
    served = 0
    for stored, paraphrases, near_misses in FAMILIES:
        for question in [stored, *paraphrases, *near_misses, stored]:
            expected = reference.answer(question)
            got = pc.answer(question)
            assert got.text == expected.text, (question, got.source, got.matched_question)
            assert got.generated_tokens == expected.generated_tokens
            assert not got.approximate
            served += got.answered_before
    assert served >= 3  # repeats and paraphrases whose answer is the stored one, verified


def test_exact_answers_follow_prompt_and_settings_changes(make_cache):
    question = FAMILIES[0][0]
    pc = make_cache("binding", max_new_tokens=32)
    pc.answer(question)
    assert pc.answer(question).source == "prompt_answer"
    german = "Du bist ein persönlicher Assistent. Antworte kurz auf Deutsch, nur mit den Notizen unten."
    pc.configure(system_prompt=german)
    other_prompt = make_cache("german-off", **REFERENCE, max_new_tokens=32, system_prompt=german)
    answer = pc.answer(question)
    assert answer.text == other_prompt.answer(question).text
    assert not answer.answered_before  # the stored answer belongs to another prompt
    pc.configure(system_prompt=DEFAULT_SYSTEM_PROMPT, max_new_tokens=6)
    short = make_cache("short-off", **REFERENCE, max_new_tokens=6)
    assert pc.answer(question).text == short.answer(question).text


def test_a_changed_document_changes_the_exact_answer(make_cache, corpus):
    question = "When is the presentation rehearsal for the launch talk?"
    pc = make_cache("changing", max_new_tokens=32)
    before = pc.answer(question)
    assert pc.answer(question).source == "prompt_answer"
    moved = dict(next(d for d in corpus["documents"] if d["id"] == "mail-rehearsal"))
    moved["text"] = moved["text"].replace("Thursday at 4 pm", "Friday at 11 am").replace("Birch", "Oak")
    assert moved["text"] != next(d for d in corpus["documents"] if d["id"] == "mail-rehearsal")["text"]
    pc.add_documents([moved])
    reference = make_cache("changed-off", **REFERENCE, max_new_tokens=32)
    reference.add_documents([moved])
    after = pc.answer(question)
    assert after.text == reference.answer(question).text
    assert after.text != before.text


def test_semantic_mode_never_serves_below_tau_or_across_bindings(make_cache, embedder):
    stored, (paraphrase, *_), _ = FAMILIES[0]
    pc = make_cache("semantic", qa_mode="semantic", max_error_rate=1.0, chunk_states=False, max_new_tokens=24)
    pc.answer(stored)
    similarity = float(embedder.embed([stored])[0] @ embedder.embed([paraphrase])[0])
    below = pc.answer(paraphrase, similarity_threshold=min(1.0, similarity + 0.01))
    assert not below.answered_before
    at = pc.answer(paraphrase, similarity_threshold=similarity - 0.01)
    assert at.source == "qa_bank" and at.approximate and at.similarity >= similarity - 0.01
    assert not pc.answer(stored, max_new_tokens=8).answered_before  # other settings: other binding
    pc.configure(system_prompt="Answer in one word, from the notes below.")
    assert not pc.answer(stored).answered_before  # other prompt


def test_semantic_mode_never_serves_a_stale_entry(make_cache, corpus):
    question = "When is the presentation rehearsal for the launch talk?"
    pc = make_cache("stale", qa_mode="semantic", max_error_rate=1.0, chunk_states=False, max_new_tokens=24)
    before = pc.answer(question)
    assert pc.answer(question).source == "qa_bank"
    moved = dict(next(d for d in corpus["documents"] if d["id"] == "mail-rehearsal"))
    moved["text"] = moved["text"].replace("Thursday at 4 pm", "Friday at 11 am")
    pc.add_documents([moved])
    for entry in internals(pc).qa_bank.entries:  # as in a process that did not see the change
        internals(pc).qa_bank.correct(entry.id, entry.answer, stale=False)
    after = pc.answer(question)
    assert not after.answered_before
    assert after.text != before.text
    assert pc.stats()["stale_dropped"] == 1


def test_remembered_answers_are_never_replaced_by_the_models(make_cache):
    pc = make_cache("remember", max_new_tokens=16)
    question = "When is my dentist appointment?"
    pc.caller.remember(question, "Monday 14 April, 8:15 am.", binding=pc.caller.binding())
    pc.answer(question)  # the model answers the same question under the same binding
    kept = [e for e in internals(pc).qa_bank.entries if e.question == question]
    assert [e.answer for e in kept] == ["Monday 14 April, 8:15 am."]


def test_a_remembered_answer_survives_new_documents_and_is_answered_as_given(make_cache):
    pc = make_cache("remembered", documents=False, max_new_tokens=16)
    pc.add_documents(
        [
            {"id": "van", "text": "The delivery van is blue and parked behind the studio."},
            {"id": "lunch", "text": "Lunch with Ana is on Friday at noon at the harbour cafe."},
            {"id": "api", "text": "The booking API is late because the vendor changed its schema."},
        ]
    )
    question = "What colour is the van?"
    pc.caller.remember(question, "The van is red.")
    pc.add_documents([{"id": "n1", "text": "The garage code is 4417."}])  # unrelated, in every top-k
    pc.warm(progress=False)
    hit = pc.caller.lookup(question)
    assert hit is not None and hit.text == "The van is red."
    answer = pc.answer(question)
    assert (answer.text, answer.source, answer.generated_tokens) == ("The van is red.", "remembered", 0)
    assert "".join(pc.answer_stream(question)) == "The van is red."
    pc.configure(qa_bank=False)  # the model's own answer, from the documents
    assert "red" not in pc.answer(question).text


def test_drafts_right_or_wrong_give_the_one_at_a_time_tokens(engine):
    prompt = engine.tokenize(
        "Note: Flight SW 482 leaves Amsterdam on 22 May at 7:05 am and lands in Lisbon at 9:20 am.\n\n"
        "Question: When does the flight land?\nAnswer:",
        True,
    )
    with engine.lock:
        bound = deviation_bound(engine)
        engine.reset()
        engine.eval(prompt)
        reference = list(engine.generate(max_new_tokens=24))
        wrong = engine.tokenize(" It lands in Porto at noon on Sunday, after a long delay.")
        for drafts in ([AnswerDraft([reference])], [AnswerDraft([wrong])], [PromptLookup(prompt)]):
            engine.reset()
            engine.eval(prompt)
            assert list(greedy_tokens(engine, DraftPlan(24, drafts, bound))) == reference
        engine.reset()
    assert bound > 0


def _shared_questions(dataset: str, count: int) -> list[tuple[list[dict], str]]:
    folder = Path(__file__).resolve().parents[3] / "shared" / "data" / dataset
    if not folder.is_dir():
        pytest.skip(f"{folder} is not there (../shared/data beside the checkout)")
    documents = [json.loads(line) for line in (folder / "documents.jsonl").open()]
    queries = [json.loads(line) for line in (folder / "queries.jsonl").open()]
    user = queries[0]["user"]
    docs = [
        {"id": d["doc_id"], "text": d["text"], "metadata": {"meeting_id": d.get("meeting_id", "")}}
        for d in documents
        if d["user"] == user
    ]
    picked = np.random.default_rng(7).choice([q for q in queries if q["user"] == user], count, replace=False)
    return [(docs, q["question"]) for q in picked]


@pytest.mark.parametrize("dataset", ["squad11-dev", "qmsum"])
def test_prompt_lookup_drafts_change_no_output(make_cache, dataset):
    questions = _shared_questions(dataset, 3)
    documents = questions[0][0][:30]  # the prompts' passages among a user's first 30 documents
    off = make_cache(f"{dataset}-off", documents=False, **REFERENCE, max_new_tokens=32)
    drafted = make_cache(
        f"{dataset}-lookup", documents=False, qa_bank=False, chunk_states=False, prompt_lookup=True, max_new_tokens=32
    )
    off.add_documents(documents)
    drafted.add_documents(documents)
    accepted = 0
    for _, question in questions:
        expected, got = off.answer(question), drafted.answer(question)
        assert got.text == expected.text, question
        assert got.generated_tokens == expected.generated_tokens
        accepted += got.draft_tokens_accepted
    assert drafted.stats()["draft_tokens_accepted"] == accepted
