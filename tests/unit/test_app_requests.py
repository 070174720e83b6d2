"""Prediction in the apps' own requests, on a FakeEngine: the shape of an app's prompt is
learned from what it sends, idle rounds fill the leading states of its requests and run
predicted questions as it would send them, and the app's identical request is then served
by what idle work stored. What the model answers is checked with the real model in
tests/integration/test_app_requests.py."""

from __future__ import annotations

import pytest

from percache_core import Decoding
from percache_core.inspection import internals
from percache_core.serving.shapes import RequestShapes, decoding_from, decoding_record, split_request
from percache_core.storage import Store
from tests.fake_engine import FakeEngine
from tests.unit.test_fake_engine_flow import _Predictor

TEMPLATE = "Use the notes to answer briefly.\n\n{context}\n\nQuestion: {question}\nAnswer:"
DECODING = Decoding(max_new_tokens=8, stop=[])


def app_prompt(pc, question: str, k: int = 2) -> tuple[str, list[str]]:
    """The prompt an app that retrieves as PerCache does sends for *question*."""
    passages = [r.chunk.text for r in pc.retrieve(question, k)]
    return TEMPLATE.format(context="\n\n".join(passages), question=question), passages


def ask(pc, question: str) -> object:
    prompt, passages = app_prompt(pc, question)
    return pc.caller.complete(prompt, documents=passages, decoding=DECODING, question=question)


def test_a_request_is_split_into_the_apps_text_the_passages_and_the_question():
    prompt = TEMPLATE.format(context="Lunch is at noon.\n\nTea is at four.", question="When is tea?")
    split = split_request(prompt, ["Lunch is at noon.", "Tea is at four."], "When is tea?")
    assert split == ("Use the notes to answer briefly.\n\n", "\n\n", "\n\nQuestion: ", "\nAnswer:")
    assert split_request(prompt, ["Tea is at four.", "Lunch is at noon."], None) is None  # not in that order
    labelled = "[1] Lunch is at noon.\n[2] Tea is at four.\n[3] Cake is at five.\nQ: when?"
    assert split_request(labelled, ["Lunch is at noon.", "Tea is at four.", "Cake is at five."], "when?") is None
    decoding = Decoding(16, None, None, trim=True)
    assert decoding_from(decoding_record(decoding)).stop is None  # "the configured stop strings" stays so


def test_shapes_are_counted_kept_to_the_most_seen_and_persisted(tmp_path):
    store = Store(tmp_path / "meta")
    shapes = RequestShapes(store)
    for index in range(20):  # 20 templates, the first one seen three times
        for _ in range(3 if index == 0 else 1):
            shapes.observe(f"T{index}: Lunch is at noon. Q: when? A:", ["Lunch is at noon."], "when?", {"n": 1})
    kept = shapes.shapes()
    assert len(kept) == 16 and kept[0].seen == 3 and kept[0].prefix == "T0: "
    assert kept[0].render(["Tea is at four."], "why?") == "T0: Tea is at four. Q: why? A:"
    store.close()
    again = RequestShapes(Store(tmp_path / "meta"))  # a new process: the shapes are there
    assert [s.key for s in again.shapes()] == [s.key for s in kept]


def test_the_agreement_counts_requests_rebuilt_to_the_very_prompt_sent():
    shapes = RequestShapes()
    prompt = "Notes: Lunch is at noon. | Tea is at four. Q: when is tea? A:"
    for _ in range(3):
        shapes.observe(prompt, ["Lunch is at noon.", "Tea is at four."], "when is tea?", {"n": 1})
    answers = iter([["Lunch is at noon.", "Tea is at four."], ["Tea is at four.", "Lunch is at noon."], ["Tea is at four."]])
    same = ["Lunch is at noon.", "Tea is at four."]
    retrievals = {"hybrid": lambda question, n: next(answers), "dense": lambda question, n: same}
    assert shapes.check_agreement(retrievals) == 3
    shape = shapes.shapes()[0]
    assert (shape.compared, shape.agreed) == (3, {"hybrid": 1, "dense": 3})
    assert shapes.agreement(shape) == 1 / 3  # idle work ranks as PerCache's hybrid retrieval until it learns
    assert shapes.ranking_agreed() == {"hybrid": 1, "dense": 3}
    shapes.neighbour_order = "dense"
    assert shapes.agreement(shape) == 1.0
    shapes.retrieve = lambda question, n: same  # an app's own retriever, registered: its checks start now
    assert shapes.agreement(shape) == 0.0
    assert shapes.pending_checks == 0


