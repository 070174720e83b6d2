"""Control flow of the request path, the scheduler and the idle worker on a FakeEngine and a
hashing embedder: no model, seconds for the lot. What they check is logic (which tier
serves, what is stored, when idle work runs and yields); what the model answers is checked
by the integration tests with the real model."""

from __future__ import annotations

import os
import time

import pytest

from percache_core import Decoding
from percache_core.inspection import internals
from percache_core.kv.engine import Engine
from percache_core.prediction.predictor import PredictedQuestion, PredictionTally
from tests.fake_engine import FakeEngine, FakeTextModel

QUESTION = "When is the presentation rehearsal for the launch talk?"


def test_the_fake_engine_is_an_engine_and_restores_exactly():
    engine = FakeEngine()
    assert isinstance(engine, Engine)
    prompt = engine.tokenize("Context: the rehearsal is on Friday. Question: when?", True)
    engine.reset()
    engine.eval(prompt)
    live = list(engine.generate(max_new_tokens=16))
    engine.reset()
    engine.eval(prompt[:10])
    state = engine.save_state()
    engine.reset()
    assert engine.load_state(state, 10)
    engine.eval(prompt[10:])
    assert list(engine.generate(max_new_tokens=16)) == live
    assert not engine.load_state(b"junk", 10)


def test_chunk_state_reuse_gives_the_cache_off_output(fake_cache):
    reference = fake_cache("off", qa_bank=False, chunk_states=False)
    cached = fake_cache("on", qa_bank=False)
    questions = [QUESTION, "Who repairs the boiler?", "What is the booking reference?"]
    expected = [reference.answer(q).text for q in questions]
    # before the engine's self-checks ran (idle work), answers run as stock does and keep no state
    unchecked = [cached.answer(q) for q in questions]
    assert [a.text for a in unchecked] == expected and all(a.source == "full" for a in unchecked)
    assert internals(cached).engine.calls.get("save_state", 0) == 0
    assert set(cached.stats()["engine_self_check"]["pending"]) == {"cut_rule", "state_layout", "draft_bound", "drafts_pay"}
    cached.warm(max_predictions=0)  # an idle round runs them first
    checks = cached.stats()["engine_self_check"]
    assert checks["pending"] == [] and checks["state_layout"]["reach_tokens"] == internals(cached).engine.n_ctx
    assert all(c["seconds"] >= 0 and c["measured_by"] == "this process" for c in checks["checks"].values())
    first = [cached.answer(q, top_k=2) for q in questions]
    again = [cached.answer(q, top_k=2) for q in questions]
    assert [a.text for a in first] == [reference.answer(q, top_k=2).text for q in questions] == [a.text for a in again]
    assert all(a.source == "chunk_states" and a.reused_chunks == len(a.chunk_ids) for a in again)


def test_an_identical_prompt_is_answered_without_the_model(fake_cache):
    pc = fake_cache()
    first = pc.answer(QUESTION)
    calls = dict(internals(pc).engine.calls)
    repeat = pc.answer(QUESTION)
    assert not first.answered_before
    assert repeat.source == "prompt_answer" and repeat.text == first.text and not repeat.approximate
    assert internals(pc).engine.calls == calls  # no restore, prefill or decode
    assert pc.stats()["qa_bank"]["prompt_answers"] == 1
    # other decoding settings, another prompt (top_k) or another model: the model runs
    assert not pc.answer(QUESTION, max_new_tokens=5).answered_before
    assert not pc.answer(QUESTION, top_k=1).answered_before
    other = fake_cache("other", engine=FakeEngine(name="other-model"))
    assert not other.answer(QUESTION).answered_before
    # a streamed repeat too, and a caller's prompt (caller.complete) likewise
    assert "".join(pc.answer_stream(QUESTION)) == first.text
    prompt = "Context:\nThe boiler is repaired on Monday.\nQ: When?\nA:"
    text = pc.caller.complete(prompt).text
    calls = dict(internals(pc).engine.calls)
    again = pc.caller.complete(prompt)
    assert again.text == text and again.source == "prompt_answer" and internals(pc).engine.calls == calls
    # deleting documents empties them (a prompt's key does not say which texts it held)
    pc.delete_documents([internals(pc).knowledge.chunks[0].doc_id])
    assert pc.stats()["qa_bank"]["prompt_answers"] == 0


