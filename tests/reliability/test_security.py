"""Personal data stays private on disk, and nothing read back can run code."""

from __future__ import annotations

import os
import pickle
import sqlite3
import stat

from percache_core import PerCache
from tests.fake_engine import FakeEngine
from tests.fakes import HashingEmbedder

QUESTION = "When is the presentation rehearsal for the launch talk?"


def test_folders_are_0700_and_files_0600(fake_cache, tmp_path):
    pc = fake_cache()
    pc.answer(QUESTION)
    pc.close()
    for root, folders, files in os.walk(tmp_path / "cache"):
        for name in folders:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o700, name
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700


def test_an_existing_world_readable_folder_is_tightened(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    PerCache.open(folder, engine=FakeEngine(), embedder=HashingEmbedder()).close()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/percache-pwned",))


def test_a_planted_pickle_is_never_loaded(fake_cache, tmp_path):
    if os.path.exists("/tmp/percache-pwned"):
        os.remove("/tmp/percache-pwned")
    pc = fake_cache()
    pc.answer(QUESTION)
    pc.close()
    payload = pickle.dumps(_Exploit())
    for part in ("qa_bank", "knowledge", "meta"):
        database = sqlite3.connect(tmp_path / "cache" / part / "percache.sqlite3")
        database.execute("UPDATE records SET value = ?", (payload,))
        database.execute("UPDATE records SET vector = ? WHERE vector IS NOT NULL", (payload,))
        database.commit()
        database.close()
    for path in (tmp_path / "cache" / "states").rglob("*.bin"):
        path.write_bytes(payload)
    with PerCache.open(tmp_path / "cache", engine=FakeEngine(), embedder=HashingEmbedder()) as again:
        again.answer(QUESTION)
    assert not os.path.exists("/tmp/percache-pwned")
