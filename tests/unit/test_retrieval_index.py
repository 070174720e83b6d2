"""The retrieval index against the references it replaces: rank-bm25's BM25Okapi scores and
a full stable sort of every row (pure logic; the texts are the evaluation data's when
``../shared/data`` is beside the checkout, else the demo corpus)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from percache_core.bm25 import BM25Index, bm25_tokens
from percache_core.chunk_index import ChunkIndex, reciprocal_rank_fusion, top_rows
from percache_core.cli import demo_corpus
from percache_core.types import Chunk
from tests.fakes import HashingEmbedder

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def texts_and_questions() -> tuple[list[str], list[str]]:
    folder = DATA / "qmsum"
    if (folder / "documents.jsonl").is_file():
        with (folder / "documents.jsonl").open() as lines:
            texts = [json.loads(line)["text"] for _, line in zip(range(300), lines)]
        with (folder / "queries.jsonl").open() as lines:
            questions = [json.loads(line)["question"] for _, line in zip(range(60), lines)]
        return texts, questions
    corpus = demo_corpus()
    return [d["text"] for d in corpus["documents"]], [q["question"] for q in corpus["demo_questions"]]


def old_ranking(words, embedding, matrix, reference: BM25Okapi, k: int, keep=None) -> list[int]:
    """Retrieval as it was: full stable sorts of both rankings, rank-bm25's scores."""
    pool = min(matrix.shape[0], max(4 * k, 20))
    dense = matrix @ embedding
    rankings = [np.argsort(-dense, kind="stable")[:pool].tolist()]
    if words:
        sparse = reference.get_scores(words)
        rankings.append([i for i in np.argsort(-sparse, kind="stable")[:pool].tolist() if sparse[i] > 0])
    if keep is not None:
        rankings = [[i for i in ranking if i in keep] for ranking in rankings]
        if not rankings[0]:
            rankings = [sorted(keep, key=lambda i: -dense[i])]
    fused = reciprocal_rank_fusion(rankings)
    return sorted(fused, key=lambda i: (-fused[i], i))[:k]


def test_bm25_scores_are_rank_bm25s_to_the_bit():
    texts, questions = texts_and_questions()
    corpus = [bm25_tokens(t) or ["_"] for t in texts]
    index = BM25Index()
    index.add(corpus[: len(corpus) // 2])  # added in two steps, as documents arrive
    index.add(corpus[len(corpus) // 2 :])
    reference = BM25Okapi(corpus)
    for question in questions + ["the the budget budget", "zzz unknown words"]:
        words = bm25_tokens(question)
        assert np.array_equal(index.scores(words), reference.get_scores(words))


def test_top_rows_equal_a_full_stable_sort():
    rng = np.random.default_rng(1)
    for size, count in ((50, 20), (1000, 20), (1000, 1000), (7, 3)):
        values = rng.integers(0, 5, size).astype(np.float64)  # many ties
        assert top_rows(values, count).tolist() == np.argsort(-values, kind="stable")[:count].tolist()


def test_hybrid_search_ranks_as_before_with_and_without_a_scope():
    texts, questions = texts_and_questions()
    embedder = HashingEmbedder(dimension=64)
    threads = [f"t{i % 4}" for i in range(len(texts))]
    chunks = [Chunk(f"d{i}#c000", f"d{i}", t, {"thread": threads[i]}) for i, t in enumerate(texts)]
    matrix = embedder.embed(texts)
    index = ChunkIndex()
    index.append(chunks[:5], matrix[:5])
    index.append(chunks[5:], matrix[5:])
    reference = BM25Okapi([bm25_tokens(t) or ["_"] for t in texts])
    rng = random.Random(5)
    for question in questions:
        words, embedding = bm25_tokens(question), embedder.embed([question])[0]
        for k in (1, 3, 5):
            assert [r for r, _ in index.search(words, embedding, k)] == old_ranking(
                words, embedding, matrix, reference, k
            )
        thread = rng.choice(threads)
        keep = {i for i, t in enumerate(threads) if t == thread}
        assert [r for r, _ in index.search(words, embedding, 3, where={"thread": thread})] == old_ranking(
            words, embedding, matrix, reference, 3, keep
        )
    assert index.scope_rows({"thread": "none"}) == set()
    assert index.scope_rows({"missing": None}) == set(range(len(texts)))  # as metadata.get(...) == None


def test_an_index_of_another_dimension_is_refused():
    index = ChunkIndex()
    index.append([Chunk("a#c000", "a", "text", {})], np.ones((1, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="4"):
        index.append([Chunk("b#c000", "b", "text", {})], np.ones((1, 8), dtype=np.float32))