def test_exact_mode_serves_a_stored_answer_as_a_verified_draft_when_the_model_agrees(fake_cache):
    pc = fake_cache(draft_decoding="on")
    first = pc.answer(QUESTION)
    internals(pc).parts.prompt_answers.clear()  # the prompt is new again: the QA entry is a draft
    repeat = pc.answer(QUESTION)
    assert repeat.source == "qa_bank" and repeat.text == first.text and not repeat.approximate
    assert repeat.draft_tokens_accepted > 0
    # with draft decoding off the answer is the same, decoded one token at a time
    pc.configure(draft_decoding="off")
    internals(pc).parts.prompt_answers.clear()
    plain = pc.answer(QUESTION)
    assert plain.text == first.text and plain.draft_tokens_accepted == 0


def test_a_question_waiting_pre_empts_an_idle_round(fake_cache):
    pc = fake_cache(prediction=False)
    calls = {"n": 0}

    def user_arrives() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    report = pc.warm(progress=False, should_stop=user_arrives)
    assert report.preempted
    assert pc.stats()["idle"]["preemptions"] == 1


def test_knowledge_prefill_stores_every_first_chunk_within_budget(fake_cache):
    pc = fake_cache(prediction=False)
    report = pc.warm(progress=False)
    first_chunks = {node.label for node in internals(pc).tree.nodes if node.depth == 2}
    assert report.chunks_prefilled == len(internals(pc).knowledge) == len(first_chunks)
    pairs = [node for node in internals(pc).tree.nodes if node.depth == 3]  # [system, chunk, its neighbour]
    assert report.pairs_prefilled == len(pairs) >= 1
    assert all(internals(pc).tree.get(node.parent_key).depth == 2 and node.label in first_chunks for node in pairs)
    answer = pc.answer(QUESTION)
    assert answer.reused_chunks >= 1


def test_the_worker_runs_rounds_when_quiet_and_stops(fake_cache):
    pc = fake_cache(prediction=False)
    worker = pc.start_worker(idle_after_s=0.0)
    deadline = time.monotonic() + 20
    while worker.rounds == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.rounds >= 1 and worker.errors == 0
    assert pc.start_worker() is worker  # one worker per cache
    pc.stop_worker()
    assert not worker.running


class _Predictor:
    """Predicts fixed questions (the fake engine writes no questions)."""

    def __init__(self, embed):
        self.embed = embed

    def predicted(self, texts, origin):
        embeddings = self.embed(texts)
        return [PredictedQuestion(t, e, origin) for t, e in zip(texts, embeddings)], PredictionTally(llm_calls=1)

    def predict_from_history(self, history, stride):
        return self.predicted(["Who repairs the boiler?"], "history")

    def predict_from_knowledge(self, lines, stride):
        return self.predicted(["What is the booking reference?"], "knowledge")


def test_a_round_with_the_callers_answer_only_predicts_and_hands_questions_over(fake_cache, monkeypatch):
    pc = fake_cache()
    pc.answer(QUESTION)
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    entries, nodes = len(internals(pc).qa_bank), len(internals(pc).tree)
    asked: list[str] = []
    report = pc.warm(progress=False, max_predictions=2, answer=lambda q: asked.append(q) or True)
    assert asked == report.predicted == ["Who repairs the boiler?", "What is the booking reference?"]
    assert report.answers_stored == 2
    assert report.chunks_prefilled == report.refreshed == report.pending_decoded == 0
    assert (len(internals(pc).qa_bank), len(internals(pc).tree)) == (entries, nodes)  # nothing of this cache's own prompt
    no_prediction = fake_cache("no-prediction", prediction=False)
    assert internals(no_prediction).scheduler.has_work()  # its own knowledge prefill, which a caller's pipeline cannot use
    assert not internals(no_prediction).scheduler.has_work(own_pipeline=False)


