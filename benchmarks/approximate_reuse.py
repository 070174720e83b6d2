"""Approximate reuse (``reuse="approximate"``): fidelity and time to first token per
recompute setting, side by side with the exact cache-off answer, in one run.

For each question of ``--data`` (top 3 chunks), the [system, chunk] state of every
retrieved chunk is stored first (what the idle knowledge prefill does). Then the question
is answered with caches off (the exact reference) and with approximate reuse at each
``--recompute`` setting (tokens of each composed chunk prefilled live), in turn. Reported
per setting: the share of answers identical to the exact one, token F1 against it, quality
against the dataset's reference (SQuAD F1, QMSum ROUGE-L) beside the exact answer's, mean
TTFT and prefilled tokens. Nothing else may run on the machine meanwhile. Writes JSON.

    .venv/bin/python -m benchmarks.approximate_reuse --data ../shared/data
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
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path

from .data_sets import add_user_arguments, query_scope, users_from_arguments
from .e2e_harness import rouge_l, squad_f1
from .output import write_json


def measure_user(
    user: Any, engine: LlamaEngine, embedder: Any, folder: Path, settings: list[int], tokens: int
) -> list[dict]:
    """Per question: the exact answer and each setting's answer, TTFT and tokens."""
    base = PerCacheConfig(qa_bank=False, prediction=False, max_new_tokens=tokens)
    exact = PerCache.open(
        folder / "exact", config=base.replace(chunk_states=False), engine=engine, embedder=embedder
    )
    composed = PerCache.open(
        folder / "composed", config=base.replace(reuse="approximate", max_error_rate=1.0), engine=engine, embedder=embedder
    )
    score = squad_f1 if user.dataset.startswith("squad") else rouge_l
    rows = []
    try:
        for pc in (exact, composed):
            pc.add_documents(user.documents, split=False)
        for query in user.queries:
            scope = query_scope(query)
            for retrieved in internals(composed).knowledge.retrieve(query["question"], 3, where=scope):
                internals(composed).runner.prefill_prefix([retrieved.chunk])
            reference = exact.answer(query["question"], scope=scope)
            row: dict[str, Any] = {
                "user": user.name,
                "exact": {
                    "text": reference.text,
                    "ttft_s": reference.ttft_s,
                    "prefilled": reference.prefilled_tokens,
                },
                "exact_quality": score(reference.text, query.get("answer", "")),
            }
            for recompute in settings:
                composed.configure(recompute_tokens=recompute)
                answer = composed.answer(query["question"], scope=scope)
                row[str(recompute)] = {
                    "text": answer.text,
                    "ttft_s": answer.ttft_s,
                    "prefilled": answer.prefilled_tokens,
                    "approximate": answer.approximate,
                    "identical": answer.text == reference.text,
                    "token_f1_vs_exact": squad_f1(answer.text, reference.text),
                    "quality": score(answer.text, query.get("answer", "")),
                }
            rows.append(row)
            print(
                f"{user.name}: exact {reference.ttft_s:.3f}s "
                + " ".join(f"r{r} {row[str(r)]['ttft_s']:.3f}s={row[str(r)]['identical']}" for r in settings),
                file=sys.stderr,
            )
    finally:
        exact.close()
        composed.close()
    return rows


def summarize(rows: list[dict], settings: list[int]) -> dict[str, Any]:
    """Means per setting, beside the exact answers'."""
    summary: dict[str, Any] = {
        "questions": len(rows),
        "exact": {
            "ttft_s": statistics.fmean(r["exact"]["ttft_s"] for r in rows),
            "prefilled_tokens": statistics.fmean(r["exact"]["prefilled"] for r in rows),
            "quality": statistics.fmean(r["exact_quality"] for r in rows),
        },
    }
    for recompute in settings:
        cells = [r[str(recompute)] for r in rows]
        summary[f"recompute_{recompute}"] = {
            "ttft_s": statistics.fmean(c["ttft_s"] for c in cells),
            "prefilled_tokens": statistics.fmean(c["prefilled"] for c in cells),
            "composed_share": statistics.fmean(c["approximate"] for c in cells),
            "identical_share": statistics.fmean(c["identical"] for c in cells),
            "token_f1_vs_exact": statistics.fmean(c["token_f1_vs_exact"] for c in cells),
            "quality": statistics.fmean(c["quality"] for c in cells),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_user_arguments(parser, qmsum_users=1, squad_users=2, queries=15)
    parser.add_argument("--recompute", default="0,16,32", help="comma-separated tokens recomputed per chunk")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/approximate_reuse.json")
    args = parser.parse_args(argv)
    settings = [int(v) for v in args.recompute.split(",")]
    engine = LlamaEngine(resolve_model_path(None))
    engine.warm_up()
    embedder = BertEmbedder()
    by_dataset: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, user in enumerate(users_from_arguments(args)):
            rows = measure_user(
                user, engine, embedder, Path(folder) / str(index), settings, args.max_new_tokens
            )
            by_dataset.setdefault(user.dataset, []).extend(rows)
    result = {
        "settings": vars(args),
        "summary": {name: summarize(rows, settings) for name, rows in by_dataset.items()},
        "questions": by_dataset,
    }
    write_json(result, args.out)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
