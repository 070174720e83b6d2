"""Shared fixtures: one real llama.cpp engine and one real embedder for the whole session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from percache_core import PerCache, PerCacheConfig  # noqa: E402
from percache_core.cli import demo_corpus  # noqa: E402
from percache_core.embedding import SentenceTransformerEmbedder  # noqa: E402
from percache_core.kv.llama_cpp import LlamaEngine  # noqa: E402
from percache_core.models import resolve_model_path  # noqa: E402


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(model_path, n_ctx=2048, n_batch=512)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def embedder() -> SentenceTransformerEmbedder:
    embedder = SentenceTransformerEmbedder()
    embedder.embed(["load"])
    return embedder


@pytest.fixture(scope="session")
def corpus() -> dict[str, Any]:
    return demo_corpus()


@pytest.fixture
def make_cache(
    tmp_path: Path, engine: LlamaEngine, embedder: SentenceTransformerEmbedder, corpus: dict[str, Any]
) -> Iterator[Callable[..., PerCache]]:
    """Open caches on the shared engine and embedder, with the demo corpus loaded."""
    opened: list[PerCache] = []

    def open_cache(name: str = "cache", *, documents: bool = True, **config: Any) -> PerCache:
        config.setdefault("max_new_tokens", 24)
        pc = PerCache.open(tmp_path / name, config=PerCacheConfig(**config), engine=engine, embedder=embedder)
        if documents:
            pc.add_documents(corpus["documents"])
        opened.append(pc)
        return pc

    yield open_cache
    for pc in opened:
        pc.close()