def test_the_callers_calls_in_a_round_are_idle_work_not_a_users(fake_cache, monkeypatch):
    pc = fake_cache()
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    pc.answer(QUESTION)
    counted, last, history = pc.stats()["queries"], internals(pc).last_activity, list(internals(pc).parts.activity.history)
    texts: list[str] = []

    def answer(question: str) -> bool:  # a framework's pipeline: a lookup, then its own prompt streamed
        assert pc.caller.lookup(question, binding="app", asked=question) is None
        prompt = f"Notes: none (call {len(texts)}).\nQ: {question}\nA:"  # a new prompt each time
        texts.append("".join(pc.caller.complete(prompt, stream=True)))
        return False

    report = pc.warm(progress=False, max_predictions=2, answer=answer)
    assert len(texts) == 2 and all(texts) and not report.preempted
    assert (pc.stats()["queries"], internals(pc).last_activity, list(internals(pc).parts.activity.history)) == (counted, last, history)
    inside: list[bool] = []

    def stop() -> bool:  # a user arrives once the caller's model run has started
        inside.append(internals(pc).parts.activity.background_stop() is not None)
        return inside[-1]

    report = pc.warm(progress=False, max_predictions=2, answer=answer, should_stop=stop)
    assert report.preempted and True in inside and len(texts) == 2  # the third answer never finished
    assert not internals(pc).parts.activity.waiting() and pc.stats()["queries"] == counted


def test_neighbours_are_retrievals_ranks_within_the_scope_and_follow_the_knowledge(fake_cache):
    pc = fake_cache(documents=False)
    pc.add_documents(
        [
            {"id": "a", "text": "The kiln firing is on Wednesday evening.", "metadata": {"room": "1"}},
            {"id": "b", "text": "Glaze samples for the kiln firing arrive Wednesday.", "metadata": {"room": "1"}},
            {"id": "c", "text": "The kiln firing schedule for Wednesday is posted.", "metadata": {"room": "2"}},
            {"id": "d", "text": "Studio rent rises in October.", "metadata": {"room": "1"}},
        ],
        split=False,
    )
    knowledge = internals(pc).knowledge
    first = knowledge.get_chunk("a#c000")
    ranked = [r.chunk.id for r in knowledge.retrieve(first.text, 4) if r.chunk.id != first.id]
    assert [n.id for n in knowledge.neighbours(first, 3)] == ranked[:3]
    assert {n.id for n in knowledge.neighbours(first, 3, scope_fields=["room"])} == {"b#c000", "d#c000"}
    pc.add_documents([{"id": "b", "text": "Nothing here.", "metadata": {"room": "1"}}], split=False)
    again = [r.chunk.id for r in knowledge.retrieve(first.text, 4) if r.chunk.id != first.id]
    assert [n.id for n in knowledge.neighbours(first, 3)] == again[:3]  # not remembered across changes
    pc.delete_documents(["a"])
    assert knowledge.neighbours(first, 2) == []


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_bad_questions_fail_before_any_work(fake_cache, bad):
    pc = fake_cache()
    engine = internals(pc).engine
    assert isinstance(engine, FakeEngine)
    before = dict(engine.calls)
    with pytest.raises((TypeError, ValueError)):
        pc.answer(bad)
    assert engine.calls == before


def test_fake_engine_slices_rebuild_the_sequence_and_refuse_a_gap():
    engine = FakeEngine()
    prompt = engine.tokenize("System.\n\nNote one.\n\nNote two.\n\nQuestion?", True)
    engine.reset()
    engine.eval(prompt)
    live = list(engine.generate(max_new_tokens=8))
    engine.reset()
    engine.eval(prompt[:8])
    first = engine.save_state()
    engine.eval(prompt[8:20])
    second = engine.save_slice(8)
    engine.reset()
    assert not engine.append_slice(second, 20)  # it must follow its 8-token parent
    assert engine.load_state(first, 8) and engine.append_slice(second, 20)
    engine.eval(prompt[20:])
    assert list(engine.generate(max_new_tokens=8)) == live


