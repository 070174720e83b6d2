"""Measuring QA-bank hit verification on labelled question pairs.

A pair file is JSON lines ``{"a": stored question, "b": new question, "label":
"paraphrase" | "near_miss", "kind": ..., "scope_a"?: {...}, "scope_b"?: {...}}``. For each
tau, a pair is a hit when ``b`` would be served ``a``'s answer: same scope, cosine >= tau
(plain) or cosine >= tau - margin and the verifier accepts (verified). Reports the
paraphrase hit rate, the near-miss false-hit rate (overall and per kind) and the time the
verifier adds to a hit.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from percache_core.knowledge.embedding import Embedder
from percache_core.qa.verifier import make_verifier
from percache_core.types import QAEntry

DEFAULT_TAUS = (0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90, 0.95)


def read_pairs(path: Path) -> list[dict[str, Any]]:
    pairs = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    for number, pair in enumerate(pairs, 1):
        if pair.get("label") not in ("paraphrase", "near_miss") or not pair.get("a") or not pair.get("b"):
            raise ValueError(f"{path}:{number}: a pair needs 'a', 'b' and label paraphrase|near_miss")
    return pairs


def evaluate(
    pairs: list[dict[str, Any]], embedder: Embedder, *, taus=DEFAULT_TAUS, margin: float | None = None
) -> dict[str, Any]:
    """Hit and false-hit rates per tau, plain cosine vs the lexical verifier (semantic
    mode: the verifier only rejects; nothing below tau is a hit unless *margin* > 0 asks
    what a lower floor would do)."""
    margin = 0.0 if margin is None else margin
    stored = embedder.embed([p["a"] for p in pairs])
    asked = embedder.embed([p["b"] for p in pairs])
    cosine = np.sum(stored * asked, axis=1)
    same_scope = np.array([p.get("scope_a") or {} for p in pairs], dtype=object) == np.array(
        [p.get("scope_b") or {} for p in pairs], dtype=object
    )
    verifier = make_verifier("lexical")
    timings, accepted = [], []
    for pair, similarity in zip(pairs, cosine):
        entry = QAEntry("pair", pair["a"], None, "stored answer")
        started = time.perf_counter()
        verdict = verifier.verify(pair["b"], entry, float(similarity))
        timings.append(time.perf_counter() - started)
        accepted.append(verdict.accepted)
    accepted_arr = np.array(accepted)
    paraphrase = np.array([p["label"] == "paraphrase" for p in pairs])
    kinds = sorted({p.get("kind", "") for p in pairs if p["label"] == "near_miss"})
    rows = []
    for tau in taus:
        plain = same_scope & (cosine >= tau)
        verified = same_scope & (cosine >= tau - margin) & accepted_arr
        row = {"tau": tau}
        for name, hits in (("plain", plain), ("verified", verified)):
            row[name] = {
                "paraphrase_hit_rate": float(hits[paraphrase].mean()),
                "near_miss_false_hit_rate": float(hits[~paraphrase].mean()),
                "false_hits_by_kind": {
                    kind: float(
                        hits[
                            np.array([p["label"] == "near_miss" and p.get("kind", "") == kind for p in pairs])
                        ].mean()
                    )
                    for kind in kinds
                },
            }
        rows.append(row)
    return {
        "pairs": len(pairs),
        "paraphrases": int(paraphrase.sum()),
        "near_misses": int((~paraphrase).sum()),
        "verifier_margin": margin,
        "rows": rows,
        "verifier_latency_ms": {
            "p50": 1000 * statistics.median(timings),
            "p95": 1000 * float(np.percentile(timings, 95)),
        },
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{result['pairs']} pairs: {result['paraphrases']} paraphrases, {result['near_misses']} near-misses"
    )
    print(
        f"{'tau':>5}  {'plain: para hit':>15} {'false hit':>9}  {'verified: para hit':>18} {'false hit':>9}"
    )
    for row in result["rows"]:
        plain, verified = row["plain"], row["verified"]
        print(
            f"{row['tau']:>5.2f}  {plain['paraphrase_hit_rate']:>15.1%} {plain['near_miss_false_hit_rate']:>9.1%}"
            f"  {verified['paraphrase_hit_rate']:>18.1%} {verified['near_miss_false_hit_rate']:>9.1%}"
        )
    latency = result["verifier_latency_ms"]
    print(f"verifier time per candidate: p50 {latency['p50']:.3f} ms, p95 {latency['p95']:.3f} ms")