def test_an_apps_requests_are_learned_and_stats_say_so(fake_cache):
    pc = fake_cache("learned", qa_bank=False, engine=FakeEngine(name="fake"))
    pc.preload()
    ask(pc, "Who repairs the boiler?")
    ask(pc, "When is the presentation rehearsal for the launch talk?")
    pc.caller.complete("A prompt that quotes no note.", decoding=DECODING)  # no passage: no shape
    stats = pc.stats()["app_requests"]
    assert len(stats["shapes"]) == 1 and stats["pending_checks"] == 2
    shape = stats["shapes"][0]
    assert (shape["seen"], shape["passages"], shape["predicts"], shape["agreement"]) == (2, 2, True, None)
    assert shape["separator"] == "\n\n" and shape["max_new_tokens"] == 8


def test_idle_rounds_run_the_apps_requests_not_this_caches_prompt(fake_cache, monkeypatch):
    pc = fake_cache("app", engine=FakeEngine(name="fake"))
    pc.preload()
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    ask(pc, "When is the presentation rehearsal for the launch talk?")
    ask(pc, "Where is the rehearsal?")
    report = pc.warm(progress=False, max_predictions=2)
    assert report.agreement_checks == 2 and pc.stats()["app_requests"]["shapes"][0]["agreement"] == 1.0
    assert report.app_states_prefilled > 0  # [instructions + passage] (and pairs) over the knowledge
    assert report.chunks_prefilled == report.pairs_prefilled == report.populated == 0  # not this cache's own prompt
    assert report.app_requests_run == 2 and report.app_answers_stored == 2  # agreement 1: decoded
    labels = {node.label for node in internals(pc).tree.nodes}
    assert labels == {"text"}  # every stored state is of the app's prompts
    # the app then asks a predicted question: its identical request is answered from what idle work stored
    answer = ask(pc, "Who repairs the boiler?")
    assert answer.source == "prompt_answer"
    # a question nobody predicted restores the leading state of [instructions + its first passage]
    other = ask(pc, "Which room is the launch talk rehearsal in?")
    assert other.source == "chunk_states" and other.reused_tokens > 0


def test_an_apps_answers_are_the_same_with_and_without_idle_work(fake_cache, monkeypatch):
    questions = ["Who repairs the boiler?", "What is the booking reference?", "Where is the rehearsal?"]
    reference = fake_cache("off", qa_bank=False, chunk_states=False, engine=FakeEngine(name="fake"))
    pc = fake_cache("on", qa_bank=False, engine=FakeEngine(name="fake"))
    pc.preload()
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    texts = []
    for question in questions:
        with internals(reference).engine.lock:
            internals(reference).engine.reset()
        expected = ask(reference, question).text
        texts.append((ask(pc, question).text, expected))
        pc.warm(progress=False, max_predictions=2)
    assert all(mine == expected for mine, expected in texts)


def test_the_apps_own_retriever_builds_the_predicted_requests(fake_cache, monkeypatch):
    pc = fake_cache("retriever", qa_bank=False, engine=FakeEngine(name="fake"))
    pc.preload()
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    asked: list[tuple[str, int]] = []

    def app_retriever(question: str, n: int) -> list[str]:  # the app ranks its passages its own way
        asked.append((question, n))
        return [r.chunk.text for r in pc.retrieve(question, n)][::-1]

    pc.caller.retrieves_with(app_retriever)
    ask(pc, "Where is the rehearsal?")  # PerCache's order: the app's retriever rebuilds another prompt
    report = pc.warm(progress=False, max_predictions=2)
    assert ("Where is the rehearsal?", 2) in asked  # the agreement check ran the app's retriever
    assert pc.stats()["app_requests"]["shapes"][0]["agreement"] == 0.0
    assert report.app_requests_run == 2 and report.app_answers_stored == 0  # low agreement: leading states only
    assert pc.stats()["app_requests"]["app_retriever"]


