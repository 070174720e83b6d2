"""How far can leading states of an app's prompts reach? The passages an app's own retriever
puts in its prompts, against what idle work can store before the question is known.

An app that keeps its own prompt (the LCEL app of ``benchmarks.apps``: an
``InMemoryVectorStore`` retriever with the bundled MiniLM, k passages in its ranking) sends
[instructions, passage 1, passage 2, ..., question]. A stored state restores a prompt only up
to its first passage that the state does not hold, in that order, so what idle work can
restore depends on how well it guesses the ordered passages before the question comes.
Idle work stores [instructions + chunk] for every chunk, then [instructions + chunk +
neighbour] for each chunk's nearest ``knowledge_prefill_neighbours`` (the neighbours ranked
as the app ranks: the chunk's own embedding as the question). For each real question of
``--data`` this gives the rank of its second passage among its first passage's neighbours,
and of its third passage among the chunks nearest to the first two (their embeddings
summed) and among the second one's neighbours: a state of three passages pays only where
both guesses are right. Retrieval only (the embedder); no LLM, no timing. Writes JSON.

    .venv/bin/python -m benchmarks.app_passages --data ../shared/data
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals

from .apps import vector_store_retriever
from .data_sets import User, add_user_arguments, users_from_arguments
from .output import write_json

WITHIN = (1, 2, 4, 8)  # the first n guesses
MISSING = -1  # a rank beyond every chunk (not found)


def rank_after(scores: np.ndarray, target: int, skip: Sequence[int]) -> int:
    """The rank of chunk *target* by *scores* (highest first), *skip* left out.

    >>> rank_after(np.array([0.1, 0.9, 0.5, 0.7]), 2, skip=[1])
    1
    """
    order = [int(i) for i in np.argsort(-scores, kind="stable") if int(i) not in skip]
    return order.index(target) if target in order else MISSING


def user_ranks(user: User, folder: Path, k: int) -> dict[str, Any]:
    """The ranks of each question's second and third passages (see the module docstring)."""
    pc = PerCache.open(folder / user.name.replace("/", "_"), config=PerCacheConfig(top_k=k))
    try:
        pc.add_documents(user.documents, progress=False)
        knowledge = internals(pc).knowledge
        chunks, stored = knowledge.embedding_matrix()  # the embeddings it stored (no second pass)
        row = {chunk.text: index for index, chunk in enumerate(chunks)}
        vectors = np.asarray(stored, dtype=np.float64)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        retriever = vector_store_retriever(pc, k)
        second, third_pair, third_next = [], [], []
        for query in user.queries:
            found = [row[d.page_content] for d in retriever.invoke(query["question"])]
            if len(found) < 3:
                continue
            first, then, last = found[:3]
            # the neighbours idle work stores pairs with (the app's dense ranking)
            near = [row[c.text] for c in knowledge.neighbours(chunks[first], len(chunks), dense=True)]
            second.append(near.index(then) if then in near else MISSING)
            third_pair.append(rank_after(vectors @ (vectors[first] + vectors[then]), last, [first, then]))
            third_next.append(rank_after(vectors @ vectors[then], last, [first, then]))
    finally:
        pc.close()
    return {"user": user.name, "chunks": len(chunks), "second": second, "third_by_pair": third_pair,
            "third_by_second": third_next}


def within(ranks: Sequence[int], n: int) -> int:
    """How many of *ranks* are among the first *n* guesses."""
    return sum(1 for rank in ranks if 0 <= rank < n)


def both_within(row: dict[str, Any], n: int, m: int) -> int:
    """Questions whose second passage is among the first *n* and third among the first *m*."""
    return sum(1 for a, b in zip(row["second"], row["third_by_pair"]) if 0 <= a < n and 0 <= b < m)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_user_arguments(parser, qmsum_users=5, squad_users=2, queries=12)
    parser.add_argument("--k", type=int, default=3, help="passages per question")
    parser.add_argument("--out", default="benchmarks/results/app_passages.json")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for user in users_from_arguments(args):
            row = user_ranks(user, Path(folder), args.k)
            row["second_within"] = {n: within(row["second"], n) for n in WITHIN}
            row["third_within"] = {n: within(row["third_by_pair"], n) for n in WITHIN}
            row["both_within_8_4"] = both_within(row, 8, 4)
            rows.append(row)
            print(f"{user.name}: {row['chunks']} chunks, {len(row['second'])} questions; second passage within "
                  f"1/2/4/8 neighbours: {list(row['second_within'].values())}; third within 1/2/4/8 by the pair: "
                  f"{list(row['third_within'].values())}; both (8, 4): {row['both_within_8_4']}", flush=True)
    questions = sum(len(r["second"]) for r in rows)
    summary = {"questions": questions,
               "second_within": {n: sum(r["second_within"][n] for r in rows) for n in WITHIN},
               "third_within": {n: sum(r["third_within"][n] for r in rows) for n in WITHIN},
               "both_within_8_4": sum(r["both_within_8_4"] for r in rows)}
    print(f"all: {summary}")
    write_json({"summary": summary, "per_user": rows, "settings": vars(args)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
