"""A chunk-state hit gives exactly the tokens the cache-off path gives (real model, greedy)."""

import numpy as np

from percache_core.inspection import internals
from percache_core.kv.cuts import measure_cut_rule
from percache_core.serving.prompting import lay_out, rag_prompt

QUESTIONS = [
    "When is the presentation rehearsal for the launch talk?",
    "Which room is the launch talk rehearsal in, and what should I bring?",
    "How much budget did finance approve for the Harbor design work?",
    "How much of the Harbor design budget is reserved for user testing?",
    "When is my dentist appointment?",
    "What did Ana say about the mooring map?",
    "Why is the booking API late?",
    "What should I bring to dinner on Saturday?",
]


def test_chunk_state_hits_match_cache_off_answers_token_for_token(make_cache):
    # No stop strings: every answer runs the full 24 tokens, so any divergence shows.
    off = make_cache("off", qa_bank=False, chunk_states=False, stop=())
    on = make_cache("on", qa_bank=False, chunk_states=True, stop=())
    expected = {q: off.answer(q) for q in QUESTIONS}
    # no chunk state; what the context holds of the previous prompt (its system segment, a
    # first chunk two questions share) is kept, as stock llama.cpp keeps it
    assert all(a.source == "full" for a in expected.values())
    assert any(a.reused_tokens > 0 for a in expected.values())

    first_pass = [on.answer(q) for q in QUESTIONS]  # later questions reuse earlier prefixes
    second_pass = [on.answer(q) for q in QUESTIONS]  # every path is now stored
    for answer in first_pass + second_pass:
        reference = expected[answer.question]
        assert answer.text == reference.text
        assert answer.generated_tokens == reference.generated_tokens == 24
        assert answer.chunk_ids == reference.chunk_ids

    partial = [a for a in first_pass if 0 < a.reused_chunks < len(a.chunk_ids)]
    assert len(partial) >= 2, [(a.reused_chunks, a.chunk_ids) for a in first_pass]
    assert all(a.source == "chunk_states" and a.reused_chunks == len(a.chunk_ids) for a in second_pass)
    assert all(
        a.reused_tokens + a.prefilled_tokens == r.reused_tokens + r.prefilled_tokens
        for a, r in zip(second_pass, (expected[q] for q in QUESTIONS))
    )


def test_restoring_any_depth_gives_bit_identical_logits(make_cache, engine):
    pc = make_cache("logits", qa_bank=False)
    question = QUESTIONS[5]
    chunks = [r.chunk for r in pc.retrieve(question, 3)]
    layout = lay_out(
        rag_prompt(pc.config.retrieval.system_prompt, chunks, question),
        tokenize=engine.tokenize,
        max_prompt_tokens=1500,
    )
    segments = [list(s.tokens) for s in layout.segments]
    with engine.lock:
        engine.reset()
        states = []
        for tokens in segments:
            engine.eval(tokens)
            states.append((engine.save_state(), engine.n_past))
        live = engine.last_logits().copy()
        for depth in range(1, len(segments)):
            data, n_tokens = states[depth - 1]
            assert engine.load_state(data, n_tokens)
            for tokens in segments[depth:]:
                engine.eval(tokens)
            assert np.array_equal(engine.last_logits(), live), f"depth {depth}"
        engine.reset()
    # the same tokens in one call, and cut where the engine's piece rule allows, agree too
    rule = measure_cut_rule(engine)
    assert rule is not None
    tokens = [t for s in segments for t in s]
    cuts = [c for c in range(rule.multiple * 4, len(tokens), 97 * rule.multiple) if rule.allows(0, c, len(tokens))]
    with engine.lock:
        engine.reset()
        engine.eval(tokens)  # one call for the whole prompt
        one_call = engine.last_logits().copy()
        engine.reset()
        bounds = [0, cuts[0], len(tokens)]
        for start, end in zip(bounds, bounds[1:]):
            engine.eval(tokens[start:end])
        assert np.array_equal(engine.last_logits(), one_call)
        engine.reset()


def test_long_prompts_keep_every_state_and_stay_exact(make_cache, engine):
    """A prompt longer than the sliding window (Gemma: 512): the states the window would
    lose by the end of the answer are saved on the way (a cut the rule allows), the others
    taken after it; a second ask restores the deepest and gives the cache-off text."""
    notes = [
        {"id": f"long-{name}", "text": " ".join(f"{name} note {i}: the {name} review moved to room {i} at {i} pm." for i in range(16))}
        for name in ("budget", "hiring", "travel")
    ]
    question = "Where did the budget review move to at 7 pm?"
    off = make_cache("long-off", documents=False, qa_bank=False, chunk_states=False, stop=(), top_k=3)
    on = make_cache("long-on", documents=False, qa_bank=False, stop=(), top_k=3)
    for pc in (off, on):
        pc.add_documents(notes, split=False)
    reference = off.answer(question)
    first = on.answer(question)
    assert first.prefilled_tokens + first.reused_tokens > engine.n_swa + 100  # past the window
    assert len(first.chunk_ids) == 3
    with engine.lock:
        engine.reset()  # only stored states can serve the second ask
    again = on.answer(question)
    assert first.text == again.text == reference.text
    assert again.source == "chunk_states" and again.reused_chunks == 3
    depths = sorted(n.depth for n in internals(on).tree.nodes)
    assert depths == [1, 2, 3, 4]  # system, and each chunk prefix: none lost to the window
    # a question right after one that cut early: the context it keeps was computed by calls
    # that include those cuts
    fresh = make_cache("long-fresh", documents=False, qa_bank=False, stop=(), top_k=3)
    fresh.add_documents(notes, split=False)
    fresh.answer(question)  # new states: the first two saved on the way
    follow = "Where did the budget review move to at 9 pm?"
    kept = fresh.answer(follow)
    assert kept.text == off.answer(follow).text
