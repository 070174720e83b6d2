"""Both tiers with the real model and embedder: budgets, persistence, streaming, threads."""

import json
import threading

import pytest

from percache_core import PerCache, PerCacheConfig
from percache_core.cli import main as cli_main
from percache_core.inspection import internals

QUESTIONS = [
    "When is my dentist appointment?",
    "What is my flight booking reference?",
    "Who will repair the boiler and when?",
    "What should I bring to dinner on Saturday?",
    "What did Ana say about the mooring map?",
    "Why is the booking API late?",
    "When is the next Harbor release planned?",
]


def blob_bytes_on_disk(pc) -> list[int]:
    return [internals(pc).states.local.blob_path(n.key).stat().st_size for n in internals(pc).tree.nodes]


def test_chunk_state_budget_holds_after_every_answer(make_cache):
    budget = 12 * 1024 * 1024
    pc = make_cache(qa_bank=False, chunk_state_budget_bytes=budget)
    largest = 0
    for question in QUESTIONS:
        pc.answer(question)
        sizes = blob_bytes_on_disk(pc)
        largest = max([largest, *sizes])
        assert sum(sizes) == internals(pc).tree.bytes
        assert internals(pc).tree.bytes <= budget + largest
    stats = pc.stats()["chunk_states"]
    assert stats["evictions"] > 0 and stats["bytes"] <= budget + largest
    # every remaining node still has its parent: only leaves were evicted
    keys = {n.key for n in internals(pc).tree.nodes}
    assert all(n.depth == 1 or n.parent_key in keys for n in internals(pc).tree.nodes)


def test_qa_bank_budget_holds_with_real_embeddings(make_cache):
    pc = make_cache(chunk_states=False, qa_bank_budget_bytes=6000, max_new_tokens=8)
    for question in QUESTIONS:
        pc.answer(question)
        assert internals(pc).qa_bank.bytes <= 6000 + max(internals(pc).qa_bank.entry_bytes(e.id) for e in internals(pc).qa_bank.entries)
    assert pc.stats()["qa_bank"]["evictions"] > 0


def test_everything_persists_across_reopen(make_cache, tmp_path, engine, embedder, corpus):
    pc = make_cache("persist")
    first = pc.answer(QUESTIONS[0])
    chunk_ids = [c.id for c in internals(pc).knowledge.chunks]
    pc.close()
    config = PerCacheConfig(max_new_tokens=24)
    with PerCache.open(tmp_path / "persist", config=config, engine=engine, embedder=embedder) as again:
        assert [c.id for c in internals(again).knowledge.chunks] == chunk_ids
        assert again.add_documents(corpus["documents"]) == []  # same texts: nothing new
        hit = again.answer(QUESTIONS[0])  # the prompt's stored answer, or the QA entry verified as a draft
        assert hit.answered_before and hit.text == first.text
        assert again.answer(QUESTIONS[0], similarity_threshold=1.0).source in {"qa_bank", "prompt_answer", "chunk_states"}
    with PerCache.open(
        tmp_path / "persist", config=config.replace(qa_bank=False), engine=engine, embedder=embedder
    ) as states_only:
        reused = states_only.answer(QUESTIONS[0])
        assert reused.source == "chunk_states" and reused.text == first.text


def test_changed_document_replaces_its_chunks(make_cache):
    pc = make_cache(documents=False)
    pc.add_documents([{"id": "memo", "text": "The picnic is on Sunday."}])
    assert [c.text for c in internals(pc).knowledge.chunks] == ["The picnic is on Sunday."]
    new = pc.add_documents([{"id": "memo", "text": "The picnic moved to Monday."}])
    assert [c.id for c in new] == ["memo#c000"]
    assert [c.text for c in internals(pc).knowledge.chunks] == ["The picnic moved to Monday."]


def test_retrieval_is_hybrid_and_the_question_is_embedded_once(make_cache, embedder):
    pc = make_cache()
    calls = []
    original = embedder.embed

    def counting(texts):
        calls.append(list(texts))
        return original(texts)

    embedder.embed = counting
    try:
        answer = pc.answer("When is my dentist appointment with Dr. Okafor?")
    finally:
        embedder.embed = original
    assert calls == [["When is my dentist appointment with Dr. Okafor?"]]
    assert answer.chunk_ids[0] == "mail-dentist#c000"
    assert pc.retrieve("booking reference KX7Q2M", 1)[0].chunk.doc_id == "mail-flight"  # BM25 term


def test_streaming_yields_the_same_answer(make_cache):
    pc = make_cache(qa_bank=False)
    reference = make_cache("other", qa_bank=False).answer(QUESTIONS[2])
    stream = pc.answer_stream(QUESTIONS[2])
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces).strip() == stream.answer.text == reference.text
    again = pc.answer(QUESTIONS[2], stream=True)
    assert "".join(again).strip() == reference.text and again.answer.source == "chunk_states"


def test_concurrent_questions_are_serialised_and_correct(make_cache):
    reference = make_cache("reference", qa_bank=False, chunk_states=False)
    expected = {q: reference.answer(q).text for q in QUESTIONS[:4]}
    pc = make_cache("threads", qa_bank=False)
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def ask(question: str) -> None:
        try:
            results[question] = pc.answer(question).text
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS[:4] * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == expected


def test_demo_script_shows_each_source_it_promises(make_cache, corpus):
    pc = make_cache("demo", max_new_tokens=48)
    for item in corpus["demo_questions"]:
        assert pc.answer(item["question"]).source == item["expect"], item["question"]


@pytest.mark.model  # runs the real model in this process or a subprocess
def test_cli_ingest_ask_and_stats(tmp_path, capsys):
    note = tmp_path / "note.txt"
    note.write_text("The garden party is on 9 August at the Lindqvist house.")
    cache = str(tmp_path / "cli")
    assert cli_main(["ingest", str(note), "--cache", cache]) == 0
    assert "added 1 chunks" in capsys.readouterr().out
    assert cli_main(["ask", "When is the garden party?", "--cache", cache, "--max-new-tokens", "12"]) == 0
    assert "August" in capsys.readouterr().out
    assert cli_main(["stats", "--cache", cache]) == 0
    summary = capsys.readouterr().out
    assert "answers        1 (every process that closed this folder" in summary  # ask ran in its own PerCache
    assert "1 entries" in summary and "1 chunks" in summary
    assert cli_main(["stats", "--cache", cache, "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)
    assert counted["queries"] == 1 and counted["qa_bank"]["entries"] == 1
    assert cli_main(["ask", " ", "--cache", cache]) == 2
