"""Chunk states kept as slices (each prefix only its own segment's positions), with the real
model: the start-up round trip, answers identical to whole states and to no cache, a
broken chain falling back to a shorter prefix, and the bytes saved on deep paths."""

from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.engines.llama_cpp.slicing import StateLayout, state_round_trip
from percache_core.inspection import internals

QUESTIONS = [
    "When is my dentist appointment?",
    "Who will repair the boiler and when?",
    "When is my dentist appointment?",
    "What did Ana say about the mooring map?",
    "Who will repair the boiler and when?",
]


def test_the_bundled_engine_passes_the_round_trip_past_its_window(engine):
    # the session engine: n_ctx 2048, Gemma 3's window 512: whole states, slices and the
    # prefill after them each cross the window
    assert engine.n_swa == 512
    verdict = state_round_trip(engine)
    assert verdict.slices and verdict.reach == engine.n_ctx
    assert engine.n_past == 0  # the check leaves an empty sequence


def test_a_context_between_one_and_three_windows_is_proved_to_its_end(model_path):
    # n_ctx 1,024 with Gemma 3's 512-token window: no three pieces each pass the window, so
    # two trips prove it (a state past the window; a continuation that crosses it)
    small = LlamaEngine(model_path, n_ctx=1024, n_batch=512)
    try:
        assert small.n_swa == 512
        assert state_round_trip(small) == StateLayout(slices=True, reach=1024, tried=1024)
        assert small.n_past == 0
    finally:
        small.close()


def test_answers_from_slices_equal_whole_states_and_no_cache(make_cache):
    reference = make_cache("reference", qa_bank=False, chunk_states=False)
    whole = make_cache("whole", qa_bank=False, chunk_state_slices=False)
    sliced = make_cache("sliced", qa_bank=False)
    assert internals(sliced).states.slices and not internals(whole).states.slices
    reused = 0
    for question in QUESTIONS:
        expected = reference.answer(question).text
        from_whole, from_slices = whole.answer(question), sliced.answer(question)
        assert from_whole.text == expected and from_slices.text == expected, question
        assert from_slices.reused_tokens == from_whole.reused_tokens, question
        reused += from_slices.reused_chunks
    assert reused >= 2 * len(sliced.answer(QUESTIONS[0]).chunk_ids)  # the repeats restored whole paths

    # the same prefixes are stored (keys differ: each kind has its own root); slices hold
    # each segment once
    def prefixes(pc):
        return sorted((n.depth, n.n_tokens, n.label) for n in internals(pc).tree.nodes)

    assert prefixes(sliced) == prefixes(whole)
    assert max(n.depth for n in internals(whole).tree.nodes) >= 4  # system + 3 chunks
    assert internals(sliced).tree.bytes < 0.7 * internals(whole).tree.bytes
    on_disk = [internals(sliced).states.local.blob_path(n.key).stat().st_size for n in internals(sliced).tree.nodes]
    assert sum(on_disk) == internals(sliced).tree.bytes


def test_a_missing_ancestor_makes_a_shorter_prefix_restore(make_cache):
    reference = make_cache("reference", qa_bank=False, chunk_states=False).answer(QUESTIONS[0]).text
    sliced = make_cache("sliced", qa_bank=False)
    first = sliced.answer(QUESTIONS[0])
    assert first.text == reference and first.reused_tokens == 0
    middle = next(n for n in internals(sliced).tree.nodes if n.depth == 2)  # [system, first chunk]
    internals(sliced).states.delete(middle.key)
    with internals(sliced).engine.lock:
        internals(sliced).engine.reset()  # the context no longer holds the prompt: only stored states can serve

    again = sliced.answer(QUESTIONS[0])  # deeper slices lack their parent: only the system restores
    assert again.text == reference and again.reused_chunks == 0 and again.reused_tokens > 0
    assert internals(sliced).runner.restore_failures == 0

    healed = sliced.answer(QUESTIONS[0])  # the missing slice was stored again
    assert healed.text == reference and healed.reused_chunks == len(healed.chunk_ids)


def test_a_damaged_slice_is_dropped_and_the_answer_kept(make_cache):
    reference = make_cache("reference", qa_bank=False, chunk_states=False).answer(QUESTIONS[1]).text
    sliced = make_cache("sliced", qa_bank=False)
    sliced.answer(QUESTIONS[1])
    deepest = max(internals(sliced).tree.nodes, key=lambda n: n.depth)
    path = internals(sliced).states.local.blob_path(deepest.key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    again = sliced.answer(QUESTIONS[1])
    assert again.text == reference
    assert again.reused_chunks == len(again.chunk_ids) - 1  # the prefix before the damaged slice
    assert deepest.key in internals(sliced).tree  # stored again after the answer