def test_adaptive_context_uses_a_leading_run_of_the_retrieved_chunks(fake_cache):
    always = fake_cache("always", qa_bank=False, context="adaptive", adaptive_threshold=0.0)
    never = fake_cache("never", qa_bank=False, context="adaptive", adaptive_threshold=1.01)
    fixed = fake_cache("fixed", qa_bank=False)
    retrieved = [r.chunk.id for r in fixed.retrieve(QUESTION)]
    assert len(retrieved) == 3
    assert list(always.answer(QUESTION).chunk_ids) == retrieved[:1]  # confident at once
    assert list(never.answer(QUESTION).chunk_ids) == retrieved  # never confident: all
    assert never.answer(QUESTION, top_k=3).text == fixed.answer(QUESTION).text
    assert always.caller.binding() != fixed.caller.binding()  # answers of another policy are never served


def test_adaptive_context_settings_are_checked():
    from percache_core import PerCacheConfig

    with pytest.raises(ValueError, match="context must be one of"):
        PerCacheConfig(context="dynamic")
    with pytest.raises(ValueError, match="adaptive_signal"):
        PerCacheConfig(adaptive_signal="kl")
    with pytest.raises(ValueError, match="adaptive_threshold"):
        PerCacheConfig(adaptive_threshold=float("nan"))


def test_approximate_reuse_composes_independent_states_and_never_stores_its_answers(fake_cache):
    exact = fake_cache("exact", qa_bank=False)
    composed = fake_cache("composed", reuse="approximate", recompute_tokens=4, max_error_rate=1.0)
    chunks = [r.chunk for r in composed.retrieve(QUESTION)]
    for cache in (exact, composed):
        cache.preload()  # the engine's self-checks: states are kept only once they ran
        for chunk in chunks:  # what the knowledge prefill does: [system, chunk] of each chunk
            internals(cache).runner.prefill_prefix([chunk])
    reference = exact.answer(QUESTION)
    assert not reference.approximate and reference.reused_chunks == 1

    answer = composed.answer(QUESTION)
    assert answer.approximate and answer.source == "chunk_states"
    assert answer.reused_tokens > reference.reused_tokens  # chunks 2 and 3 moved in
    assert answer.prefilled_tokens < reference.prefilled_tokens
    assert len(internals(composed).qa_bank) == 0  # never stored as an exact entry
    assert max(n.depth for n in internals(composed).tree.nodes) == 2  # no state after a composed chunk
    assert not composed.answer(QUESTION).answered_before

    whole_chunks = fake_cache("recompute-all", reuse="approximate", recompute_tokens=10_000, max_error_rate=1.0)
    whole_chunks.preload()
    for chunk in chunks:
        internals(whole_chunks).runner.prefill_prefix([chunk])
    same = whole_chunks.answer(QUESTION)  # every token recomputed: nothing moved, exact
    assert not same.approximate and same.text == reference.text


def test_reuse_settings_are_checked():
    from percache_core import PerCacheConfig

    with pytest.raises(ValueError, match="reuse must be"):
        PerCacheConfig(reuse="fuzzy")
    with pytest.raises(ValueError, match="recompute_tokens"):
        PerCacheConfig(recompute_tokens=-1)


def test_a_remembered_answer_is_the_callers_whatever_documents_arrive(fake_cache):
    pc = fake_cache(documents=False)
    pc.add_documents(
        [
            "The van is parked behind the studio.",
            "Lunch with Ana is on Friday at noon.",
            "The booking API is late because the vendor changed its schema.",
        ]
    )
    pc.caller.remember("What colour is the van?", "The van is red.")
    pc.add_documents([{"id": "n1", "text": "The garage code is 4417."}])  # unrelated, ranks in the top-k
    pc.warm(progress=False)
    hit = pc.caller.lookup("What colour is the van?")
    assert hit is not None and hit.text == "The van is red."
    calls = dict(internals(pc).engine.calls)
    answer = pc.answer("What colour is the van?")
    assert (answer.text, answer.source, answer.approximate) == ("The van is red.", "remembered", False)
    assert "".join(pc.answer_stream("What colour is the van?")) == "The van is red."
    assert internals(pc).engine.calls == calls  # no model call
    assert pc.stats()["remembered"] == 2
    # another question, or the same one in another scope, is the model's
    assert pc.answer("What colour is the van?", scope={"thread": "cars"}).source != "remembered"
    pc.caller.remember("What colour is the van?", "The van is blue now.")  # the caller replaces it
    assert pc.answer("What colour is the van?").text == "The van is blue now."


