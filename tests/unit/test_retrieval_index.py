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

from percache_core.demo import demo_corpus
from percache_core.knowledge import index as chunk_index
from percache_core.knowledge.bank import KnowledgeBank
from percache_core.knowledge.bm25 import BM25Index, bm25_tokens
from percache_core.knowledge.index import ChunkIndex, reciprocal_rank_fusion, top_rows
from percache_core.storage import Store
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


def test_bm25_scores_stay_rank_bm25s_when_packed_and_reopened():
    texts, questions = texts_and_questions()
    corpus = [bm25_tokens(t) or ["_"] for t in texts]
    index = BM25Index(compact_after=16)  # folds the lists into arrays several times
    for start in range(0, len(corpus) // 2, 23):
        index.add(corpus[start : min(start + 23, len(corpus) // 2)])
    packed = index.packed()
    reopened = BM25Index.from_packed(
        packed["words"], packed["offsets"], packed["rows"], packed["counts"], packed["lengths"]
    )
    reopened.add(corpus[len(corpus) // 2 :])
    reference = BM25Okapi(corpus)
    for question in questions + ["the the budget budget"]:
        words = bm25_tokens(question)
        assert np.array_equal(reopened.scores(words), reference.get_scores(words))
    with pytest.raises(ValueError, match="do not fit"):
        BM25Index.from_packed(packed["words"][:-1], packed["offsets"], packed["rows"], packed["counts"], packed["lengths"])


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


def knowledge(folder: Path, **options) -> KnowledgeBank:
    return KnowledgeBank(Store(folder), HashingEmbedder(dimension=64), chunk_words=40, **options)


def rankings(bank: KnowledgeBank, questions: list[str]) -> list[list[tuple[str, float]]]:
    return [[(r.chunk.id, r.score) for r in bank.retrieve(q, 4)] for q in questions]


def test_a_large_knowledge_reopens_from_its_snapshot_and_ranks_as_from_its_records(tmp_path):
    texts, questions = texts_and_questions()
    documents = [{"id": f"d{i}", "text": t, "metadata": {"thread": f"t{i % 3}"}} for i, t in enumerate(texts)]
    folder = tmp_path / "knowledge"
    bank = knowledge(folder, snapshot_min_chunks=10)
    bank.add_documents(documents[: len(documents) // 2])
    bank.close()  # writes the snapshot
    writer = knowledge(folder, snapshot_min_chunks=0)  # reads the records, writes no snapshot
    writer.add_documents(documents[len(documents) // 2 :])  # added after the snapshot
    writer.close()
    reopened = knowledge(folder, snapshot_min_chunks=10)
    assert reopened.full_reads == 0  # the snapshot and the additions, no record reread
    from_records = knowledge(folder, snapshot_min_chunks=0)
    assert reopened.chunks == from_records.chunks
    assert rankings(reopened, questions) == rankings(from_records, questions)
    scoped = [[r.chunk.id for r in b.retrieve(q, 3, where={"thread": "t1"})] for b in (reopened, from_records) for q in questions[:5]]
    assert scoped[:5] == scoped[5:]

    reopened.close()  # a newer snapshot, with the additions
    from_records.delete_documents(["d1"])  # a removal after it: the records are read
    from_records.close()
    again = knowledge(folder, snapshot_min_chunks=10)
    assert again.full_reads == 1 and all(c.doc_id != "d1" for c in again.chunks)
    again.close()

    snapshot_file = Store(folder).files.path("knowledge-index")
    snapshot_file.write_bytes(snapshot_file.read_bytes()[:1000])  # damaged: the records are read
    damaged = knowledge(folder, snapshot_min_chunks=10)
    truth = knowledge(folder, snapshot_min_chunks=0)
    assert rankings(damaged, questions[:10]) == rankings(truth, questions[:10])
    damaged.close()
    truth.close()

    other = knowledge(tmp_path / "other", snapshot_min_chunks=0)  # another store, same version number
    other.add_documents(documents[:3])
    other.close()
    foreign = Store(tmp_path / "other").files.path("knowledge-index")
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_bytes(Store(folder).files.path("knowledge-index").read_bytes())
    mixed = knowledge(tmp_path / "other", snapshot_min_chunks=10)
    assert sorted({c.doc_id for c in mixed.chunks}) == ["d0", "d1", "d2"]
    mixed.close()


def test_embeddings_in_blocks_read_back_as_one_matrix(monkeypatch):
    monkeypatch.setattr(chunk_index, "BLOCK_ROWS", 5)
    rng = np.random.default_rng(2)
    vectors = rng.integers(-3, 4, (23, 4)).astype(np.float32)  # small integers: sums are exact
    chunks = [Chunk(f"d{i}#c000", f"d{i}", f"text {i}", {}) for i in range(23)]
    index = ChunkIndex()
    for start, end in ((0, 3), (3, 4), (4, 16), (16, 23)):  # appends across block edges
        index.append(chunks[start:end], vectors[start:end])
    query = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)
    assert np.array_equal(index.matrix, vectors)
    assert np.array_equal(index.dense_scores(query), vectors @ query)
    assert all(np.array_equal(index.vector(row), vectors[row]) for row in range(23))
    packed = index.packed()
    reopened = ChunkIndex.from_packed(packed["chunks"], packed["blocks"], packed["bm25"])
    assert np.array_equal(reopened.matrix, vectors) and reopened.chunks == index.chunks
    with pytest.raises(ValueError, match="do not fit"):
        ChunkIndex.from_packed(packed["chunks"][:-1], packed["blocks"], packed["bm25"])
