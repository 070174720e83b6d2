"""Several processes on one cache folder: visibility, no lost updates, shared budgets,
and kill -9 at random points (the folder always opens whole)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals
from percache_core.storage import Store
from tests.fake_engine import FakeEngine
from tests.fakes import HashingEmbedder

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "When is the presentation rehearsal for the launch talk?"


def start(folder: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.cache_process", str(folder), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines(process: subprocess.Popen[str], timeout: float = 600) -> list[dict]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def fake_open(folder: Path, **config) -> PerCache:
    config.setdefault("max_new_tokens", 16)
    return PerCache.open(folder, config=PerCacheConfig(**config), engine=FakeEngine(), embedder=HashingEmbedder())


def test_an_answer_one_process_stores_is_served_by_another_already_open(tmp_path, corpus):
    folder = tmp_path / "cache"
    with PerCache.open(folder, config=PerCacheConfig(max_new_tokens=16)) as pc:
        pc.add_documents(corpus["documents"])
    signal_file = tmp_path / "go"
    waiting = start(folder, "wait-then-answer", str(signal_file), QUESTION)
    assert json.loads(waiting.stdout.readline()) == {"opened": True}  # B is open before A stores
    first = lines(start(folder, "answer", QUESTION))[0]
    assert first["source"] in ("full", "chunk_states")
    signal_file.touch()
    second = lines(waiting)[0]
    assert second == {"text": first["text"], "source": "prompt_answer"}  # A's prompt, answered


def test_closing_an_older_process_never_writes_back_its_old_records(tmp_path):
    folder = tmp_path / "cache"
    old = fake_open(folder)
    old.caller.remember("When is the review?", "Monday.")
    newer = fake_open(folder)
    newer.caller.remember("When is the review?", "Tuesday, moved.")
    assert old.caller.lookup("When is the review?").text == "Tuesday, moved."  # seen at the next lookup
    old.close()
    newer.close()
    with fake_open(folder) as fresh:
        assert fresh.caller.lookup("When is the review?").text == "Tuesday, moved."


def test_byte_budget_holds_over_three_processes(tmp_path):
    folder = tmp_path / "cache"
    fake_open(folder).close()
    budget = 30_000
    writers = [start(folder, "--fake", "remember-many", f"p{n}", "60", str(budget)) for n in range(3)]
    for writer in writers:
        assert lines(writer)[0] == {"done": 60}
    store = Store(folder / "qa_bank")
    entry_size = max(record.size for record in store.records("qa:"))
    total = store.total_size("qa:")
    store.close()
    assert total <= budget + entry_size, (total, budget, entry_size)
    with fake_open(folder, qa_bank_budget_bytes=budget) as pc:
        assert internals(pc).qa_bank.bytes == total and pc.stats()["qa_bank"]["entries"] == len(internals(pc).qa_bank)


def test_kill_9_at_random_points_leaves_a_folder_that_opens_whole(tmp_path):
    folder = tmp_path / "cache"
    rng = random.Random(1234)
    for _ in range(4):
        worker = start(folder, "--fake", "churn")
        time.sleep(rng.uniform(1.5, 4.0))
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        with fake_open(folder) as pc:  # opens, and every document is whole
            chunks = internals(pc).knowledge.chunks
            documents = Store(folder / "knowledge")
            for key in documents.keys("doc:"):
                doc_id = key.removeprefix("doc:")
                stored = documents.get(key)["chunks"]
                assert sum(c.doc_id == doc_id for c in chunks) == stored
            assert len({c.id for c in chunks}) == len(chunks)
            documents.close()
            for node in list(internals(pc).tree.nodes):  # every listed state is whole, or dropped as damaged
                data = internals(pc).states.get(node)
                assert data is None or len(data) == node.size
            assert pc.answer("What is the code of note 3?").text is not None
            assert pc.stats()["chunk_states"]["corrupt_dropped"] == 0


@pytest.mark.parametrize("fake", [True])
def test_knowledge_one_process_adds_is_retrieved_by_another(tmp_path, fake):
    reader, writer = fake_open(tmp_path / "cache"), fake_open(tmp_path / "cache")
    writer.add_documents([{"id": "n1", "text": "The boathouse key is under the blue flowerpot."}])
    assert [r.chunk.doc_id for r in reader.retrieve("Where is the boathouse key?")][:1] == ["n1"]
    writer.add_documents([{"id": "n1", "text": "The boathouse key is now with Priya at the front desk."}])
    assert "Priya" in reader.retrieve("Where is the boathouse key?")[0].chunk.text
    reader.close()
    writer.close()
