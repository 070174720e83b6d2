"""Adaptive context: does a confidence signal from the model's own logits pick how many
retrieved chunks a question needs better than a fixed count? A calibration study.

For each question of ``--data`` (SQuAD users scored by SQuAD F1, QMSum users by ROUGE-L
against the reference answer), the answer is computed with the first k = 1..top_k
retrieved chunks, and after each prefill three signals are read from the logits of the
first answer token: the top probability, the entropy and the margin between the two most
likely tokens. An adaptive rule "stop at the first k whose signal passes t, else use
top_k" gives, for each question, exactly the fixed-k answer of the k it stops at, so every
rule is scored offline. Thresholds are chosen on a validation split (even positions of each
user's questions) and reported on the test split (odd positions), beside fixed k.
Writes JSON (``--out``); quality only, no timing (cost is the mean chunks used).

    .venv/bin/python -m benchmarks.adaptive_context --data ../shared/data
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from percache_core import PerCache, PerCacheConfig
from percache_core.answering.context import SIGNALS, confidence_signals, is_confident
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path
from percache_core.serving.state_runner import RunOptions
from percache_core.serving.streaming import drain

from .data_sets import add_user_arguments, query_scope, users_from_arguments
from .e2e_harness import rouge_l, squad_f1
from .output import write_json


def study_user(user: Any, pc: PerCache, top_k: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Per question: the signals and the score at every k."""
    pc.add_documents(user.documents, split=False)
    score = squad_f1 if user.dataset.startswith("squad") else rouge_l
    rows = []
    for position, query in enumerate(user.queries):
        scope = query_scope(query)
        chunks = [r.chunk for r in internals(pc).knowledge.retrieve(query["question"], top_k, where=scope)]
        steps = []
        for k in range(1, len(chunks) + 1):
            runner = internals(pc).runner
            layout = runner.lay_out(query["question"], chunks[:k], max_new_tokens=max_new_tokens)
            events = runner.run(layout, RunOptions(max_new_tokens, decode=False, keep_logits=True))
            measured = confidence_signals(drain(events).next_token_logits)
            answer = pc.caller.generate(query["question"], chunks[:k], max_new_tokens=max_new_tokens)
            steps.append(
                {**measured, "answer": answer.text, "score": score(answer.text, query.get("answer", ""))}
            )
        rows.append(
            {"user": user.name, "split": "validation" if position % 2 == 0 else "test", "steps": steps}
        )
        print(f"{user.name} q{position}: " + " ".join(f"{s['score']:.2f}" for s in steps), file=sys.stderr)
    return rows


def adaptive_k(steps: list[dict[str, Any]], signal: str, threshold: float) -> int:
    """The k an adaptive rule stops at (1-based): the first whose signal passes."""
    for k, step in enumerate(steps, start=1):
        if is_confident(step, signal, threshold):
            return k
    return len(steps)


def evaluate_rule(rows: list[dict[str, Any]], signal: str | None, threshold: float | int) -> dict[str, float]:
    """Mean score and mean chunks of a rule (signal None: a fixed count *threshold*)."""
    scores, used = [], []
    for row in rows:
        steps = row["steps"]
        k = min(int(threshold), len(steps)) if signal is None else adaptive_k(steps, signal, threshold)
        scores.append(steps[k - 1]["score"])
        used.append(k)
    return {"score": statistics.fmean(scores), "chunks": statistics.fmean(used)}


def calibrate(rows: list[dict[str, Any]], top_k: int) -> dict[str, Any]:
    """Best threshold per signal on the validation split, and every rule on the test split."""
    validation = [r for r in rows if r["split"] == "validation" and r["steps"]]
    test = [r for r in rows if r["split"] == "test" and r["steps"]]
    result: dict[str, Any] = {
        "questions": {"validation": len(validation), "test": len(test)},
        "fixed": {},
        "adaptive": {},
    }
    for k in range(1, top_k + 1):
        result["fixed"][str(k)] = {
            "validation": evaluate_rule(validation, None, k),
            "test": evaluate_rule(test, None, k),
        }
    for signal in SIGNALS:
        values = sorted({step[signal] for row in validation for step in row["steps"]})
        candidates = [float(v) for v in np.quantile(values, np.linspace(0, 1, 21))] if values else []
        best = max(
            candidates,
            key=lambda t: (
                evaluate_rule(validation, signal, t)["score"],
                -evaluate_rule(validation, signal, t)["chunks"],
            ),
            default=None,
        )
        if best is not None:
            result["adaptive"][signal] = {
                "threshold": best,
                "validation": evaluate_rule(validation, signal, best),
                "test": evaluate_rule(test, signal, best),
            }
    best_fixed = max(result["fixed"].values(), key=lambda r: r["validation"]["score"])
    result["best_fixed_on_validation"] = best_fixed
    result["signal_beats_fixed_on_test"] = any(
        rule["test"]["score"] > best_fixed["test"]["score"] for rule in result["adaptive"].values()
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_user_arguments(parser, qmsum_users=1, squad_users=3, queries=16)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/adaptive_context.json")
    args = parser.parse_args(argv)
    users = users_from_arguments(args)
    engine = LlamaEngine(resolve_model_path(None))
    embedder = BertEmbedder()
    config = PerCacheConfig(qa_bank=False, prediction=False, max_new_tokens=args.max_new_tokens)
    rows: list[dict[str, Any]] = []
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, user in enumerate(users):
            with PerCache.open(
                Path(folder) / str(index), config=config, engine=engine, embedder=embedder
            ) as pc:
                user_rows = study_user(user, pc, args.top_k, args.max_new_tokens)
            rows += user_rows
            by_dataset.setdefault(user.dataset, []).extend(user_rows)
    result = {
        "settings": vars(args),
        "calibration": {name: calibrate(part, args.top_k) for name, part in by_dataset.items()},
        "questions": rows,
    }
    write_json(result, args.out)
    print(json.dumps(result["calibration"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
