"""Corrupt, foreign and unloadable states are misses; bad input gets clear errors."""

import warnings

import pytest

from percache_core import (
    CacheFolderError,
    ContextOverflowError,
    InvalidDocumentError,
    InvalidQuestionError,
    ModelNotFoundError,
    PerCache,
    PerCacheConfig,
)
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.kv.tree import StateNode

QUESTION = "What did Ana say about the mooring map?"


def deepest_node(pc):
    return max(internals(pc).tree.nodes, key=lambda n: n.depth)


DAMAGE = {  # what a disk may leave; "zeroed": a power cut after the rename of a state file written without fsync
    "truncate": lambda data: data[: len(data) // 2],
    "flip": lambda data: bytes(b ^ 0xFF for b in data),
    "zeroed": lambda data: bytes(len(data)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_state_is_deleted_and_the_answer_stays_correct(make_cache, damage, caplog):
    pc = make_cache(qa_bank=False)
    reference = pc.answer(QUESTION)
    node = deepest_node(pc)
    path = internals(pc).states.local.blob_path(node.key)
    data = path.read_bytes()
    path.write_bytes(DAMAGE[damage](data))

    again = pc.answer(QUESTION)
    assert again.text == reference.text
    assert again.reused_chunks == node.depth - 2  # fell back to the parent prefix
    assert pc.stats()["chunk_states"]["corrupt_dropped"] == 1
    assert "unusable" in caplog.text
    assert internals(pc).states.local.blob_path(node.key).read_bytes() == data  # re-stored, whole again
    assert pc.answer(QUESTION).reused_chunks == node.depth - 1


def test_a_state_llama_cpp_refuses_is_a_logged_miss(make_cache, caplog):
    pc = make_cache(qa_bank=False)
    reference = pc.answer(QUESTION)
    node = deepest_node(pc)
    junk = b"\x00" * node.size  # right size and a matching digest, but not a state
    internals(pc).states.put(
        StateNode(node.key, node.parent_key, node.depth, node.n_tokens, node.label, len(junk)),
        junk,
        budget_bytes=internals(pc).parts.runtime.state_budget_bytes,
    )
    again = pc.answer(QUESTION)
    assert again.text == reference.text
    assert pc.stats()["chunk_states"]["restore_failures"] == 1
    assert "could not be restored" in caplog.text


def test_states_of_another_configuration_are_never_loaded(make_cache, model_path, tmp_path):
    pc = make_cache("shared", qa_bank=False)
    reference = pc.answer(QUESTION)
    assert pc.answer(QUESTION).reused_tokens > 0
    pc.close()
    other = LlamaEngine(model_path, n_ctx=2048, n_batch=256)  # another batch size: other state bytes
    try:
        with PerCache.open(
            tmp_path / "shared",
            config=PerCacheConfig(qa_bank=False, max_new_tokens=24),
            engine=other,
            embedder=pc.embedder,
        ) as second:
            answer = second.answer(QUESTION)
            assert answer.reused_tokens == 0 and answer.source == "full"
            assert answer.text == reference.text
            # the states' keys begin with the engine's fingerprint (read without opening the
            # states, which would first run this engine's self-checks here)
            assert other.fingerprint() != internals(pc).engine.fingerprint()
    finally:
        other.close()


def test_bad_questions_get_clear_errors_and_lose_nothing(make_cache):
    pc = make_cache()
    stored = pc.answer("When is my dentist appointment?")
    for bad in ["", "   \n\t"]:
        with pytest.raises(InvalidQuestionError):
            pc.answer(bad)
    with pytest.raises(TypeError, match="string"):
        pc.answer(42)
    with pytest.raises(ContextOverflowError, match="shorten the question"):
        pc.answer("Why " + "really " * 3000 + "?")
    with pytest.raises(ValueError, match="similarity_threshold"):
        pc.answer("When is dinner?", similarity_threshold=1.2)
    again = pc.answer("When is my dentist appointment?")
    assert again.source == "prompt_answer" and again.text == stored.text
    assert pc.stats()["qa_bank"]["entries"] == 1


def test_chunks_that_overflow_the_context_are_dropped_with_a_warning(make_cache):
    pc = make_cache(documents=False, n_ctx=2048, max_new_tokens=16)
    long_note = "The harbour crane inspection is on Tuesday. " + "Routine maintenance log entry. " * 450
    pc.add_documents(
        [
            {"id": "long", "text": long_note},
            {"id": "short", "text": "The crane inspection is on Tuesday at noon."},
        ],
        split=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = pc.answer("When is the crane inspection?")
    assert any("dropped" in str(w.message) for w in caught)
    assert "long" not in " ".join(answer.chunk_ids)


def test_bad_documents_and_paths(make_cache, tmp_path):
    pc = make_cache(documents=False)
    with pytest.raises(InvalidDocumentError):
        pc.add_documents(["   "])
    with pytest.raises(TypeError):
        pc.add_documents("a single string")
    with pytest.raises(TypeError):
        pc.add_documents([3.14])
    with pytest.raises(InvalidDocumentError):
        pc.add_documents([{"id": "x"}])
    assert len(internals(pc).knowledge) == 0  # nothing half-added

    with pytest.raises(ModelNotFoundError):
        PerCache.open(tmp_path / "m", config=PerCacheConfig(model_path=str(tmp_path / "missing.gguf")))
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"not a model")
    with pytest.raises(ModelNotFoundError, match="GGUF"):
        PerCache.open(tmp_path / "m", config=PerCacheConfig(model_path=str(not_gguf)))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CacheFolderError):
        PerCache.open(a_file, engine=internals(pc).engine, embedder=pc.embedder)
    broken = tmp_path / "broken" / "meta"
    broken.mkdir(parents=True)
    (broken / "percache.sqlite3").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CacheFolderError):
        PerCache.open(tmp_path / "broken", engine=internals(pc).engine, embedder=pc.embedder)
