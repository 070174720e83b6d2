"""Does prediction raise hit rates, and what does idle population cost per strategy?

For each user (QMSum meeting series and SQuAD articles from ``--data``), the real question
sequence is answered from an empty cache by these configurations, side by side:

    reactive@tau        both tiers, no prediction
    predictive@tau      both tiers; before the first question two knowledge-based rounds
                        (stride ``--stride``), after each answer a history-based round
                        (idle time: not counted in the answers' latency)

with tau 0.85 (below the 0.875 cutoff: prefill+decode population) and 0.90 (above it:
prefill-only population); at tau 0.90 it also runs prefill+decode population (cutoff
raised to 0.95) to measure what prefill-only saves. Writes JSON (``--out``).

    .venv/bin/python benchmarks/prediction.py --data ../shared/data --out benchmarks/results/prediction.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.data_sets import User, add_user_arguments, users_from_arguments
from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path

KINDS = {"qmsum": "meeting transcripts", "squad11-dev": "encyclopedia articles"}


def run_user(user: User, config: PerCacheConfig, predictive: bool, engine, embedder, folder: Path) -> dict:
    with PerCache.open(folder, config=config, engine=engine, embedder=embedder) as pc:
        pc.add_documents(user.documents, split=False)
        rounds = []
        if predictive:
            for _ in range(2):
                rounds.append(pc.warm(progress=False))
        answers = []
        for query in user.queries:
            answer = pc.answer(query["question"])
            answers.append(answer)
            if predictive:
                rounds.append(pc.warm(progress=False, knowledge_prediction=False))
        generated = [a for a in answers if not a.answered_before]
        idle = pc.stats()["idle"]
    return {
        "queries": len(answers),
        "qa_bank_hit_rate": sum(a.answered_before for a in answers) / len(answers),
        "chunk_state_hit_rate": (sum(a.reused_chunks > 0 for a in generated) / len(generated))
        if generated
        else 0.0,
        "prefix_overlap": statistics.fmean(a.reused_chunks / max(1, len(a.chunk_ids)) for a in generated)
        if generated
        else 0.0,
        "mean_latency_s": statistics.fmean(a.latency_s for a in answers),
        "distinct_predicted_per_round": [len(set(r.predicted)) for r in rounds],
        "idle": {
            "seconds": sum(r.seconds for r in rounds),
            "prefill_tokens": sum(r.prefill_tokens for r in rounds),
            "decode_tokens": sum(r.decode_tokens for r in rounds),
            "by_strategy": {k: v for k, v in idle.items() if k in ("prefill_only", "prefill_decode")},
        },
        "predicted_examples": [q for r in rounds[:2] for q in r.predicted][:6],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_user_arguments(parser, qmsum_users=2, squad_users=2, queries=6)
    parser.add_argument("--stride", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prediction.json"))
    args = parser.parse_args()

    users = users_from_arguments(args)
    engine = LlamaEngine(resolve_model_path(None))
    engine.warm_up()
    embedder = BertEmbedder()
    embedder.embed(["warm-up"])
    systems = {
        "reactive@0.85": (0.85, 0.875, False),
        "predictive@0.85": (0.85, 0.875, True),
        "reactive@0.90": (0.90, 0.875, False),
        "predictive@0.90 (prefill-only)": (0.90, 0.875, True),
        "predictive@0.90 (prefill+decode)": (0.90, 0.95, True),
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="percache-prediction-") as temporary:
        for user in users:
            key = f"{user.dataset}/{user.name}"
            results[key] = {}
            for system, (tau, cutoff, predictive) in systems.items():
                config = PerCacheConfig(
                    similarity_threshold=tau,
                    strategy_cutoff=cutoff,
                    prediction_stride=args.stride,
                    max_new_tokens=args.max_new_tokens,
                    knowledge_kind=KINDS[user.dataset],
                    abstract_batches_per_round=4,
                    seed=args.seed,
                )
                started = time.perf_counter()
                folder = Path(temporary) / f"{user.name}-{len(results[key])}"
                results[key][system] = run_user(user, config, predictive, engine, embedder, folder)
                row = results[key][system]
                print(
                    f"{key:<32} {system:<33} QA {row['qa_bank_hit_rate']:5.2f}  states {row['chunk_state_hit_rate']:5.2f}"
                    f"  overlap {row['prefix_overlap']:5.2f}  idle {row['idle']['seconds']:6.1f}s  ({time.perf_counter() - started:5.0f}s)",
                    flush=True,
                )
    engine.close()

    summary = {}
    for system in systems:
        rows = [results[user][system] for user in results]
        summary[system] = {
            "qa_bank_hit_rate": statistics.fmean(r["qa_bank_hit_rate"] for r in rows),
            "chunk_state_hit_rate": statistics.fmean(r["chunk_state_hit_rate"] for r in rows),
            "prefix_overlap": statistics.fmean(r["prefix_overlap"] for r in rows),
            "idle_seconds": statistics.fmean(r["idle"]["seconds"] for r in rows),
        }
    raised = {
        tau: {
            "qa_bank": all(
                results[u][f"predictive@{tau}" + ("" if tau == "0.85" else " (prefill-only)")][
                    "qa_bank_hit_rate"
                ]
                > results[u][f"reactive@{tau}"]["qa_bank_hit_rate"]
                for u in results
            ),
            "chunk_states": all(
                results[u][f"predictive@{tau}" + ("" if tau == "0.85" else " (prefill-only)")][
                    "chunk_state_hit_rate"
                ]
                > results[u][f"reactive@{tau}"]["chunk_state_hit_rate"]
                for u in results
            ),
        }
        for tau in ("0.85", "0.90")
    }
    only, both = summary["predictive@0.90 (prefill-only)"], summary["predictive@0.90 (prefill+decode)"]
    saving = 1 - only["idle_seconds"] / both["idle_seconds"] if both["idle_seconds"] else 0.0
    print(f"\n{'system':<33} {'QA hit':>7} {'state hit':>9} {'overlap':>8} {'idle s':>7}")
    for system, row in summary.items():
        print(
            f"{system:<33} {row['qa_bank_hit_rate']:>7.2f} {row['chunk_state_hit_rate']:>9.2f} {row['prefix_overlap']:>8.2f} {row['idle_seconds']:>7.1f}"
        )
    print(f"prediction raised the hit rate on every user: {raised}")
    print(
        f"prefill-only population at tau 0.90 saves {saving:.1%} of idle compute (seconds) against prefill+decode"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "prediction",
                "settings": {
                    **vars(args),
                    "data": str(args.data),
                    "out": str(args.out),
                    "systems": {k: list(v) for k, v in systems.items()},
                },
                "per_user": results,
                "summary": summary,
                "raised_on_every_user": raised,
                "prefill_only_idle_saving": saving,
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
