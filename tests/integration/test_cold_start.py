"""A new process: the default embedder without torch, a stored answer before anything
loads, and the self-checks' verdicts kept on disk (issue 43)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from percache_core import BertEmbedder, PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.knowledge.embedding import SentenceTransformerEmbedder
from percache_core.kv.cuts import known_cut_rule, measure_cut_rule

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "When is the rehearsal?",
    "The rehearsal moved to Friday at 3 pm in room B; bring the keys.",
    "Who approved the 18,500 euros for the field study, and when does the invoice go out?",
    "ünïcödé, emoji 🎉 and CJK 会议 in one line",
    "a",
    # longer than the model's 256 tokens: both truncate the same way
    " ".join(f"Minutes of meeting {i}: the budget was discussed at length." for i in range(60)),
]


def test_the_numpy_embedder_gives_sentence_transformers_vectors():
    reference = SentenceTransformerEmbedder().embed(TEXTS)
    numpy_bert = BertEmbedder()
    together = numpy_bert.embed(TEXTS)
    one_by_one = np.stack([numpy_bert.embed([text])[0] for text in TEXTS])
    assert numpy_bert.name == SentenceTransformerEmbedder().name  # a cache opens with either
    for vectors in (together, one_by_one):
        assert vectors.shape == reference.shape == (len(TEXTS), 384)
        assert vectors.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        cosines = np.sum(vectors * reference, axis=1)
        assert float(np.min(cosines)) >= 1 - 1e-4, cosines


def test_importing_the_package_imports_no_model_runtime():
    code = (
        "import sys, percache_core, percache_core.pipeline;"
        "heavy = [m for m in ('torch', 'sentence_transformers', 'transformers', 'llama_cpp', 'tokenizers')"
        " if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


ASK = """
import json, sys
from percache_core import PerCache, PerCacheConfig
with PerCache.open(sys.argv[1], config=PerCacheConfig(max_new_tokens=16)) as pc:
    answer = pc.answer(sys.argv[2])
    loaded = [m for m in ("llama_cpp", "tokenizers", "torch", "sentence_transformers") if m in sys.modules]
    print(json.dumps({"text": answer.text, "source": answer.source, "loaded": loaded}))
"""


def _ask(folder: Path, question: str, home: Path) -> dict:
    env = {**os.environ, "PERCACHE_HOME": str(home)}
    out = subprocess.run(
        [sys.executable, "-c", ASK, str(folder), question], capture_output=True, text=True, check=True, env=env, cwd=REPO
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.model
def test_a_question_asked_again_in_a_new_process_loads_nothing(tmp_path, corpus, model_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    os.symlink(model_path, home / "models" / model_path.name)  # the bundled GGUF, not assembled again
    folder = tmp_path / "cache"
    with PerCache.open(folder, config=PerCacheConfig(max_new_tokens=16)) as pc:
        pc.add_documents(corpus["documents"][:4])
    question = corpus["demo_questions"][0]["question"]
    first = _ask(folder, question, home)
    assert first["source"] in ("full", "chunk_states") and "llama_cpp" in first["loaded"]
    again = _ask(folder, question, home)
    assert again == {"text": first["text"], "source": "prompt_answer", "loaded": []}
    # a changed knowledge is a new prompt: the model answers again
    with PerCache.open(folder, config=PerCacheConfig(max_new_tokens=16)) as pc:
        pc.add_documents(["An unrelated note: the boiler was serviced on Monday."])
    after_change = _ask(folder, question, home)
    assert "tokenizers" in after_change["loaded"]  # the question was embedded: retrieval ran again
    assert _ask(folder, question, home)["loaded"] == []  # and recorded for the new knowledge
    # another setting that decides the answer is another key
    other = subprocess.run(
        [sys.executable, "-c", ASK.replace("max_new_tokens=16", "max_new_tokens=8"), str(folder), question],
        capture_output=True, text=True, check=True, env={**os.environ, "PERCACHE_HOME": str(home)}, cwd=REPO,
    )
    assert json.loads(other.stdout.strip().splitlines()[-1])["source"] != "prompt_answer"


@pytest.mark.model
def test_self_check_verdicts_survive_the_engine(tmp_path, model_path, monkeypatch):
    monkeypatch.setenv("PERCACHE_HOME", str(tmp_path))
    first = LlamaEngine(model_path, n_ctx=512, n_batch=512)
    try:
        assert known_cut_rule(first) == (False, None)
        rule = measure_cut_rule(first)
    finally:
        first.close()
    second = LlamaEngine(model_path, n_ctx=512, n_batch=512)  # a new engine: as in a new process
    try:
        assert known_cut_rule(second) == (True, rule)
    finally:
        second.close()
    other = LlamaEngine(model_path, n_ctx=512, n_batch=256)  # another fingerprint: measured afresh
    try:
        assert known_cut_rule(other) == (False, None)
    finally:
        other.close()