def test_a_callers_verbs_cover_its_pipeline_and_embed_a_question_once(fake_cache):
    pc = fake_cache()
    embedded: list[str] = []
    embed = pc.embedder.embed

    def counting(texts):
        embedded.extend(texts)
        return embed(texts)

    pc.embedder.embed = counting
    question = "Who repairs the boiler?"
    assert pc.caller.lookup(question, binding="app") is None
    entry = pc.caller.remember(question, "Ana does.", binding="app", metadata={"origin": "my-app"})
    assert embedded.count(question) == 1  # the lookup's embedding served the remember too
    assert pc.caller.find(question, binding="app") == entry
    assert pc.caller.find(question, binding="other app") is None
    assert pc.caller.lookup(question, binding="app").text == "Ana does."
    assert pc.caller.entry(entry.id).answer == "Ana does."
    pc.caller.remember("Who books the room?", "Lee.", binding="app", metadata={"origin": "my-app"})
    pc.caller.remember("Who pays?", "Finance.", binding="app", metadata={"origin": "another-app"})
    assert pc.caller.forget(origin="my-app") == 2
    assert pc.caller.lookup(question, binding="app") is None
    assert pc.caller.find("Who pays?", binding="app") is not None
    with pytest.raises(TypeError):
        pc.caller.forget(entry_ids="one id")
    # the engine's two sides, and a caller's prompt answered from its stored answer
    assert pc.caller.runs_on(internals(pc).engine) and not pc.caller.runs_on(FakeEngine())
    assert pc.caller.text_model.tokenize("hello") == internals(pc).engine.tokenize("hello")
    first = pc.caller.complete("Context: the boiler is old.\n\nQuestion: who? Answer:")
    repeat = pc.caller.complete("Context: the boiler is old.\n\nQuestion: who? Answer:")
    assert repeat.text == first.text and repeat.source == "prompt_answer"


def test_the_engine_protocol_has_a_text_side_and_a_sequence_side():
    from percache_core.kv.engine import KVSequence, TextModel

    engine = FakeEngine()
    assert isinstance(engine, TextModel) and isinstance(engine, KVSequence) and isinstance(engine, Engine)

    text_side = FakeTextModel()
    assert isinstance(text_side, TextModel) and not isinstance(text_side, KVSequence)
    assert text_side.tokenize("Lunch?") == engine.tokenize("Lunch?")


def test_idle_work_stores_its_answers_through_the_request_path(fake_cache, monkeypatch):
    pc = fake_cache()
    pc.answer(QUESTION)  # a question for history prediction
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    stored: list[str] = []
    populate = internals(pc).request_path.populate

    def recording(item, should_stop):
        stored.append(item.question)
        return populate(item, should_stop)

    internals(pc).request_path.populate = recording
    pc.configure(similarity_threshold=0.5, strategy_cutoff=0.9)  # prefill and decode
    report = pc.warm(progress=False, max_predictions=2)
    assert report.populated == 2 and stored == report.predicted
    predicted = {e.question: e for e in internals(pc).qa_bank.entries if e.origin.startswith("predicted")}
    assert sorted(predicted) == sorted(report.predicted)
    assert all(e.answer and e.metadata["tokens"] and e.binding == pc.caller.binding() for e in predicted.values())
    # a prefill-only round stores them pending, and a later decode round answers them in place
    pc.configure(similarity_threshold=0.95)
    pc.caller.forget(entry_ids=[e.id for e in predicted.values()])
    report = pc.warm(progress=False, max_predictions=2)
    pending = [e for e in internals(pc).qa_bank.entries if e.state == "pending"]
    assert report.pending_stored == len(pending) >= 1
    assert {e.question for e in pending} <= set(report.predicted)
    pc.configure(similarity_threshold=0.5)
    report = pc.warm(progress=False, max_predictions=0)
    assert report.pending_decoded == len(pending)
    assert all(internals(pc).qa_bank.get(e.id).state == "answered" for e in pending)  # answered in place


