"""The README's Python blocks run as written, each in a new process with a fresh home
folder (so ``~/.percache/...`` is a new cache), on the bundled model and embedder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from percache_core.memo import percache_home

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.model
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs_as_written(index: int, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HOME": str(tmp_path),  # ~/.percache/... is a fresh cache
        "PERCACHE_HOME": str(percache_home()),  # the assembled model and the self-checks, as installed
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if "pc.answer(" in BLOCKS[index]:
        first_source, repeat_source = result.stdout.split()[-4:-2]
        assert first_source in ("full", "chunk_states") and repeat_source == "prompt_answer"
    if "PerCacheQueryEngine" in BLOCKS[index] or "chain.invoke" in BLOCKS[index]:
        assert "Thursday" in result.stdout or "4 pm" in result.stdout, result.stdout
