"""QA bank logic with small hand-made embeddings (the real embedder is tested elsewhere)."""

import numpy as np
import pytest

from percache_core.qa.bank import QABank
from percache_core.storage import Store
from percache_core.types import QAEntry


def unit(*values: float) -> np.ndarray:
    vector = np.array(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


@pytest.fixture
def bank(tmp_path):
    bank = QABank(Store(tmp_path / "qa"), dimension=3)
    yield bank
    bank.close()


def test_lookup_returns_best_entry_at_or_above_threshold(bank):
    bank.put("a", unit(1, 0, 0), "answer a")
    bank.put("b", unit(0, 1, 0), "answer b")
    hit = bank.nearest(unit(0.1, 1, 0), similarity_threshold=0.9)
    assert hit.entry.answer == "answer b"
    assert hit.similarity == pytest.approx(float(unit(0.1, 1, 0) @ unit(0, 1, 0)))
    assert bank.nearest(unit(1, 1, 0), similarity_threshold=0.9) is None  # 0.707 < 0.9
    assert bank.nearest(unit(1, 1, 0), similarity_threshold=0.7).entry.answer in {"answer a", "answer b"}


def test_pending_and_stale_entries_are_never_served(bank):
    pending = bank.put("p", unit(1, 0, 0), None)
    assert bank.nearest(unit(1, 0, 0), similarity_threshold=0.5) is None
    bank.correct(pending.id, "now answered")
    assert bank.nearest(unit(1, 0, 0), similarity_threshold=0.5).entry.answer == "now answered"
    bank.correct(pending.id, "old", stale=True)
    assert bank.nearest(unit(1, 0, 0), similarity_threshold=0.5) is None


def test_same_question_replaces_and_drop_and_clear(bank):
    first = bank.put("When is it?", unit(1, 0, 0), "one")
    second = bank.put("when is it? ", unit(1, 0, 0), "two")
    assert first.id == second.id and len(bank) == 1
    assert bank.nearest(unit(1, 0, 0), similarity_threshold=0.9).entry.answer == "two"
    assert bank.delete(second.id) and not bank.delete(second.id)
    bank.put("x", unit(0, 0, 1), "x")
    bank.clear()
    assert len(bank) == 0 and bank.bytes == 0


def test_persists_and_reloads_with_counters(tmp_path):
    bank = QABank(Store(tmp_path / "qa"), dimension=3)
    entry = bank.put("q", unit(1, 0, 0), "a", chunk_ids=["d#c000"], metadata={"thread": "t1"})
    bank.nearest(unit(1, 0, 0), similarity_threshold=0.9)
    bank.close()
    again = QABank(Store(tmp_path / "qa"), dimension=3)
    loaded = again[entry.id]
    assert (loaded.answer, loaded.chunk_ids, loaded.metadata, loaded.hits) == (
        "a",
        ("d#c000",),
        {"thread": "t1"},
        1,
    )
    assert again.bytes == bank.bytes
    again.close()


def test_budget_evicts_least_frequently_used(tmp_path):
    bank = QABank(Store(tmp_path / "qa"), dimension=3, budget_bytes=10_000)
    hot = bank.put("hot", unit(1, 0, 0), "x" * 100)
    for _ in range(3):
        bank.nearest(unit(1, 0, 0), similarity_threshold=0.99)
    sizes = []
    for i in range(200):
        entry = bank.put(f"q{i}", unit(0, 1, i / 200), "y" * 100)
        sizes.append(bank.entry_bytes(entry.id))
        assert bank.bytes <= bank.budget_bytes + max(sizes)
    assert hot.id in bank and bank.evictions > 0
    bank.close()


def test_rejects_wrong_dimension_and_empty_question(bank):
    with pytest.raises(ValueError, match="3 values"):
        bank.put("q", np.ones(4), "a")
    with pytest.raises(ValueError, match="non-empty"):
        bank.put("  ", unit(1, 0, 0), "a")


def test_search_returns_top_candidates_in_order(bank):
    for i in range(5):
        bank.put(f"q{i}", unit(1, i * 0.2, 0), f"a{i}")
    hits = bank.search(unit(1, 0, 0), top_n=3, similarity_threshold=0.5)
    assert [h.entry.answer for h in hits] == ["a0", "a1", "a2"]
    assert hits[0].similarity >= hits[1].similarity >= hits[2].similarity


def test_an_entrys_life_reads_as_typed_fields():
    def entry(answer, **metadata):
        return QAEntry("e1", "When?", np.zeros(2, dtype=np.float32), answer, metadata=metadata)

    assert entry(None).state == "pending" and not entry(None).servable
    assert entry("Friday", origin="user").state == "answered" and entry("Friday").servable
    stale = entry("Friday", stale=True, origin="predicted", scope={"thread": "a"}, binding="m1")
    assert (stale.state, stale.stale, stale.servable, stale.origin) == ("stale", True, False, "predicted")
    assert (stale.scope, stale.binding) == ({"thread": "a"}, "m1")
    remembered = entry("Friday", stale=True, remembered=True)  # the caller's: never stale
    assert (remembered.state, remembered.stale, remembered.remembered, remembered.servable) == (
        "answered", False, True, True
    )
    assert entry("x", origin="shared").from_shared_tier and entry("x", scope={}).scope is None