def test_passages_an_app_retrieved_join_the_knowledge_in_idle_time_not_on_the_answers_path(fake_cache):
    pc = fake_cache("passages", documents=False, qa_bank=False, engine=FakeEngine(name="fake"))
    passages = ["The morning ferry leaves the north pier at seven sharp.", "Boarding closes ten minutes before the ferry leaves the pier."]
    waiting = pc.caller.record_passages([{"id": f"node-{i}", "text": t} for i, t in enumerate(passages)])
    assert waiting == 2 and len(internals(pc).knowledge) == 0  # nothing embedded on the answer's path
    prompt = TEMPLATE.format(context="\n\n".join(passages), question="When does the ferry leave?")
    assert pc.caller.quoted_passages(prompt) == passages  # found in the app's prompts at once
    pc.caller.complete(prompt, documents=passages, decoding=DECODING, question="When does the ferry leave?")
    assert pc.stats()["app_requests"]["shapes"][0]["passages"] == 2  # the shape is learned from them
    assert pc.caller.record_passages([{"id": "node-2", "text": "Gone before idle time."}]) == 3
    pc.delete_documents(["node-2"])  # deleted before idle work came: never added
    report = pc.warm(progress=False, max_predictions=0)
    assert report.passages_added == 2
    assert sorted(c.doc_id for c in internals(pc).knowledge.chunks) == ["node-0", "node-1"]
    assert internals(pc).knowledge.deferred_texts == []
    assert pc.caller.record_passages([{"id": "node-0", "text": passages[0]}]) == 0  # stored with this text: not queued
    assert pc.warm(progress=False, max_predictions=0).passages_added == 0
    with pytest.raises(TypeError):
        pc.caller.record_passages("one passage, not a list")


def test_the_states_of_requests_grow_the_budget_instead_of_being_evicted(fake_cache):
    pc = fake_cache("budget", qa_bank=False, engine=FakeEngine(name="fake"))
    pc.preload()
    runtime = internals(pc).runtime
    runtime._sized_budget = 4096  # a budget sized from a knowledge far smaller than what the app asks
    for index in range(12):  # twelve conversations' prompts, each with states of its own
        ask(pc, f"Question number {index}: who repairs the boiler?")
    stats = pc.stats()["chunk_states"]
    assert stats["evictions"] == 0 and stats["request_bytes"] > 4096
    assert stats["budget_bytes"] >= 2 * stats["request_bytes"] and stats["budget"].startswith("sized from the knowledge and grown")
    assert stats["duplication"] is not None and stats["prompt_tokens_stored"] > 0


def test_a_watched_folder_of_documents_follows_its_files(fake_cache, tmp_path):
    from percache_core.endpoint.documents import WatchedDocuments

    pc = fake_cache("watched", documents=False)
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "boiler.txt").write_text("The boiler is repaired by Dana on Monday morning.")
    (folder / "ignored.bin").write_bytes(b"\x00")
    watched = WatchedDocuments(pc, [str(folder)], interval_s=0.05)
    assert watched.sync() == (1, 0) and pc.stats()["knowledge"]["chunks"] == 1
    assert watched.sync() == (0, 0)  # nothing changed
    (folder / "van.md").write_text("The van leaves at 3 pm from the north gate.")
    (folder / "boiler.txt").unlink()
    assert watched.sync() == (1, 1)
    assert [r.chunk.doc_id for r in pc.retrieve("When does the van leave?", 5)] == ["van"]


