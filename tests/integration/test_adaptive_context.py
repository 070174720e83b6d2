"""Adaptive context with the real model: the same policy with caches off gives the same
chunks and answers, each answer equals the fixed-context answer from the chunks chosen,
and later steps restore their prefix from the tree."""

from percache_core.answering.context import confidence_signals
from percache_core.inspection import internals
from percache_core.serving.state_runner import RunOptions

QUESTIONS = [
    "When is my dentist appointment?",
    "Who will repair the boiler and when?",
    "What did Ana say about the mooring map?",
    "What is my flight booking reference?",
]


def first_token_confidence(pc, question, count):
    chunks = [r.chunk for r in pc.retrieve(question)][:count]
    runner = internals(pc).runner
    result = runner.run(runner.lay_out(question, chunks, max_new_tokens=8), RunOptions(8, decode=False, keep_logits=True))
    while True:
        try:
            next(result)
        except StopIteration as done:
            return confidence_signals(done.value.next_token_logits)["top_probability"]


def test_adaptive_answers_equal_the_policy_without_caches_and_fixed_context(make_cache):
    probe = make_cache("probe", qa_bank=False, chunk_states=False)
    # a threshold between the questions' one-chunk confidences, so that both outcomes occur
    confidences = sorted(first_token_confidence(probe, q, 1) for q in QUESTIONS)
    threshold = (confidences[1] + confidences[2]) / 2
    settings = {
        "qa_bank": False,
        "context": "adaptive",
        "adaptive_signal": "top_probability",
        "adaptive_threshold": threshold,
    }
    without_caches = make_cache("off", chunk_states=False, **settings)
    cached = make_cache("on", **settings)
    fixed = make_cache("fixed", qa_bank=False, chunk_states=False)

    used = []
    for question in QUESTIONS:
        reference = without_caches.answer(question)
        answer = cached.answer(question)
        assert answer.chunk_ids == reference.chunk_ids and answer.text == reference.text, question
        chosen = [c for c in internals(fixed).knowledge.chunks if c.id in set(answer.chunk_ids)]
        chosen.sort(key=lambda c: list(answer.chunk_ids).index(c.id))
        assert fixed.caller.generate(question, chosen).text == answer.text, question
        used.append(len(answer.chunk_ids))
        if len(answer.chunk_ids) > 1:  # the last step restored the prefix the previous one stored
            assert answer.reused_chunks == len(answer.chunk_ids) - 1
    assert 1 in used and max(used) > 1
