"""Exact mode against cache-off, semantic mode's trade-off, and prompt-lookup decoding.

Pairs (``--pairs``, default ``benchmarks/data/exactness_pairs.jsonl``, written for this
benchmark and kept apart from the verifier's tuning set) hold a stored SQuAD question of
``--data`` and an asked paraphrase or near miss. For each pair, side by side in one run:

- cache-off: the asked question with every cache off (the reference, and the miss time);
- exact, path stored: a cache that answered the stored question, then the asked one;
- exact, first chunk: the same, with only [system, chunk 1] states left in the tree.

Reports the hit latency p50 as a ratio of the miss (paraphrases served from the QA bank),
the share of paraphrases served wholly from the draft, and whether every answer equals
the cache-off answer (it must). Semantic mode: false-hit and paraphrase-hit rates per tau
(embedding + lexical verifier, no model). Decode speed: tokens/s with and without
prompt-lookup drafts on ``--lookup-questions`` SQuAD and QMSum questions (identical tokens).

    .venv/bin/python benchmarks/exactness.py --data ../shared/data --out benchmarks/results/exactness.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path
from percache_core.qa.verifier import make_verifier
from percache_core.types import ANSWERED_BEFORE, QAEntry

OFF = {"qa_bank": False, "chunk_states": False, "prompt_lookup": False}
TAUS = (0.80, 0.85, 0.90, 0.95)


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def documents_of(data: Path, dataset: str, user: str, limit: int | None = None) -> list[dict]:
    rows = [r for r in load_jsonl(data / dataset / "documents.jsonl") if r["user"] == user]
    docs = [
        {"id": r["doc_id"], "text": r["text"], "metadata": {"meeting_id": r.get("meeting_id", "")}}
        for r in rows
    ]
    return docs[:limit] if limit else docs


def p50(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def drop_deeper_states(pc: PerCache, depth: int) -> None:
    """Keep only chunk-state nodes of depth <= *depth* (system = 1, first chunk = 2)."""
    for node in sorted(internals(pc).tree.nodes, key=lambda n: -n.depth):
        if node.depth > depth:
            internals(pc).states.delete(node.key)


def exact_mode(args, engine, embedder, pairs) -> dict:
    results = {"pairs": [], "identical": True}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for index, pair in enumerate(pairs):
            documents = documents_of(args.data, pair["dataset"], pair["user"])
            row = {"asked": pair["asked"], "label": pair["label"], "kind": pair["kind"]}
            caches = {}
            for name, config in (
                ("off", OFF),
                ("path", {}),
                ("first_chunk", {}),
            ):
                pc = PerCache.open(
                    root / f"{index}-{name}",
                    config=PerCacheConfig(max_new_tokens=args.max_new_tokens, **config),
                    engine=engine,
                    embedder=embedder,
                )
                pc.add_documents(documents)
                caches[name] = pc
            reference = caches["off"].answer(pair["asked"])
            row["miss_s"] = reference.latency_s
            for name in ("path", "first_chunk"):
                pc = caches[name]
                pc.answer(pair["stored"])
                if name == "first_chunk":
                    drop_deeper_states(pc, 2)
                answer = pc.answer(pair["asked"])
                row[name] = {
                    "latency_s": answer.latency_s,
                    "source": answer.source,
                    "identical": answer.text == reference.text,
                    "draft_tokens_accepted": answer.draft_tokens_accepted,
                    "generated_tokens": answer.generated_tokens,
                    "similarity": answer.similarity,
                }
                results["identical"] &= answer.text == reference.text
            for pc in caches.values():
                pc.close()
            results["pairs"].append(row)
            print(
                f"{index + 1:2d}/{len(pairs)} {pair['label']:10s} miss {row['miss_s']:.3f}s "
                f"path {row['path']['latency_s']:.3f}s ({row['path']['source']}) "
                f"first {row['first_chunk']['latency_s']:.3f}s ({row['first_chunk']['source']}) "
                f"same={row['path']['identical'] and row['first_chunk']['identical']}",
                flush=True,
            )
    paraphrases = [r for r in results["pairs"] if r["label"] == "paraphrase"]
    for name in ("path", "first_chunk"):
        served = [r for r in paraphrases if r[name]["source"] in ANSWERED_BEFORE]
        results[name] = {
            "paraphrases_served_from_draft": len(served) / max(1, len(paraphrases)),
            "hit_latency_p50_s": p50([r[name]["latency_s"] for r in served]),
            "miss_latency_p50_s": p50([r["miss_s"] for r in served]),
            "hit_to_miss_ratio_p50": p50([r[name]["latency_s"] / r["miss_s"] for r in served]),
            "all_latency_ratio_p50": p50([r[name]["latency_s"] / r["miss_s"] for r in results["pairs"]]),
            "near_misses_served": sum(
                r[name]["source"] in ANSWERED_BEFORE for r in results["pairs"] if r["label"] == "near_miss"
            ),
        }
    return results


def semantic_mode(embedder, pairs) -> dict:
    stored = embedder.embed([p["stored"] for p in pairs])
    asked = embedder.embed([p["asked"] for p in pairs])
    similarity = np.sum(stored * asked, axis=1)
    verifier = make_verifier("lexical")
    accepted = [
        verifier.verify(p["asked"], QAEntry("x", p["stored"], None, "stored"), float(s)).accepted
        for p, s in zip(pairs, similarity)
    ]
    rows = []
    for tau in TAUS:
        row = {"tau": tau}
        for name, keep in (("plain", [True] * len(pairs)), ("verified", accepted)):
            hits = [s >= tau and k for s, k in zip(similarity, keep)]
            para = [h for h, p in zip(hits, pairs) if p["label"] == "paraphrase"]
            near = [h for h, p in zip(hits, pairs) if p["label"] == "near_miss"]
            row[name] = {"paraphrase_hit_rate": float(np.mean(para)), "false_hit_rate": float(np.mean(near))}
        rows.append(row)
    return {"rows": rows, "similarities": [float(s) for s in similarity]}


def prompt_lookup_speed(args, engine, embedder) -> dict:
    results = {}
    rng = np.random.default_rng(args.seed)
    for dataset in ("squad11-dev", "qmsum"):
        queries = load_jsonl(args.data / dataset / "queries.jsonl")
        user = sorted({q["user"] for q in queries})[0]
        picked = rng.choice([q for q in queries if q["user"] == user], args.lookup_questions, replace=False)
        documents = documents_of(args.data, dataset, user, limit=200)
        timing = {"off": [0.0, 0], "lookup": [0.0, 0]}
        identical = True
        accepted = 0
        with tempfile.TemporaryDirectory() as folder:
            caches = {
                name: PerCache.open(
                    Path(folder) / name,
                    config=PerCacheConfig(
                        max_new_tokens=args.max_new_tokens,
                        qa_bank=False,
                        chunk_states=False,
                        prompt_lookup=name == "lookup",
                    ),
                    engine=engine,
                    embedder=embedder,
                )
                for name in timing
            }
            for pc in caches.values():
                pc.add_documents(documents)
            for query in picked:
                answers = {}
                for name, pc in caches.items():
                    answer = pc.answer(query["question"])
                    decode = answer.timings.get("decode", 0.0)
                    timing[name][0] += decode
                    timing[name][1] += answer.generated_tokens
                    answers[name] = answer
                identical &= answers["off"].text == answers["lookup"].text
                accepted += answers["lookup"].draft_tokens_accepted
            for pc in caches.values():
                pc.close()
        speed = {name: tokens / seconds if seconds else 0.0 for name, (seconds, tokens) in timing.items()}
        results[dataset] = {
            "questions": int(args.lookup_questions),
            "tokens_per_s_off": speed["off"],
            "tokens_per_s_lookup": speed["lookup"],
            "speedup": speed["lookup"] / speed["off"] if speed["off"] else float("nan"),
            "draft_tokens_accepted": accepted,
            "generated_tokens": timing["lookup"][1],
            "identical": identical,
        }
        print(dataset, json.dumps(results[dataset]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--pairs", type=Path, default=Path(__file__).parent / "data" / "exactness_pairs.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--lookup-questions", type=int, default=30)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--skip", nargs="*", default=(), choices=("exact", "semantic", "lookup"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/exactness.json"))
    args = parser.parse_args(argv)
    if not (args.data / "squad11-dev" / "documents.jsonl").is_file():
        raise SystemExit(f"{args.data} has no squad11-dev/documents.jsonl: pass --data")
    pairs = load_jsonl(args.pairs)
    engine = LlamaEngine(resolve_model_path(None))
    embedder = BertEmbedder()
    started = time.time()
    report: dict = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "pairs": len(pairs),
        "max_new_tokens": args.max_new_tokens,
    }
    if "semantic" not in args.skip:
        report["semantic"] = semantic_mode(embedder, pairs)
        for row in report["semantic"]["rows"]:
            print(f"semantic tau {row['tau']:.2f}: plain {row['plain']}, verified {row['verified']}")
    if "exact" not in args.skip:
        report["exact"] = exact_mode(args, engine, embedder, pairs)
        for name in ("path", "first_chunk"):
            print(name, json.dumps(report["exact"][name]))
        print("every exact answer equals cache-off:", report["exact"]["identical"])
    if "lookup" not in args.skip:
        report["prompt_lookup"] = prompt_lookup_speed(args, engine, embedder)
    report["seconds"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