def test_stats_say_what_prediction_populated_and_what_it_later_served(fake_cache, monkeypatch):
    pc = fake_cache()
    monkeypatch.setattr(internals(pc).scheduler, "predictor", lambda: _Predictor(pc.embedder.embed))
    pc.configure(similarity_threshold=0.5, strategy_cutoff=0.9)  # predicted questions are answered
    report = pc.warm(progress=False, max_predictions=1)
    assert report.predicted == ["What is the booking reference?"] and report.chunks_prefilled > 0
    idle = pc.stats()["idle"]["prefill_decode"]
    assert idle["questions_predicted"] == 1 and idle["answers_stored"] == 1
    assert idle["chunks_prefilled"] == report.chunks_prefilled
    # the predicted question, asked: the prompt idle work ran is answered without the model
    asked = pc.answer("What is the booking reference?")
    assert asked.source == "prompt_answer" and asked.predicted
    # another question restores a [system, chunk] state the knowledge prefill stored
    other = pc.answer(QUESTION)
    assert other.source == "chunk_states" and 1 <= other.idle_reused_chunks <= other.reused_chunks
    served = pc.stats()["served_from_prediction"]
    assert served["answers"] == 1 and served["answers_restoring_idle_states"] == 1
    assert served["restored_depth"] == {str(other.reused_chunks): 1}
    assert pc.warm(progress=False, max_predictions=0).served_from_prediction["answers"] == 1
    assert pc.warm(progress=False, max_predictions=0).served_from_prediction["answers"] == 0  # since the last round
    # the marks survive reopening (stored with the states and the prompt answers)
    idle_nodes = {node.key for node in internals(pc).tree.nodes if node.idle}
    assert idle_nodes and len(idle_nodes) < len(internals(pc).tree)  # the users' own runs are not idle work's
    pc.close()
    again = fake_cache(documents=False)
    assert again.answer("What is the booking reference?").predicted
    assert {node.key for node in internals(again).tree.nodes if node.idle} == idle_nodes


def test_the_default_chunk_state_budget_is_sized_from_the_knowledge_within_the_disk(fake_cache, monkeypatch):
    import shutil
    from collections import namedtuple

    from percache_core.engines.llama_cpp import slicing
    from percache_core.kv.budget import BUDGET_FLOOR_BYTES, knowledge_tokens
    from percache_core.serving.prompting import chunk_text

    pc = fake_cache()
    assert internals(pc).parts.runtime.state_budget_bytes == BUDGET_FLOOR_BYTES  # no model loaded yet: nothing measured
    tokens = knowledge_tokens([chunk_text(c) for c in internals(pc).knowledge.chunks], internals(pc).engine.tokenize)
    assert tokens == sum(len(internals(pc).engine.tokenize(chunk_text(c))) for c in internals(pc).knowledge.chunks)  # all sampled
    monkeypatch.setattr(slicing, "state_bytes_per_token", lambda engine: 1_000_000.0)  # a model with huge states
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, 1000 * GIB))
    pc.warm(progress=False, max_predictions=0)
    neighbours = pc.config.idle.knowledge_prefill_neighbours
    wanted = tokens * (1 + neighbours) * 1_000_000 / 0.8  # singles and pairs, slices, over the 80% share
    stats = pc.stats()["chunk_states"]
    assert stats["budget_bytes"] == internals(pc).runner.budget_bytes == int(wanted)
    assert stats["budget"] == "sized from the knowledge" and stats["bytes_per_token"] == 1_000_000.0
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, 8 * GIB))  # a quarter of the free disk
    pc.add_documents(["The plumber comes on Tuesday between 8 and 10."])
    stored = internals(pc).states.bytes  # what the states take when the next round sizes the budget
    pc.warm(progress=False, max_predictions=0)  # sized again at the start of the next idle round
    assert internals(pc).parts.runtime.state_budget_bytes == int(0.25 * (8 * GIB + stored))
    pc.configure(chunk_state_budget_bytes=3 * GIB)  # a configured budget is the budget
    assert internals(pc).runner.budget_bytes == pc.stats()["chunk_states"]["budget_bytes"] == 3 * GIB


