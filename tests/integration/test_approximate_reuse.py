"""Approximate reuse (opt-in) with the real model: chunks composed from independent
[system, chunk] states are marked approximate, never stored, and leave the exact default
untouched; recomputing every token of a composed chunk gives the exact answer back."""

from percache_core.inspection import internals
from percache_core.kv.tree import path_keys
from percache_core.serving.prompting import lay_out, rag_prompt

QUESTION = "Who will repair the boiler and when?"


def prefill_each_chunk(pc, question):
    for retrieved in pc.retrieve(question):  # what the idle knowledge prefill does
        internals(pc).runner.prefill_prefix([retrieved.chunk])


def test_a_moved_chunk_state_continues_the_sequence(make_cache, engine):
    pc = make_cache("moved", qa_bank=False)
    prefill_each_chunk(pc, QUESTION)
    chunks = [r.chunk for r in pc.retrieve(QUESTION)]
    spec = rag_prompt(pc.config.retrieval.system_prompt, chunks, QUESTION)
    segments = [list(s.tokens) for s in lay_out(spec, tokenize=engine.tokenize, max_prompt_tokens=1900).segments]
    system, first, second = segments[0], segments[1], segments[2]
    node = internals(pc).tree.get(path_keys(internals(pc).states.root_key, [system, second])[1])  # [system, chunk 2]
    assert node is not None
    with engine.lock:
        engine.reset()
        engine.eval(system)
        engine.eval(first)
        before = engine.n_past
        assert engine.append_moved(internals(pc).states.get(node), node.n_tokens, len(system))
        held = node.n_tokens - len(system)  # the state ends at its state point, at most 3 tokens short
        assert engine.n_past == before + held and 0 <= len(second) - held < 4
        engine.eval(second[held:] + segments[-1])  # the chunk's rest and the question, on top
        assert len(list(engine.generate(max_new_tokens=4))) >= 1
        assert not engine.append_moved(b"not a state", 10, 0)
        assert engine.n_past >= before + len(second)  # a refused state changes nothing
        engine.reset()


def test_approximate_answers_are_marked_and_never_stored(make_cache):
    reference = make_cache("naive", qa_bank=False, chunk_states=False).answer(QUESTION).text
    exact = make_cache("exact", qa_bank=False)
    composed = make_cache("composed", reuse="approximate", recompute_tokens=8, max_error_rate=1.0)
    prefill_each_chunk(exact, QUESTION)
    prefill_each_chunk(composed, QUESTION)

    exact_answer = exact.answer(QUESTION)
    assert exact_answer.text == reference and not exact_answer.approximate  # the default stays exact
    answer = composed.answer(QUESTION)
    assert answer.approximate and answer.text.strip()
    assert answer.reused_tokens > exact_answer.reused_tokens  # chunks 2 and 3 moved in
    assert answer.prefilled_tokens < exact_answer.prefilled_tokens
    assert len(internals(composed).qa_bank) == 0
    assert not composed.answer(QUESTION).answered_before

    recomputed = make_cache("recomputed", qa_bank=False, reuse="approximate", recompute_tokens=100_000, max_error_rate=1.0)
    prefill_each_chunk(recomputed, QUESTION)
    again = recomputed.answer(QUESTION)
    assert not again.approximate and again.text == reference
