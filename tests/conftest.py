"""Shared fixtures: one real llama.cpp engine and one real embedder for the whole session.

Stock ``llama_cpp.Llama`` in a test is made with ``benchmarks.stock.stock_llama``: its calls
run on the process's compute thread, as the engines' do. In an OpenMP build of llama.cpp
(llama-cpp-python's default; ``make`` builds without), called from the test's own thread it
would be a second OpenMP team in the process, and every later decode step of the suite
(every engine's) took 37 ms a token instead of 24 (measured 2026-12-06, Gemma 3 270M)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import threading  # noqa: E402
from collections import OrderedDict  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from percache_core import PerCache, PerCacheConfig  # noqa: E402
from percache_core.demo import demo_corpus  # noqa: E402
from percache_core.engines.llama_cpp.engine import LlamaEngine  # noqa: E402
from percache_core.engines.llama_cpp.kind import KIND  # noqa: E402
from percache_core.knowledge.bert import BertEmbedder  # noqa: E402
from percache_core.models import resolve_model_path  # noqa: E402
from tests.fake_engine import FakeEngine  # noqa: E402
from tests.fakes import HashingEmbedder  # noqa: E402
from tests.suite_settings import SHORT_IDLE  # noqa: E402

# Tests that use these fixtures run the real model or embedder: marked ``model``, so that
# ``pytest -m "not model"`` runs the pure-logic tests alone in seconds.
MODEL_FIXTURES = frozenset({"model_path", "engine", "embedder", "make_cache"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[LlamaEngine]:
    """The suite's engine, its self-checks measured once (as an idle round or ``preload()``
    does; read from disk on a machine that ran them): tests of a fresh engine's first
    session open one of their own (``tests/integration/test_self_checks_in_flow.py``)."""
    engine = LlamaEngine(model_path, n_ctx=2048, n_batch=512)
    KIND.self_check(engine, PerCacheConfig())
    yield engine
    engine.close()


class SuiteEmbedder(BertEmbedder):
    """The real embedder, each batch of texts encoded once per suite run: a batch's rows are
    what encoding it again computes (the same texts, the same padding, the same products),
    so the caches that load the demo corpus test after test, and the documents two caches of
    one test each add, do not encode them again (about a minute of the suite's encoding)."""

    def __init__(self) -> None:
        super().__init__()
        self._batches: OrderedDict[tuple[str, ...], np.ndarray] = OrderedDict()
        self._batches_lock = threading.Lock()

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        key = tuple(texts)
        with self._batches_lock:
            rows = self._batches.get(key)
        if rows is None:
            rows = super()._encode(texts)
            with self._batches_lock:
                self._batches[key] = rows
                while len(self._batches) > 512:
                    self._batches.popitem(last=False)
        return rows.copy()


@pytest.fixture(scope="session")
def embedder() -> BertEmbedder:
    embedder = SuiteEmbedder()
    embedder.embed(["load"])
    return embedder


@pytest.fixture(scope="session")
def corpus() -> dict[str, Any]:
    return demo_corpus()


@contextmanager
def _cache_opener(
    folder: Path,
    corpus: dict[str, Any],
    default_engine: Callable[[], Any],
    embedder: Any,
    defaults: dict[str, Any] | None = None,
) -> Iterator[Callable[..., PerCache]]:
    """A function that opens caches under *folder* with the demo corpus loaded (closed at
    the end)."""
    opened: list[PerCache] = []

    def open_cache(name: str = "cache", *, documents: bool = True, engine: Any = None, **config: Any) -> PerCache:
        config.setdefault("max_new_tokens", 24)
        for setting, value in (defaults or {}).items():
            config.setdefault(setting, value)
        pc = PerCache.open(
            folder / name, config=PerCacheConfig(**config), engine=engine or default_engine(), embedder=embedder
        )
        if documents:
            pc.add_documents(corpus["documents"])
        opened.append(pc)
        return pc

    try:
        yield open_cache
    finally:
        for pc in opened:
            pc.close()


@pytest.fixture
def make_cache(
    tmp_path: Path, engine: LlamaEngine, embedder: BertEmbedder, corpus: dict[str, Any]
) -> Iterator[Callable[..., PerCache]]:
    """Open caches on the shared engine and embedder, with the demo corpus loaded."""
    with _cache_opener(tmp_path, corpus, lambda: engine, embedder, defaults=SHORT_IDLE) as open_cache:
        yield open_cache


@pytest.fixture
def fake_cache(tmp_path: Path, corpus: dict[str, Any]) -> Iterator[Callable[..., PerCache]]:
    """Open caches on a :class:`FakeEngine` and a hashing embedder (no model), with the demo
    corpus loaded: for tests of control flow, not of answers."""
    with _cache_opener(tmp_path, corpus, FakeEngine, HashingEmbedder()) as open_cache:
        yield open_cache
