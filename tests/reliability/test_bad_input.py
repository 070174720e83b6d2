"""Every bad input gets a clear error before any work, and loses nothing."""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest

from percache_core import PerCache, PerCacheConfig
from percache_core.errors import CacheFolderError, InvalidDocumentError
from percache_core.inspection import internals
from percache_core.storage import Store
from tests.fake_engine import FakeEngine
from tests.fakes import HashingEmbedder

QUESTION = "When is the presentation rehearsal for the launch talk?"


def test_a_failed_remember_keeps_the_stored_answer(fake_cache):
    pc = fake_cache()
    pc.caller.remember("When is the review?", "Monday.")
    with pytest.raises(TypeError, match="JSON"):
        pc.caller.remember("When is the review?", "Tuesday.", metadata={"note": object()})
    assert pc.caller.lookup("When is the review?").text == "Monday."


def test_add_documents_checks_everything_first_and_a_retry_does_the_work(fake_cache):
    pc = fake_cache(documents=False)
    good = {"id": "good", "text": "The archive room code is 4417."}
    with pytest.raises(InvalidDocumentError, match="metadata"):
        pc.add_documents([good, {"id": "bad", "text": "x", "metadata": {"when": object()}}])
    with pytest.raises(InvalidDocumentError, match="twice"):
        pc.add_documents([good, {"id": "good", "text": "Another text."}])
    assert len(internals(pc).knowledge) == 0
    assert [c.doc_id for c in pc.add_documents([good])] == ["good"]


def test_an_interrupted_add_documents_leaves_nothing_and_a_retry_adds_once(tmp_path):
    class FailingOnce(HashingEmbedder):
        failed = False

        def embed(self, texts):
            if not self.failed and len(texts) > 1:
                self.failed = True
                raise RuntimeError("embedder crashed")
            return super().embed(texts)

    documents = [{"id": f"d{i}", "text": f"Note {i}: the locker number is {i * 11}."} for i in range(3)]
    with PerCache.open(tmp_path / "c", engine=FakeEngine(), embedder=FailingOnce()) as pc:
        with pytest.raises(RuntimeError):
            pc.add_documents(documents)
        assert len(internals(pc).knowledge) == 0
        assert len(pc.add_documents(documents)) == 3
        assert pc.add_documents(documents) == [] and len(internals(pc).knowledge) == 3


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda pc: pc.answer(QUESTION, scope={"meeting": {1, 2}}), TypeError),
        (lambda pc: pc.answer(QUESTION, top_k=0), ValueError),
        (lambda pc: pc.answer(QUESTION, max_new_tokens=0), ValueError),
        (lambda pc: pc.answer(QUESTION, top_k=True), ValueError),
        (lambda pc: pc.caller.generate(QUESTION, "hello"), TypeError),
        (lambda pc: pc.caller.generate(QUESTION, ["hello"], max_new_tokens=-1), ValueError),
        (lambda pc: pc.retrieve(QUESTION, k=0), ValueError),
        (lambda pc: pc.configure(temperature=math.inf), ValueError),
        (lambda pc: pc.configure(no_such_setting=1), TypeError),
    ],
)
def test_bad_calls_fail_before_the_model_runs(fake_cache, call, error):
    pc = fake_cache()
    engine = internals(pc).engine
    calls = dict(engine.calls)
    with pytest.raises(error):
        call(pc)
    assert engine.calls == calls and len(internals(pc).qa_bank) == 0


def test_settings_are_checked_and_reach_every_part(fake_cache):
    assert PerCacheConfig(stop="abc").stop == ("abc",)  # one stop string, not three
    for bad in (math.inf, math.nan, -1, 100):
        with pytest.raises(ValueError):
            PerCacheConfig(temperature=bad)
    pc = fake_cache()
    pc.answer(QUESTION)  # the model is loaded now
    with pytest.raises(ValueError, match="cannot change while the cache is open"):
        pc.configure(n_ctx=4096)
    with pytest.raises(ValueError, match="cannot change"):
        pc.configure(shared_url="redis://localhost:6379/0", shared_secret="s" * 20)
    pc.configure(chunk_words=20, abstract_max_lines=7)
    added = pc.add_documents([{"id": "long", "text": " ".join(f"word{i}" for i in range(100))}])
    assert len(added) >= 4  # new chunking reached the knowledge bank
    assert internals(pc).scheduler.abstract.max_lines == 7


def test_folder_paths_are_checked(tmp_path):
    with pytest.raises(CacheFolderError, match="empty"):
        PerCache.open("", engine=FakeEngine(), embedder=HashingEmbedder())
    with pytest.raises(TypeError):
        PerCache.open(42, engine=FakeEngine(), embedder=HashingEmbedder())  # type: ignore[arg-type]


def test_another_programs_sqlite_file_is_refused_and_left_alone(tmp_path):
    folder = tmp_path / "c" / "qa_bank"
    folder.mkdir(parents=True)
    database = sqlite3.connect(folder / "percache.sqlite3")
    database.execute("CREATE TABLE contacts (name TEXT)")
    database.commit()
    database.close()
    with pytest.raises(CacheFolderError, match="not a PerCache database"):
        PerCache.open(tmp_path / "c", engine=FakeEngine(), embedder=HashingEmbedder())
    database = sqlite3.connect(folder / "percache.sqlite3")
    tables = [row[0] for row in database.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    database.close()
    assert tables == ["contacts"]


def test_a_damaged_chunk_record_is_left_out_and_the_cache_opens(fake_cache, tmp_path):
    pc = fake_cache()
    count = len(internals(pc).knowledge)
    pc.close()
    database = sqlite3.connect(tmp_path / "cache" / "knowledge" / "percache.sqlite3")
    key = database.execute("SELECT key FROM records WHERE key LIKE 'chunk:%' LIMIT 1").fetchone()[0]
    database.execute("UPDATE records SET value = '{\"id\": 1}' WHERE key = ?", (key,))
    other = database.execute("SELECT key FROM records WHERE key LIKE 'chunk:%' AND key != ? LIMIT 1", (key,))
    database.execute("UPDATE records SET vector = ? WHERE key = ?", (np.ones(3, dtype="<f4").tobytes(), other.fetchone()[0]))
    database.commit()
    database.close()
    with PerCache.open(tmp_path / "cache", engine=FakeEngine(), embedder=HashingEmbedder()) as again:
        assert len(internals(again).knowledge) == count - 2
        assert again.answer(QUESTION).text is not None


def test_an_old_pickled_folder_is_refused_without_loading_it(tmp_path):
    folder = tmp_path / "c" / "meta"
    folder.mkdir(parents=True)
    (folder / "cache.db").write_bytes(b"old diskcache index")
    with pytest.raises(CacheFolderError, match="pickled"):
        PerCache.open(tmp_path / "c", engine=FakeEngine(), embedder=HashingEmbedder())


def test_store_values_are_json_only(tmp_path):
    store = Store(tmp_path / "s")
    with pytest.raises(TypeError, match="JSON values only"):
        store.put("k", {"value": np.float32(1.0)})
    assert store.get("k") is None
    store.close()


def test_a_failed_correct_keeps_the_entry(fake_cache):
    pc = fake_cache()
    entry = pc.caller.remember("When is the review?", "Monday.")
    with pytest.raises(TypeError, match="JSON"):
        internals(pc).qa_bank.correct(entry.id, "Tuesday.", scope={"note": object()})  # a new id: moves the entry
    assert pc.caller.lookup("When is the review?").text == "Monday."
