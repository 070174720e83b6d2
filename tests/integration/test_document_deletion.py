"""Deleting documents: nothing made from their text stays, and answers become those of a
cache that never held them. Real model and embedder for answers; the fake engine for input
checks and bookkeeping."""

from __future__ import annotations

import pytest

from percache_core import InvalidDocumentError
from percache_core.errors import StorageWriteError
from percache_core.inspection import internals

REFERENCE = {"qa_bank": False, "chunk_states": False, "prompt_lookup": False}
QUESTION = "When is the presentation rehearsal for the launch talk?"


def test_a_deleted_document_leaves_no_chunk_answer_or_state_behind(make_cache, corpus):
    pc = make_cache("deleting")
    before = pc.answer(QUESTION)
    assert any(i.startswith("mail-rehearsal#") for i in before.chunk_ids)
    pc.answer("Which seat do I have on the flight to Lisbon?")  # an answer from other documents
    stored = {node.key: node for node in internals(pc).tree.nodes}
    assert any(node.depth > 2 for node in stored.values())

    assert pc.delete_documents(["mail-rehearsal", "no-such-document"]) == 1

    assert all(c.doc_id != "mail-rehearsal" for c in internals(pc).knowledge.chunks)
    assert all(
        not any(i.startswith("mail-rehearsal") for i in entry.chunk_ids) for entry in internals(pc).qa_bank.entries
    )
    assert len(internals(pc).qa_bank) == 1  # the flight answer stays
    kept = {node.key: node for node in internals(pc).tree.nodes}
    assert kept and all(node.depth <= 2 and not node.label.startswith("mail-rehearsal") for node in kept.values())
    for key in set(stored) - set(kept):
        assert internals(pc).states.local.blob_path(key) is None  # the state file is gone too

    never_had_it = make_cache("never-had-it", documents=False, **REFERENCE)
    never_had_it.add_documents([d for d in corpus["documents"] if d["id"] != "mail-rehearsal"])
    after = pc.answer(QUESTION)
    assert after.text == never_had_it.answer(QUESTION).text
    assert "mail-rehearsal#c000" not in after.chunk_ids

    reopened = make_cache("deleting", documents=False)  # another cache on the same folder
    assert all(c.doc_id != "mail-rehearsal" for c in internals(reopened).knowledge.chunks)


def test_deletion_checks_its_input_before_any_work(fake_cache):
    pc = fake_cache()
    chunks = len(internals(pc).knowledge)
    for bad, error in [
        ("mail-rehearsal", TypeError),
        (None, TypeError),
        ([""], InvalidDocumentError),
        (["mail-rehearsal", 3], InvalidDocumentError),
    ]:
        with pytest.raises(error):
            pc.delete_documents(bad)
    assert len(internals(pc).knowledge) == chunks  # nothing deleted by a call that failed
    assert pc.delete_documents([]) == 0
    assert pc.delete_documents(["no-such-document"]) == 0


def test_deletion_forgets_the_abstract_and_only_the_answers_made_from_the_document(fake_cache):
    pc = fake_cache(top_k=1)
    for question in [QUESTION, "When does my flight land in Lisbon?", "Who is my dentist?"]:
        pc.answer(question)
    abstract = internals(pc).scheduler.abstract
    abstract.lines, abstract.summarized = ["The rehearsal is on Thursday."], {c.id for c in internals(pc).knowledge.chunks}
    entries = internals(pc).qa_bank.entries
    used = {i.split("#")[0] for entry in entries for i in entry.chunk_ids}
    assert "mail-rehearsal" in used and len(used) >= 2
    assert pc.delete_documents(["mail-rehearsal"]) == 1
    assert abstract.lines == [] and abstract.pending(internals(pc).knowledge.chunks) == internals(pc).knowledge.chunks
    kept = [e.question for e in entries if not any(i.startswith("mail-rehearsal#") for i in e.chunk_ids)]
    assert kept and sorted(entry.question for entry in internals(pc).qa_bank.entries) == sorted(kept)


def test_a_deletion_that_fails_half_way_is_done_whole_by_a_retry(fake_cache, monkeypatch):
    pc = fake_cache(top_k=1)
    pc.answer(QUESTION)
    delete_chunks = internals(pc).knowledge.delete_documents

    def disk_full(doc_ids):
        raise StorageWriteError("disk full")

    monkeypatch.setattr(internals(pc).knowledge, "delete_documents", disk_full)
    with pytest.raises(StorageWriteError):
        pc.delete_documents(["mail-rehearsal"])
    assert any(c.doc_id == "mail-rehearsal" for c in internals(pc).knowledge.chunks)  # still there: retry works
    monkeypatch.setattr(internals(pc).knowledge, "delete_documents", delete_chunks)
    assert pc.delete_documents(["mail-rehearsal"]) == 1
    assert len(internals(pc).qa_bank) == 0 and all(c.doc_id != "mail-rehearsal" for c in internals(pc).knowledge.chunks)