def test_the_pairs_follow_the_order_the_apps_second_passages_came_in(fake_cache):
    """Idle work learns from the app's requests whether their second passage is the first
    one's nearest neighbour by the embeddings alone (a plain vector store) or by PerCache's
    hybrid retrieval, and prefills the pairs that way."""
    probe = fake_cache("probe", engine=FakeEngine(name="fake"))
    knowledge = internals(probe).knowledge
    first, dense_next, hybrid_next = next(
        (c, d[0], h[0])
        for c in knowledge.chunks
        for d, h in [(knowledge.neighbours(c, 1, dense=True), knowledge.neighbours(c, 1))]
        if d and h and d[0].id != h[0].id
    )
    ranked = [r.chunk.id for r in knowledge.retrieve(first.text, 3, dense=True)]
    assert ranked[0] == first.id and ranked[1] == dense_next.id  # dense: the embeddings' similarity alone

    def send(pc, passages: list[str], question: str) -> object:
        prompt = TEMPLATE.format(context="\n\n".join(passages), question=question)
        return pc.caller.complete(prompt, documents=passages, decoding=DECODING, question=question)

    for order, second in (("dense", dense_next), ("hybrid", hybrid_next)):
        pc = fake_cache(order, qa_bank=False, engine=FakeEngine(name="fake"), knowledge_prefill_neighbours=1)
        pc.preload()
        send(pc, [first.text, second.text], "What is this about?")
        pc.warm(progress=False)
        assert pc.stats()["app_requests"]["neighbour_order"] == order
        other = next(c for c in knowledge.chunks if c.id not in {first.id, dense_next.id, hybrid_next.id})
        with_pair = send(pc, [first.text, second.text], "Anything else?")
        without = send(pc, [first.text, other.text], "Anything else?")
        assert with_pair.reused_tokens > without.reused_tokens > 0  # the learned pair's state is there


def test_idle_work_ranks_as_the_ranking_that_rebuilt_the_apps_requests(fake_cache, monkeypatch):
    """An app whose vector store ranks by the embeddings alone: its first request, rebuilt
    by each of PerCache's rankings in the round's agreement check, teaches that round the
    ranking; the agreement is that ranking's, so its predicted requests are decoded and the
    app's identical request is answered from what idle work stored."""
    probe = fake_cache("probe", engine=FakeEngine(name="fake"))
    knowledge = internals(probe).knowledge

    def top(question: str, dense: bool) -> list[str]:
        return [r.chunk.text for r in knowledge.retrieve(question, 2, dense=dense)]

    questions = ["Where is the rehearsal?", "Who repairs the boiler?", "What is the booking reference?"]
    asked = next(q for q in (*questions, *(c.text for c in knowledge.chunks)) if top(q, True) != top(q, False))

    def send(pc, question: str) -> object:  # the app: a plain vector store's top 2
        passages = top(question, True)
        prompt = TEMPLATE.format(context="\n\n".join(passages), question=question)
        return pc.caller.complete(prompt, documents=passages, decoding=DECODING, question=question)

    pc = fake_cache("dense-app", engine=FakeEngine(name="fake"))
    pc.preload()
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    send(pc, asked)
    report = pc.warm(progress=False, max_predictions=2)
    stats = pc.stats()["app_requests"]
    assert report.agreement_checks == 1 and stats["neighbour_order"] == "dense"
    assert stats["shapes"][0]["agreement_by"] == {"hybrid": 0.0, "dense": 1.0}
    assert stats["shapes"][0]["agreement"] == 1.0
    assert report.app_answers_stored == 2  # decoded: the app sends exactly such requests
    predicted = "Who repairs the boiler?"
    assert send(pc, predicted).source == "prompt_answer"


def test_an_app_attached_before_its_first_request_gets_no_states_of_this_caches_prompt(fake_cache):
    from percache_langchain import PerCacheLLM

    plain = fake_cache("plain", qa_bank=False, engine=FakeEngine(name="fake"))
    assert plain.warm(progress=False).chunks_prefilled > 0  # PerCache's own prompt: its pipeline may ask
    pc = fake_cache("attached", qa_bank=False, engine=FakeEngine(name="fake"))
    PerCacheLLM(percache=pc, max_new_tokens=8)  # the README's swap, before the app's first request
    assert pc.stats()["app_requests"]["app_attached"]
    report = pc.warm(progress=False)
    assert report.chunks_prefilled == report.pairs_prefilled == report.app_states_prefilled == 0
    assert not internals(pc).tree.nodes  # nothing stored of a prompt the app never sends
    assert internals(pc).parts.runtime.engine_loaded  # loaded and self-checked here, not in the first request
    ask(pc, "Where is the rehearsal?")  # its first request: its shape is learned
    assert pc.warm(progress=False).app_states_prefilled > 0
    assert {node.label for node in internals(pc).tree.nodes} == {"text"}
    pc.answer("Who repairs the boiler?")  # PerCache's own pipeline asked in this process: its states again
    assert pc.warm(progress=False).predicted_paths_prefilled > 0
    assert {node.label for node in internals(pc).tree.nodes} - {"text"}