GIB = 1024**3


def test_a_caller_prompt_keeps_what_the_context_holds_of_the_previous_one(fake_cache):
    shared = "Minutes of the planning call. " * 8
    prompts = [shared + "Question: when is the review? Answer:", shared + "Question: who pays? Answer:"]
    reference = fake_cache("off", qa_bank=False, chunk_states=False)
    expected = []
    for prompt in prompts:
        with internals(reference).engine.lock:
            internals(reference).engine.reset()  # nothing kept: each prompt from an empty context
        expected.append(reference.caller.complete(prompt, decoding=Decoding(stop=[])).text)
    pc = fake_cache("kept", qa_bank=False, engine=FakeEngine(name="fake"))
    pc.preload()  # the self-check's rule says where a caller's prompt may be cut
    first, second = (pc.caller.complete(p, decoding=Decoding(stop=[])) for p in prompts)
    assert [first.text, second.text] == expected
    assert first.reused_tokens == 0
    common = len(os.path.commonprefix(prompts)) + 1  # with BOS
    assert 200 <= second.reused_tokens <= common  # the shared start, cut under the rule
    # a change of the sequence by anything else (here a reset) and nothing is kept
    with internals(pc).engine.lock:
        internals(pc).engine.reset()
    assert pc.caller.complete(prompts[0] + " ", decoding=Decoding(stop=[])).reused_tokens == 0


def test_answer_counts_persist_with_the_folder_and_stats_say_what_they_count(fake_cache):
    first = fake_cache("counted")
    first.answer(QUESTION)
    first.answer(QUESTION)  # the same question again: a stored answer
    first.close()
    second = fake_cache("counted", documents=False)  # another process, the same folder
    assert second.stats()["queries"] == 2 and second.stats()["qa_bank_hits"] == 1
    second.answer(QUESTION)
    stats = second.stats()
    assert stats["queries"] == 3 and stats["prompt_answers"] == 2
    assert stats["counted"]["answers and tokens"].startswith("every process")
    second.close()
    assert fake_cache("counted", documents=False).stats()["queries"] == 3


def test_idle_works_plain_prompt_yields_the_engine_after_one_piece():
    """The predictor's and the abstract's prompts are fed ``IDLE_PIECE_TOKENS`` at a time,
    so a user's request that arrives during one waits for that piece, not the whole prompt
    (a 500-token prompt in one call held a request for 1.0 s, benchmarks.idle_preemption)."""
    from percache_core.engines.llama_cpp.answer_decoder import complete_plain
    from percache_core.errors import Preempted
    from percache_core.serving.state_runner import IDLE_PIECE_TOKENS

    engine = FakeEngine()
    arrived = lambda: engine.n_past > 0  # noqa: E731 (a request arrives once the first piece is in)
    with pytest.raises(Preempted):
        complete_plain(engine, "x" * (3 * IDLE_PIECE_TOKENS), Decoding(max_new_tokens=4), should_stop=arrived)
    assert engine.n_past == IDLE_PIECE_TOKENS
    engine.reset()
    text, prompt_tokens, _ = complete_plain(engine, "x" * (3 * IDLE_PIECE_TOKENS), Decoding(max_new_tokens=4))
    assert prompt_tokens == 3 * IDLE_PIECE_TOKENS + 1 and engine.n_past > prompt_tokens  # whole, then decoded
