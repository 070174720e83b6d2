"""Approximate answers within ``max_error_rate``, judged against the model's own answers.

**Semantic hits** (``qa_mode="semantic"``). For each user of ``--pairs`` (stored SQuAD
questions with an asked paraphrase or near miss; ``benchmarks/data/exactness_pairs.jsonl``
by default, the development set), one cache, as a user would run it:

1. ``--history`` of the user's own questions (not in the pairs) are asked: the stored
   answers offered for each are compared with the model's answer (free labels);
2. each pair's stored question is asked (its answer is stored);
3. one idle round labels variants of the stored questions (``--calibration-answers`` model
   answers at most);
4. each pair's asked question is looked up at each bound of ``--bounds`` (1.0: no bound,
   the paper's behaviour at tau), without storing anything.

A cache with every tier off gives the model's own answer to every asked and stored
question. Per bound: the asked questions served without the model, those served an answer
that is not the model's own (as a share of all asked: at most the bound, if it holds), the
paraphrases the model answers exactly as their stored pair and the share of them served,
the near misses served; and what calibration cost.

**Composed chunk states** (``reuse="approximate"``), for ``--composed-users`` (a QMSum and
a SQuAD user by default): ``--history`` questions asked, then one idle round that answers
them again with composed chunks at each recompute setting; the error rate per setting and
the setting each bound picks (None: compose nothing, every answer exact).

    .venv/bin/python -m benchmarks.bounded --data ../shared/data --out benchmarks/results/bounded.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path
from percache_core.policies import recompute_ladder
from percache_core.qa.calibration import COMPOSED, CONTEXTS, error_upper_bound

from .data_sets import default_data_folder, query_scope, read_data_set, read_jsonl
from .output import write_json

OFF = {"qa_bank": False, "chunk_states": False}
IDLE_ONLY_CALIBRATION = {"prediction": False, "knowledge_prefill": False}


def open_cache(folder: Path, engine: LlamaEngine, embedder: Any, documents: list[dict], **config: Any) -> PerCache:
    pc = PerCache.open(folder, config=PerCacheConfig(**config), engine=engine, embedder=embedder)
    pc.add_documents(documents, split=True)
    return pc


def user_documents(data: Path, dataset: str, user: str) -> tuple[list[dict], list[dict]]:
    documents, by_user = read_data_set(data, dataset)
    mine = [
        {"id": d["doc_id"], "text": d["text"], "metadata": query_scope(d) or {}} for d in documents if d["user"] == user
    ]
    return mine, by_user.get(user, [])


def semantic_user(
    args: argparse.Namespace, user: str, pairs: list[dict], engine: LlamaEngine, embedder: Any, root: Path
) -> dict[str, Any]:
    dataset = pairs[0]["dataset"]
    documents, queries = user_documents(args.data, dataset, user)
    in_pairs = {p["stored"] for p in pairs} | {p["asked"] for p in pairs}
    history = [q["question"] for q in queries if q["question"] not in in_pairs][: args.history]
    common = {"max_new_tokens": args.max_new_tokens}
    off = open_cache(root / f"{user}-off", engine, embedder, documents, **common, **OFF)
    reference = {q: off.answer(q).text for q in {*in_pairs}}
    off.close()
    pc = open_cache(
        root / f"{user}-semantic",
        engine,
        embedder,
        documents,
        **common,
        **IDLE_ONLY_CALIBRATION,
        qa_mode="semantic",
        similarity_threshold=args.tau,
        max_error_rate=min(args.bounds),
        calibration_answers_per_round=args.calibration_answers,
    )
    try:
        for question in history:
            pc.answer(question)
        for stored in dict.fromkeys(p["stored"] for p in pairs):
            pc.answer(stored)
        started = time.perf_counter()
        report = pc.warm(progress=False)
        idle_seconds = time.perf_counter() - started
        rows = []
        for pair in pairs:
            row = {
                "label": pair["label"],
                "kind": pair["kind"],
                "asked": pair["asked"],
                "same_as_stored": reference[pair["asked"]] == reference[pair["stored"]],
            }
            for bound in args.bounds:
                pc.configure(max_error_rate=bound)
                hit = pc.caller.lookup(pair["asked"])
                served = hit is not None
                row[str(bound)] = {
                    "served": served,
                    "wrong": served and hit.text != reference[pair["asked"]],
                    "similarity": hit.similarity if hit else None,
                    "estimated_accuracy": hit.estimated_accuracy if hit else None,
                }
            rows.append(row)
        approximate = pc.stats()["approximate"]
        calibration = internals(pc).parts.calibration
        thresholds = {
            str(b): {c: calibration.threshold(b, context=c) for c in CONTEXTS} for b in args.bounds if b < 1.0
        }
    finally:
        pc.close()
    return {
        "user": user,
        "history": len(history),
        "rows": rows,
        "labels": approximate["labels"],
        "labels_by_kind": approximate["labels_by_kind"],
        "thresholds": thresholds,
        "calibration_answers": report.calibration_answers,
        "calibration_seconds": report.calibration_seconds,
        "idle_round_seconds": idle_seconds,
    }


def semantic_summary(users: list[dict], bounds: list[float]) -> dict[str, Any]:
    rows = [row for user in users for row in user["rows"]]
    identical = [r for r in rows if r["label"] == "paraphrase" and r["same_as_stored"]]
    summary: dict[str, Any] = {
        "asked": len(rows),
        "paraphrases": sum(r["label"] == "paraphrase" for r in rows),
        "paraphrases_answered_as_stored": len(identical),
        "calibration_answers": sum(u["calibration_answers"] for u in users),
        "calibration_seconds": sum(u["calibration_seconds"] for u in users),
        "labels": sum(u["labels"] for u in users),
    }
    for bound in bounds:
        key = str(bound)
        served = [r for r in rows if r[key]["served"]]
        summary[key] = {
            "served": len(served),
            "served_share": len(served) / max(1, len(rows)),
            "served_wrong": sum(r[key]["wrong"] for r in rows),
            "wrong_share_of_asked": sum(r[key]["wrong"] for r in rows) / max(1, len(rows)),
            "identical_paraphrases_served": sum(r[key]["served"] for r in identical),
            "identical_paraphrase_share_served": sum(r[key]["served"] for r in identical) / max(1, len(identical)),
            "near_misses_served": sum(r[key]["served"] for r in rows if r["label"] == "near_miss"),
        }
    return summary


def composed_user(
    args: argparse.Namespace, dataset: str, user: str, engine: LlamaEngine, embedder: Any, root: Path
) -> dict[str, Any]:
    documents, queries = user_documents(args.data, dataset, user)
    config = {
        "max_new_tokens": args.max_new_tokens,
        "reuse": "approximate",
        "prediction": False,
        "knowledge_prefill": False,
        "calibration_answers_per_round": args.composed_answers,
    }
    pc = open_cache(root / f"{user}-composed", engine, embedder, documents, **config)
    try:
        runner = internals(pc).runner
        for query in queries[: args.history]:
            answer = pc.answer(query["question"], scope=query_scope(query))
            for chunk_id in answer.chunk_ids:  # what the knowledge prefill stores for these chunks
                chunk = internals(pc).knowledge.get_chunk(chunk_id)
                if chunk is not None:
                    runner.prefill_prefix([chunk])
        started = time.perf_counter()
        report = pc.warm(progress=False)
        seconds = time.perf_counter() - started
        labels = [label for label in internals(pc).parts.calibration.labels if label.kind == "composed"]
        ladder = recompute_ladder(internals(pc).parts.config.tiers)
        per_setting = {}
        for tokens in ladder:
            outcomes = [label.right for label in labels if label.entry_id == f"{COMPOSED}{tokens}"]
            wrong = outcomes.count(False)
            per_setting[str(tokens)] = {
                "labels": len(outcomes),
                "identical": len(outcomes) - wrong,
                "error_rate": wrong / len(outcomes) if outcomes else None,
                "error_upper_bound": error_upper_bound(wrong, len(outcomes)),
            }
        choice = {str(b): internals(pc).parts.calibration.recompute_choice(ladder, b) for b in args.bounds if b < 1.0}
    finally:
        pc.close()
    return {
        "dataset": dataset,
        "user": user,
        "questions": min(args.history, len(queries)),
        "per_recompute_tokens": per_setting,
        "recompute_choice": choice,
        "calibration_answers": report.calibration_answers,
        "calibration_seconds": report.calibration_seconds,
        "idle_round_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--pairs", type=Path, default=Path(__file__).parent / "data" / "exactness_pairs.jsonl")
    parser.add_argument("--bounds", type=float, nargs="+", default=[0.02, 0.05, 1.0])
    parser.add_argument("--tau", type=float, default=0.7, help="similarity_threshold (the user's floor)")
    parser.add_argument("--history", type=int, default=12)
    parser.add_argument("--calibration-answers", type=int, default=40)
    parser.add_argument("--composed-answers", type=int, default=40)
    parser.add_argument("--composed-users", default="qmsum:auto,squad11-dev:auto")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--skip", nargs="*", default=(), choices=("semantic", "composed"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bounded.json"))
    args = parser.parse_args(argv)
    args.data = args.data or default_data_folder()
    args.bounds = sorted(args.bounds)
    engine = LlamaEngine(resolve_model_path(None))
    embedder = BertEmbedder()
    started = time.perf_counter()
    result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="percache-bounded-") as temporary:
        root = Path(temporary)
        if "semantic" not in args.skip:
            pairs = read_jsonl(args.pairs)
            users = []
            for user in dict.fromkeys(p["user"] for p in pairs):
                users.append(semantic_user(args, user, [p for p in pairs if p["user"] == user], engine, embedder, root))
                print(user, {k: users[-1][k] for k in ("labels", "thresholds", "calibration_answers")}, flush=True)
            result["semantic"] = {"users": users, "summary": semantic_summary(users, args.bounds)}
            print("semantic", result["semantic"]["summary"], flush=True)
        if "composed" not in args.skip:
            composed = []
            for spec in args.composed_users.split(","):
                dataset, _, user = spec.partition(":")
                if user == "auto":  # the user with the fewest questions, as load_users picks
                    _, by_user = read_data_set(args.data, dataset)
                    user = sorted(by_user, key=lambda name: (len(by_user[name]), name))[0]
                composed.append(composed_user(args, dataset, user, engine, embedder, root))
                print("composed", composed[-1], flush=True)
            result["composed"] = composed
    result["seconds"] = time.perf_counter() - started
    print(f"wrote {write_json(result, args.out)} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
