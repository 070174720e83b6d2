"""Chunk-state bytes with whole states and with slices, side by side on real questions.

For each user of ``--data`` (default ``../shared/data``), two caches answer the same
questions with chunk states only (no QA bank, no prediction): one keeps whole states, one
keeps slices (each prefix only its own segment's positions). It checks that both give the
same answers and the same restored tokens, then reports node bytes per path depth, the
bytes a full path costs (every prefix of [system, chunk 1, chunk 2, chunk 3] is kept), and
what the knowledge prefill (up to 80% of the default 1 GiB budget) can keep: [system,
chunk] states for every chunk, and how many pair states [system, chunk, chunk] beside them.
Bytes only (no timing), so it may run beside other work. Writes JSON (``--out``).

    .venv/bin/python -m benchmarks.state_slices --data ../shared/data --out benchmarks/results/state_slices.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from percache_core import PerCache, PerCacheConfig
from percache_core.config import MB
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.kv.budget import BUDGET_FLOOR_BYTES, PREFILL_BUDGET_SHARE
from percache_core.models import resolve_model_path

from .data_sets import add_user_arguments, query_scope, users_from_arguments
from .output import write_json

DEFAULT_BUDGET = BUDGET_FLOOR_BYTES  # the least a budget sized from the knowledge is (1 GiB)


def measure_user(
    user: Any, engine: LlamaEngine, embedder: Any, folder: Path, max_new_tokens: int
) -> dict[str, Any]:
    """Answer the user's questions with whole states and with slices; bytes and identity."""
    base = PerCacheConfig(qa_bank=False, prediction=False, max_new_tokens=max_new_tokens)
    caches = {
        kind: PerCache.open(
            folder / kind,
            config=base.replace(chunk_state_slices=kind == "slices"),
            engine=engine,
            embedder=embedder,
        )
        for kind in ("whole", "slices")
    }
    try:
        for pc in caches.values():
            pc.add_documents(user.documents, split=False)
        identical = same_reuse = 0
        for query in user.queries:
            answers = {k: pc.answer(query["question"], scope=query_scope(query)) for k, pc in caches.items()}
            identical += answers["whole"].text == answers["slices"].text
            same_reuse += answers["whole"].reused_tokens == answers["slices"].reused_tokens
        assert internals(caches["slices"]).states.slices, "the slices round trip failed on this engine"
        by_depth = {kind: _bytes_by_depth(pc) for kind, pc in caches.items()}
        return {
            "user": f"{user.dataset}/{user.name}",
            "questions": len(user.queries),
            "chunks": len(internals(caches["whole"]).knowledge),
            "identical_answers": identical,
            "same_reused_tokens": same_reuse,
            "nodes": len(internals(caches["whole"]).tree),
            "total_bytes": {kind: internals(pc).tree.bytes for kind, pc in caches.items()},
            "mean_node_bytes_by_depth": by_depth,
        }
    finally:
        for pc in caches.values():
            pc.close()


def _bytes_by_depth(pc: PerCache) -> dict[int, float]:
    depths: dict[int, list[int]] = {}
    for node in internals(pc).tree.nodes:
        depths.setdefault(node.depth, []).append(node.size)
    return {depth: statistics.fmean(sizes) for depth, sizes in sorted(depths.items())}


def summarize(users: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """Bytes per depth and per full path, and what fits the knowledge-prefill share."""
    summary: dict[str, Any] = {}
    for kind in ("whole", "slices"):
        depth_means: dict[int, float] = {}
        for depth in (1, 2, 3, 4):
            values = [
                u["mean_node_bytes_by_depth"][kind][depth]
                for u in users
                if depth in u["mean_node_bytes_by_depth"][kind]
            ]
            if values:
                depth_means[depth] = statistics.fmean(values)
        path = {deep: sum(depth_means.get(d, 0.0) for d in range(1, deep + 1)) for deep in (2, 3, 4)}
        limit = PREFILL_BUDGET_SHARE * budget
        system, chunk_node, pair_node = (
            depth_means.get(1, 0.0),
            depth_means.get(2, 0.0),
            depth_means.get(3, 0.0),
        )
        chunks = [u["chunks"] for u in users]
        all_chunks = statistics.fmean(chunks)
        singles_fit = int((limit - system) // chunk_node) if chunk_node else 0
        room_after_singles = limit - system - all_chunks * chunk_node
        summary[kind] = {
            "mean_node_bytes_by_depth": depth_means,
            "path_bytes": {f"{deep - 1}_chunks": value for deep, value in path.items()},
            "prefill_singles_that_fit": singles_fit,
            "pairs_beside_every_single": max(0, int(room_after_singles // pair_node)) if pair_node else 0,
            "mean_chunks_per_user": all_chunks,
        }
    summary["path_bytes_ratio_slices_to_whole"] = {
        key: summary["slices"]["path_bytes"][key] / summary["whole"]["path_bytes"][key]
        for key in summary["whole"]["path_bytes"]
        if summary["whole"]["path_bytes"][key]
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_user_arguments(parser, qmsum_users=2, squad_users=1, queries=10)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/state_slices.json")
    args = parser.parse_args(argv)
    users = users_from_arguments(args)
    engine = LlamaEngine(resolve_model_path(None))
    embedder = BertEmbedder()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for index, user in enumerate(users):
            row = measure_user(user, engine, embedder, Path(folder) / str(index), args.max_new_tokens)
            rows.append(row)
            total = row["total_bytes"]
            print(
                f"{row['user']}: {row['identical_answers']}/{row['questions']} identical, "
                f"{row['nodes']} nodes, whole {total['whole'] / MB:.1f} MB, slices {total['slices'] / MB:.1f} MB",
                file=sys.stderr,
            )
    result = {
        "settings": vars(args),
        "budget_bytes": DEFAULT_BUDGET,
        "users": rows,
        "summary": summarize(rows, DEFAULT_BUDGET),
    }
    write_json(result, args.out)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
