"""A full disk: answers are returned (and counted as not stored), the state tier keeps a
free-space reserve, and the folder opens again while the disk is still full."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from percache_core import PerCache, PerCacheConfig

QUESTIONS = [
    "When is the presentation rehearsal for the launch talk?",
    "Who is presenting the quarterly budget?",
    "Where is the offsite?",
]


@pytest.fixture
def small_disk(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> None:
    """Write until the disk is full (big blocks, then small ones)."""
    descriptor = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    for block in (1 << 20, 4096, 64):
        try:
            while True:
                os.write(descriptor, b"\0" * block)
        except OSError:
            pass
    os.close(descriptor)


def test_answers_survive_a_full_disk_and_the_folder_reopens(small_disk, engine, embedder, corpus, make_cache):
    reference = make_cache("reference", qa_bank=False, chunk_states=False)
    expected = {q: reference.answer(q).text for q in QUESTIONS}
    config = PerCacheConfig(max_new_tokens=24, min_free_disk_bytes=0)
    folder = small_disk / "cache"
    with PerCache.open(folder, config=config, engine=engine, embedder=embedder) as pc:
        pc.add_documents(corpus["documents"])
        assert pc.answer(QUESTIONS[0]).text == expected[QUESTIONS[0]]
        fill(small_disk)
        answer = pc.answer(QUESTIONS[1])  # states and the QA entry cannot be written
        assert answer.text == expected[QUESTIONS[1]]
        stats = pc.stats()
        assert stats["storage_failures"] + stats["chunk_states"]["storage_failures"] >= 1
    with PerCache.open(folder, config=config, engine=engine, embedder=embedder) as again:  # still full
        assert again.answer(QUESTIONS[2]).text == expected[QUESTIONS[2]]
        assert again.answer(QUESTIONS[0]).text == expected[QUESTIONS[0]]


def test_the_state_tier_keeps_its_free_space_reserve(small_disk, engine, embedder, corpus, make_cache):
    reference = make_cache("reference", qa_bank=False, chunk_states=False)
    config = PerCacheConfig(max_new_tokens=24, min_free_disk_bytes=20 * 1024 * 1024)  # most of the 24 MB
    with PerCache.open(small_disk / "cache", config=config, engine=engine, embedder=embedder) as pc:
        pc.add_documents(corpus["documents"])
        for question in QUESTIONS:
            assert pc.answer(question).text == reference.answer(question).text
        assert pc.stats()["chunk_states"]["storage_failures"] >= 1  # some states would cross it
        # the states kept stay out of the reserve (QA and knowledge records are small)
        assert shutil.disk_usage(small_disk).free >= config.budgets.min_free_disk_bytes - 1024 * 1024
