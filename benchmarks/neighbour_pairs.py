"""Knowledge prefill of neighbour pairs: how often would a [system, chunk, neighbour] state
give a real question's prompt its second chunk too?

The knowledge prefill stores [system, chunk] for every chunk, and then [system, chunk,
neighbour] for each chunk's ``knowledge_prefill_neighbours`` nearest chunks
(``KnowledgeBank.neighbours``: those retrieval ranks next when the chunk's own text is the
question, within the question's scope fields). For each question of ``--data``, this
counts whether its second retrieved chunk is among the first n neighbours of its first.
It compares them with followers learned from probes: each sentence of each chunk (of 5
words or more) is asked as a question, within the chunk's scope fields, and a chunk's
followers are the chunks retrieval returned second after it, most often first (then its
neighbours). Retrieval only (the embedder and BM25, as the cache retrieves); no LLM, no
timing. Writes JSON (``--out``).

    .venv/bin/python -m benchmarks.neighbour_pairs --data ../shared/data
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from typing import Any

from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder

from .data_sets import SCOPE_FIELDS, add_user_arguments, query_scope, users_from_arguments
from .output import write_json

NEIGHBOURS = (1, 2, 3)
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def probe_followers(pc: PerCache, top_k: int, neighbours: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each chunk's likeliest second chunks, from its sentences asked as questions."""
    probes = []
    for chunk in internals(pc).knowledge.chunks:
        where = {f: chunk.metadata[f] for f in SCOPE_FIELDS if f in chunk.metadata} or None
        probes += [(s, where) for s in _SENTENCE.split(chunk.text) if len(s.split()) >= 5]
    embeddings = pc.embedder.embed([text for text, _ in probes])
    seconds: dict[str, Counter] = {}
    for (text, where), embedding in zip(probes, embeddings):
        ranked = [r.chunk.id for r in internals(pc).knowledge.retrieve(text, top_k, question_embedding=embedding, where=where)]
        if len(ranked) >= 2:
            seconds.setdefault(ranked[0], Counter())[ranked[1]] += 1
    followers = {}
    for chunk_id, near in neighbours.items():
        counted = [c for c, _ in sorted(seconds.get(chunk_id, Counter()).items(), key=lambda item: -item[1])]
        followers[chunk_id] = counted + [c for c in near if c not in counted]
    return followers


def study_user(user: Any, pc: PerCache, top_k: int) -> dict[str, Any]:
    """For one user: questions with two chunks or more, and how many of them have their
    second chunk among the first n neighbours of the first, for each n in NEIGHBOURS."""
    pc.add_documents(user.documents, split=False)
    neighbours = {  # as the knowledge prefill picks them (KnowledgeBank.neighbours)
        chunk.id: [n.id for n in internals(pc).knowledge.neighbours(chunk, max(NEIGHBOURS), scope_fields=SCOPE_FIELDS)]
        for chunk in internals(pc).knowledge.chunks
    }
    followers = probe_followers(pc, top_k, neighbours)
    questions = 0
    covered = dict.fromkeys(NEIGHBOURS, 0)
    learned = dict.fromkeys(NEIGHBOURS, 0)
    for query in user.queries:
        ranked = [r.chunk.id for r in internals(pc).knowledge.retrieve(query["question"], top_k, where=query_scope(query))]
        if len(ranked) < 2:
            continue
        questions += 1
        for n in NEIGHBOURS:
            covered[n] += ranked[1] in neighbours[ranked[0]][:n]
            learned[n] += ranked[1] in followers[ranked[0]][:n]
    return {
        "user": f"{user.dataset}/{user.name}",
        "chunks": len(internals(pc).knowledge),
        "questions": questions,
        "second_chunk_is_a_neighbour": {str(n): covered[n] for n in NEIGHBOURS},
        "second_chunk_is_a_probe_follower": {str(n): learned[n] for n in NEIGHBOURS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_user_arguments(parser, qmsum_users=5, squad_users=2, queries=12)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/neighbour_pairs.json")
    args = parser.parse_args(argv)
    embedder = BertEmbedder()
    config = PerCacheConfig(chunk_states=False, qa_bank=False, prediction=False, top_k=args.top_k)
    rows = []
    for user in users_from_arguments(args):
        with tempfile.TemporaryDirectory() as folder:
            pc = PerCache.open(folder, config=config, embedder=embedder)
            try:
                rows.append(study_user(user, pc, args.top_k))
            finally:
                pc.close()
        print(rows[-1], flush=True)
    questions = sum(r["questions"] for r in rows)
    share = {
        str(n): sum(r["second_chunk_is_a_neighbour"][str(n)] for r in rows) / max(1, questions) for n in NEIGHBOURS
    }
    learned = {
        str(n): sum(r["second_chunk_is_a_probe_follower"][str(n)] for r in rows) / max(1, questions)
        for n in NEIGHBOURS
    }
    result = {
        "users": rows,
        "questions": questions,
        "share_second_chunk_is_a_neighbour": share,
        "share_second_chunk_is_a_probe_follower": learned,
    }
    print(f"second chunk among the first n neighbours of the first, over {questions} questions: {share}")
    print(f"... among the first n followers learned from probes: {learned}")
    print(f"written to {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
