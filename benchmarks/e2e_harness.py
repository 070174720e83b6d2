"""End-to-end evaluation: PerCache against single-stage and combined baselines.

Every system is a configuration of the same pipeline (same retrieval, model, prompts and
greedy decoding) and starts from an empty cache per user:

    stock                 stock llama_cpp.Llama answering naive's prompt (what users run today;
                          its own prefix reuse on), after the same retrieval
    naive                 no cache (on an engine of its own when stock runs too: each keeps its context)
    ragcache              chunk states only, reactive
    meancache             QA bank only (plain cosine), reactive
    sleeptime             QA bank filled only by predicted questions with answers
    ragcache+meancache    both tiers, reactive
    ragcache+sleeptime    chunk states (reactive) + QA bank of predicted answers
    percache              both tiers, verified hits, predictive, scheduler

Predictive systems run two knowledge-based rounds before the first question and a
history-based round after each answer: idle time, reported apart and never overlapping a
measured question. With an idle-time budget (``idle_seconds``), they instead run one round
of at most that many seconds before each question, as a person's pauses allow. Metrics per user and system: latency (mean, p50, p95), TTFT, QA-bank
hit rate, chunk-state prefix overlap, ROUGE-L against the references and against the naive
system's answers, idle compute, cache bytes and a per-stage time breakdown.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import string
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from percache_core.config import PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.engines.llama_server.server import LlamaServer, ServerLaunch
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.models import resolve_model_path
from percache_core.pipeline import PerCache
from percache_core.types import ANSWERED_BEFORE

from .data_sets import User, load_merged_user, load_users, query_scope
from .output import write_json

STAGES = ("embed", "qa_check", "retrieve", "restore", "prefill", "decode", "store_states", "store_qa")
KINDS = {"qmsum": "meeting transcripts", "squad11-dev": "encyclopedia articles"}


@dataclass(frozen=True)
class System:
    name: str
    changes: dict[str, Any]
    predictive: bool


STOCK = System("stock", {"qa_bank": False, "chunk_states": False}, False)  # retrieval only; Llama answers
SYSTEMS = (
    STOCK,
    System("naive", {"qa_bank": False, "chunk_states": False}, False),
    System("ragcache", {"qa_bank": False}, False),
    System("meancache", {"chunk_states": False, "verifier": "none"}, False),
    System("sleeptime", {"chunk_states": False, "store_answers": False, "verifier": "none"}, True),
    System("ragcache+meancache", {"verifier": "none"}, False),
    System(
        "ragcache+sleeptime",
        {"store_answers": False, "verifier": "none", "strategy_cutoff": 1.0, "knowledge_prefill": False},
        True,
    ),
    System("percache", {}, True),
)
PERCACHE = SYSTEMS[-1]
OPT_INS = (  # PerCache with an opt-in that may change answers or the chunks used (``--systems``)
    System("percache-approximate", {"reuse": "approximate"}, True),  # within the default max_error_rate
    System("percache-approximate-unbounded", {"reuse": "approximate", "max_error_rate": 1.0}, True),
    System("percache-adaptive", {"context": "adaptive"}, True),
)
ABLATIONS = (
    System("percache-no-pairs", {"knowledge_prefill_neighbours": 0}, True),
    System("percache-whole-states", {"chunk_state_slices": False}, True),
    System("percache-no-qa_bank", {"qa_bank": False}, True),
    System("percache-no-chunk_states", {"chunk_states": False}, True),
    System("percache-no-prediction", {}, False),
)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of word sequences (longest common subsequence), in [0, 1].

    >>> round(rouge_l("the rehearsal is on Thursday", "rehearsal on Thursday at 4"), 3)
    0.6
    """
    a, b = candidate.lower().split(), reference.lower().split()
    if not a or not b:
        return 0.0
    previous = [0] * (len(b) + 1)
    for word in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if word == other else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def squad_f1(candidate: str, reference: str) -> float:
    """SQuAD's token F1 (lower case, punctuation and articles removed), in [0, 1].

    >>> squad_f1("The Eiffel tower.", "eiffel tower"), squad_f1("Paris", "London")
    (1.0, 0.0)
    """

    def words(text: str) -> list[str]:
        text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
        return re.sub(r"\b(a|an|the)\b", " ", text).split()

    got, want = words(candidate), words(reference)
    common = sum((Counter(got) & Counter(want)).values())
    if not got or not want or not common:
        return float(got == want)
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def _summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan")}
    array = np.asarray(values, dtype=float)
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p95": float(np.percentile(array, 95)),
    }


class MemoEmbedder:
    """An embedder that embeds each text once per run (every system adds the same
    knowledge: the merged QMSum knowledge takes minutes to embed)."""

    def __init__(self, embedder: Any) -> None:
        self._embedder = embedder
        self.name = embedder.name
        self._vectors: dict[str, np.ndarray] = {}

    @property
    def dimension(self) -> int:
        return self._embedder.dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        missing = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if missing:
            self._vectors.update(zip(missing, self._embedder.embed(missing)))
        return np.stack([self._vectors[t] for t in texts]) if texts else self._embedder.embed(texts)


class SystemRun:
    """One system answering one user's questions from an empty cache in *folder*. The
    stock system retrieves through its cache (caches off) and answers with *stock*."""

    def __init__(
        self,
        system: System,
        config: PerCacheConfig,
        engine: LlamaEngine,
        embedder: Any,
        folder: Path,
        stock: Any = None,
    ) -> None:
        self.system = system
        self.stock = stock if system.name == STOCK.name else None
        self.folder = folder
        self.records: list[dict[str, Any]] = []
        self.idle = {
            "seconds": 0.0,
            "chunks_prefilled": 0,
            "pairs_prefilled": 0,
            "predicted_paths_prefilled": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "distinct_predicted_per_round": [],
        }
        self.pc = PerCache.open(folder, config=config, engine=engine, embedder=embedder)

    def idle_round(self, knowledge: bool, max_seconds: float | None = None) -> None:
        """An idle round (predictive systems only), of at most *max_seconds*; its cost is
        accounted apart."""
        if not self.system.predictive:
            return
        report = self.pc.warm(progress=False, knowledge_prediction=knowledge, max_seconds=max_seconds)
        self.idle["seconds"] += report.seconds
        self.idle["predicted_paths_prefilled"] += report.predicted_paths_prefilled
        self.idle["chunks_prefilled"] += report.chunks_prefilled
        self.idle["pairs_prefilled"] += report.pairs_prefilled
        self.idle["prefill_tokens"] += report.prefill_tokens
        self.idle["decode_tokens"] += report.decode_tokens
        self.idle["distinct_predicted_per_round"].append(len(set(report.predicted)))

    def ask(self, query: dict[str, Any]) -> None:
        """Answer one question and record it (a failure is recorded, never skipped)."""
        record: dict[str, Any] = {"qid": query["qid"], "question": query["question"]}
        try:
            ask = self.pc.answer if self.stock is None else self.stock_answer
            answer = ask(query["question"], scope=query_scope(query))
            record.update(
                answer=answer.text,
                source=answer.source,
                matched_question=answer.matched_question,
                chunk_ids=list(answer.chunk_ids),
                latency_s=answer.latency_s,
                ttft_s=answer.ttft_s,
                prefix_overlap=answer.reused_chunks / max(1, len(answer.chunk_ids))
                if not answer.answered_before
                else None,
                rouge_reference=rouge_l(answer.text, query.get("answer", "")),
                f1_reference=squad_f1(answer.text, query.get("answer", "")),
                stages={stage: answer.timings.get(stage, 0.0) for stage in STAGES},
            )
        except Exception as error:
            record.update(error=f"{type(error).__name__}: {error}")
        self.records.append(record)

    def stock_answer(self, question: str, *, scope: dict[str, Any] | None) -> Any:
        """Naive's prompt (same retrieval and layout) completed by stock ``llama_cpp.Llama``
        as one string, greedy, with the same stop strings and token limit; an ``Answer``
        whose latency counts the retrieval and the completion."""
        from percache_core.types import Answer

        started = time.perf_counter()
        parts, config = internals(self.pc).parts, self.pc.config
        embedding = parts.embed_question(question)
        retrieved = parts.knowledge.retrieve(question, config.retrieval.top_k, question_embedding=embedding, where=scope)
        chunks = [r.chunk for r in retrieved]
        layout = parts.runtime.runner.lay_out(question, chunks, max_new_tokens=config.engine.max_new_tokens)
        prefill_started = time.perf_counter()
        first: list[float] = []
        text = ""
        for piece in self.stock.create_completion(
            layout.text, max_tokens=config.engine.max_new_tokens, temperature=0.0, stop=list(config.engine.stop), stream=True
        ):
            if not first:
                first.append(time.perf_counter())
            text += piece["choices"][0]["text"]
        done = time.perf_counter()
        ttft = (first[0] if first else done) - started
        timings = {"retrieve": prefill_started - started, "prefill": ttft - (prefill_started - started)}
        timings["decode"] = done - started - ttft
        return Answer(
            text=text.strip(),
            source="full",
            question=question,
            chunk_ids=layout.chunk_ids,
            ttft_s=ttft,
            latency_s=done - started,
            timings=timings,
        )

    def finish(self) -> dict[str, Any]:
        """Close the cache, delete its folder (chunk states take hundreds of MB) and return
        the records, the idle account and the cache sizes."""
        try:
            stats = self.pc.stats()
            self.pc.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return {
            "records": self.records,
            "idle": self.idle,
            "prediction": stats.get("prediction"),
            "cache_bytes": {
                "qa_bank": stats["qa_bank"]["bytes"],
                "chunk_states": stats["chunk_states"]["bytes"],
            },
        }


def run_user(
    user: User,
    variants: Sequence[tuple[str, System, PerCacheConfig]],
    engine: LlamaEngine,
    embedder: Any,
    folder: Path,
    stock: Any = None,
    idle_seconds: float | None = None,
    own_engines: dict[str, LlamaEngine] | None = None,
) -> dict[str, dict[str, Any]]:
    """Answer the user's questions with every (label, system, config) variant, interleaved:
    question i is asked of every variant before question i + 1, so that slow drifts of the
    machine's speed fall on all systems alike. Predictive variants run two knowledge rounds
    before the first question and a history round after each question, never while a
    measured question runs; with *idle_seconds*, one round of at most that long before
    each question instead. *own_engines*: systems that run on an engine of their own (by
    name), as a user runs one pipeline on one model."""
    runs: dict[str, SystemRun] = {}
    try:
        for label, system, config in variants:
            run = SystemRun(system, config, (own_engines or {}).get(system.name, engine), embedder, folder / label, stock)
            runs[label] = run
            run.pc.add_documents(user.documents, split=False, progress=len(user.documents) > 1000)
        if idle_seconds is None:
            for _ in range(2):
                for run in runs.values():
                    run.idle_round(knowledge=True)
        for query in user.queries:
            if idle_seconds is not None:
                for run in runs.values():
                    run.idle_round(knowledge=True, max_seconds=idle_seconds)
            for run in runs.values():
                run.ask(query)
            if idle_seconds is None:
                for run in runs.values():
                    run.idle_round(knowledge=False)
    finally:
        results = {label: run.finish() for label, run in runs.items()}
    return results


def _totals(run: dict[str, Any], naive: dict[str, Any] | None) -> dict[str, Any]:
    ok = [r for r in run["records"] if "error" not in r]
    generated = [r for r in ok if r["source"] not in ANSWERED_BEFORE]
    naive_answers = {r["qid"]: r.get("answer", "") for r in (naive or run)["records"]}
    return {
        "answered": len(ok),
        "failures": len(run["records"]) - len(ok),
        "latency_s": _summary([r["latency_s"] for r in ok]),
        "ttft_s": _summary([r["ttft_s"] for r in ok]),
        "qa_bank_hit_rate": sum(r["source"] in ANSWERED_BEFORE for r in ok) / max(1, len(ok)),
        "chunk_state_prefix_overlap": statistics.fmean(r["prefix_overlap"] for r in generated)
        if generated
        else 0.0,
        "rouge_l_reference": statistics.fmean(r["rouge_reference"] for r in ok) if ok else 0.0,
        "rouge_l_naive": statistics.fmean(rouge_l(r["answer"], naive_answers.get(r["qid"], "")) for r in ok)
        if ok
        else 0.0,
        "f1_reference": statistics.fmean(r["f1_reference"] for r in ok) if ok else 0.0,
        "identical_to_naive": statistics.fmean(r["answer"] == naive_answers.get(r["qid"]) for r in ok) if ok else 0.0,
        "stage_seconds_mean": {
            s: statistics.fmean(r["stages"][s] for r in ok) if ok else 0.0 for s in STAGES
        },
        "idle": run["idle"],
        "cache_bytes": run["cache_bytes"],
    }


def sensitivity_runs(
    taus: Sequence[float] = (),
    strides: Sequence[int] = (),
    budgets_mb: Sequence[int] = (),
    ablations: bool = False,
) -> list[tuple[str, Any, System, dict[str, Any]]]:
    """The sensitivity and ablation runs of PerCache on the showcase user:
    (sweep, value, system, config changes) for each.

    >>> [(sweep, value) for sweep, value, _, _ in sensitivity_runs(taus=[0.8], strides=[1])]
    [('tau', 0.8), ('stride', 1)]
    """
    runs: list[tuple[str, Any, System, dict[str, Any]]] = []
    runs += [("tau", tau, PERCACHE, {"similarity_threshold": tau}) for tau in taus]
    runs += [("stride", stride, PERCACHE, {"prediction_stride": stride}) for stride in strides]
    runs += [
        ("chunk_state_budget_mb", mb, PERCACHE, {"chunk_state_budget_bytes": mb * 1024 * 1024})
        for mb in budgets_mb
    ]
    if ablations:
        runs += [("ablation", system.name, system, {}) for system in ABLATIONS]
    return runs


def evaluate(
    *,
    data: Path,
    qmsum_users: int,
    squad_users: int,
    queries_per_user: int,
    seed: int = 0,
    stride: int = 5,
    max_new_tokens: int = 64,
    systems: Sequence[System] = SYSTEMS,
    taus: Sequence[float] = (),
    strides: Sequence[int] = (),
    budgets_mb: Sequence[int] = (),
    ablations: bool = False,
    progress: Callable[[str], None] = print,
    partial: Path | None = None,
    skip_users: int = 0,
    engine: LlamaEngine | None = None,
    embedder: Any = None,
    merged: tuple[int, int] | None = None,
    consecutive: bool = False,
    idle_seconds: float | None = None,
    budget_gib: float | None = None,
    server: bool = False,
) -> dict[str, Any]:
    """Run every system on every user, then the sensitivity and ablation runs (see
    :func:`sensitivity_runs`) of PerCache on the first user. After each user, what is
    done so far is written to *partial* (JSON), so a stopped run keeps its users.

    *engine* and *embedder* are loaded (the default model and MiniLM) unless given: a
    caller that has them loaded already passes them, and an engine passed in is not
    closed.

    *merged* (series, questions per series) evaluates one user instead: every QMSum
    meeting as one knowledge (``data_sets.load_merged_user``; *consecutive*: questions in a
    row per series). *idle_seconds* bounds each
    idle round (one before each question); *budget_gib* sets every system's chunk-state
    budget. With *server*, the systems run on llama-servers (``LlamaServer.start``; naive
    on one of its own) and stock is the same llama-server alone, as users run it
    (``benchmarks.server.ServerAlone``: its own prefix reuse and RAM cache on)."""
    users: list[User] = []
    if merged is not None:
        users.append(
            load_merged_user(
                data, "qmsum", series=merged[0], per_series=merged[1], seed=seed, consecutive=consecutive
            )
        )
    for dataset, count in (("qmsum", qmsum_users), ("squad11-dev", squad_users)):
        if count > 0 and merged is None:
            users += load_users(data, dataset, users=count, queries_per_user=queries_per_user, seed=seed)
    users = users[skip_users:]  # to go on with the users a stopped run did not reach
    owns_engine = engine is None
    if owns_engine:
        engine = LlamaServer.start(resolve_model_path(None), ServerLaunch(n_ctx=2048)) if server else LlamaEngine(resolve_model_path(None))
    model_path = engine.model_path
    engine.warm_up()
    stock = None
    if server and any(system.name == STOCK.name for system in systems):
        from .server import ServerAlone

        stock = ServerAlone(model_path, os.cpu_count() or 2)
    elif any(system.name == STOCK.name for system in systems):
        from .stock import stock_llama  # stock llama.cpp, as users run it (prefix reuse on)

        stock = stock_llama(model_path, engine.n_ctx, os.cpu_count() or 2, engine.n_batch)
    # naive against stock: each keeps its own context between questions (stock's Llama
    # does), so naive gets an engine of its own rather than one that other systems' runs
    # and idle rounds change in between
    own_engines: dict[str, Any] = {}
    if stock is not None and any(system.name == "naive" for system in systems):
        own_engines["naive"] = (
            LlamaServer.start(model_path, ServerLaunch(n_ctx=engine.n_ctx)) if server
            else LlamaEngine(model_path, n_ctx=engine.n_ctx, n_batch=engine.n_batch)
        )
        own_engines["naive"].warm_up()
    if embedder is None:
        embedder = BertEmbedder()
        embedder.embed(["warm-up"])
    embedder = MemoEmbedder(embedder)
    per_user: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}
    sweeps: list[dict[str, Any]] = []

    def system_config(user: User, system: System, **changes: Any) -> PerCacheConfig:
        """The same settings for every system, the system's changes, then *changes*."""
        config = PerCacheConfig(
            max_new_tokens=max_new_tokens,
            knowledge_kind=KINDS.get(user.dataset, "documents"),
            abstract_batches_per_round=4,
            seed=seed,
            prediction=system.predictive,
            prediction_stride=stride,
            chunk_state_budget_bytes=None if budget_gib is None else int(budget_gib * 1024**3),
        )
        return config.replace(**system.changes).replace(**changes)

    try:
        with tempfile.TemporaryDirectory(prefix="percache-e2e-") as temporary:
            for index, user in enumerate(users):
                key = f"{user.dataset}/{user.name}"
                started = time.perf_counter()
                variants = [(system.name, system, system_config(user, system)) for system in systems]
                runs[key] = run_user(
                    user, variants, engine, embedder, Path(temporary) / f"user-{index}", stock, idle_seconds, own_engines
                )
                per_user[key] = {
                    name: _totals(run, runs[key].get("naive")) for name, run in runs[key].items()
                }
                for name, totals in per_user[key].items():
                    progress(f"{key:<30} {name:<19} {_line(totals, started)}")
                if partial is not None:
                    partial.parent.mkdir(parents=True, exist_ok=True)
                    partial.write_text(json.dumps({"per_user": per_user, "runs": runs}, default=str))
            if users and (taus or strides or budgets_mb or ablations):
                user = users[0]
                key = f"{user.dataset}/{user.name}"
                started = time.perf_counter()
                variants = [("naive", SYSTEMS[0], system_config(user, SYSTEMS[0]))]
                labels = []
                for sweep, value, system, changes in sensitivity_runs(taus, strides, budgets_mb, ablations):
                    labels.append((f"{sweep}={value}", sweep, value))
                    variants.append((labels[-1][0], system, system_config(user, system, **changes)))
                sweep_runs = run_user(user, variants, engine, embedder, Path(temporary) / "sensitivity")
                for label, sweep, value in labels:
                    totals = _totals(sweep_runs[label], sweep_runs["naive"])
                    sweeps.append({"sweep": sweep, "value": value, "user": key, **totals})
                    progress(f"{label}: {_line(totals, started)}")
    finally:
        for own in own_engines.values():
            own.close()
        if owns_engine:
            engine.close()
        if server and stock is not None:
            stock.close()
    return {
        "benchmark": "e2e",
        "settings": {
            "data": str(data),
            "qmsum_users": qmsum_users,
            "squad_users": squad_users,
            "queries_per_user": queries_per_user,
            "seed": seed,
            "stride": stride,
            "max_new_tokens": max_new_tokens,
            "merged": merged,
            "consecutive": consecutive,
            "idle_seconds": idle_seconds,
            "budget_gib": budget_gib,
            "model": model_path.name,
            "embedder": embedder.name,
            "versions": _versions(),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "systems": {s.name: {"changes": s.changes, "predictive": s.predictive} for s in systems},
        },
        "per_user": per_user,
        "queries": {
            user: {name: run["records"] for name, run in systems_runs.items()}
            for user, systems_runs in runs.items()
        },
        "reduction": reductions(per_user),
        "tau_sweep": [_tau_row(row) for row in sweeps if row["sweep"] == "tau"],
        "sensitivity": sweeps,
    }


def _line(totals: dict[str, Any], started: float) -> str:
    return (
        f"mean {totals['latency_s']['mean']:6.3f}s  QA {totals['qa_bank_hit_rate']:4.2f}"
        f"  overlap {totals['chunk_state_prefix_overlap']:4.2f}  ROUGE-L {totals['rouge_l_reference']:.3f}"
        f"  idle {totals['idle']['seconds']:6.1f}s  ({time.perf_counter() - started:.0f}s)"
    )


def _tau_row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "tau": row["value"],
        "latency_mean_s": row["latency_s"]["mean"],
        "qa_bank_hit_rate": row["qa_bank_hit_rate"],
        "rouge_l_reference": row["rouge_l_reference"],
        "rouge_l_naive": row["rouge_l_naive"],
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("percache", "llama-cpp-python", "sentence-transformers", "torch", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def reductions(per_user: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """PerCache's mean-latency reduction against naive and against the best other system
    (None where that system was not run).

    >>> row = lambda seconds: {"latency_s": {"mean": seconds}}
    >>> result = reductions({"u": {"naive": row(2.0), "percache": row(1.0)}})
    >>> result["mean_vs_naive"], result["mean_vs_best_baseline"]
    (0.5, None)
    """
    rows = {}
    for user, systems in per_user.items():
        if "percache" not in systems:
            continue
        ours = systems["percache"]["latency_s"]["mean"]
        others = {
            name: row["latency_s"]["mean"]
            for name, row in systems.items()
            if name not in ("naive", STOCK.name) and not name.startswith("percache")
        }
        best = min(others, key=others.get) if others else None
        rows[user] = {
            "vs_naive": 1 - ours / systems["naive"]["latency_s"]["mean"] if "naive" in systems else None,
            "vs_stock": 1 - ours / systems[STOCK.name]["latency_s"]["mean"] if STOCK.name in systems else None,
            "naive_vs_stock": systems["naive"]["latency_s"]["mean"] / systems[STOCK.name]["latency_s"]["mean"]
            if "naive" in systems and STOCK.name in systems
            else None,
            "best_baseline": best,
            "vs_best_baseline": 1 - ours / others[best] if best else None,
            "lowest_of_all": all(ours <= value for value in others.values()),
        }

    def mean_of(name: str) -> float | None:
        values = [row[name] for row in rows.values() if row[name] is not None]
        return statistics.fmean(values) if values else None

    opt_ins: dict[str, list[float]] = {}
    for systems in per_user.values():
        for name, row in systems.items():
            if name.startswith("percache-") and "naive" in systems:
                opt_ins.setdefault(name, []).append(1 - row["latency_s"]["mean"] / systems["naive"]["latency_s"]["mean"])
    return {
        "per_user": rows,
        "mean_vs_naive": mean_of("vs_naive"),
        "mean_vs_stock": mean_of("vs_stock"),
        "mean_naive_vs_stock": mean_of("naive_vs_stock"),
        "mean_vs_best_baseline": mean_of("vs_best_baseline"),
        "opt_ins_mean_vs_naive": {name: statistics.fmean(values) for name, values in opt_ins.items()},
    }


def markdown_table(result: dict[str, Any]) -> str:
    """The summary: per system averaged over users (latency, hit rates, ROUGE-L), PerCache's
    reduction per user, where the time goes per stage, and the sensitivity runs."""
    per_user = result["per_user"]
    names = list(next(iter(per_user.values())).keys()) if per_user else []
    lines = [
        "| system | mean latency s | p95 s | TTFT s | QA hit | chunk-state overlap | ROUGE-L ref | F1 ref "
        "| ROUGE-L vs naive | = naive | idle s/user |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        rows = [systems[name] for systems in per_user.values()]
        lines.append(f"| {name} | " + _cells(rows) + " |")
    reduction = result["reduction"]
    if reduction["mean_vs_naive"] is not None and reduction["mean_vs_best_baseline"] is not None:
        lines += [
            "",
            f"PerCache mean latency: {reduction['mean_vs_naive']:.1%} below naive, "
            f"{reduction['mean_vs_best_baseline']:.1%} below the best baseline (averaged over users)."
            + "".join(
                f" {name}: {value:.1%} below naive."
                for name, value in reduction.get("opt_ins_mean_vs_naive", {}).items()
            ),
            "",
            "| user | naive s | best baseline | its s | percache s | vs naive | vs best | lowest of all |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for user, row in reduction["per_user"].items():
            systems = per_user[user]
            best = row["best_baseline"]
            lines.append(
                f"| {user} | {systems['naive']['latency_s']['mean']:.3f} | {best} "
                f"| {systems[best]['latency_s']['mean']:.3f} | {systems['percache']['latency_s']['mean']:.3f} "
                f"| {row['vs_naive']:.1%} | {row['vs_best_baseline']:.1%} | {'yes' if row['lowest_of_all'] else 'no'} |"
            )
    if reduction.get("mean_vs_stock") is not None:
        lines += [
            "",
            f"Against stock llama.cpp (naive's prompt, same retrieval): PerCache {reduction['mean_vs_stock']:.1%} "
            f"below; naive at {reduction['mean_naive_vs_stock']:.3f}x stock (averaged over users).",
        ]
    if names:
        lines += [
            "",
            "Where the time goes (mean seconds per question, averaged over users):",
            "",
            "| system | " + " | ".join(STAGES) + " |",
            "|---|" + "---|" * len(STAGES),
        ]
        for name in names:
            rows = [systems[name] for systems in per_user.values()]
            cells = " | ".join(
                f"{statistics.fmean(r['stage_seconds_mean'][stage] for r in rows):.3f}" for stage in STAGES
            )
            lines.append(f"| {name} | {cells} |")
    if result.get("sensitivity"):
        lines += [
            "",
            f"Sensitivity and ablation (PerCache on {result['sensitivity'][0]['user']}):",
            "",
            "| run | mean latency s | p95 s | TTFT s | QA hit | chunk-state overlap | ROUGE-L ref | F1 ref "
            "| ROUGE-L vs naive | = naive | idle s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in result["sensitivity"]:
            lines.append(f"| {row['sweep']} = {row['value']} | " + _cells([row]) + " |")
    return "\n".join(lines)


def _cells(rows: list[dict[str, Any]]) -> str:
    def mean(get: Callable[[dict[str, Any]], float]) -> float:
        return statistics.fmean(get(r) for r in rows)

    return (
        f"{mean(lambda r: r['latency_s']['mean']):.3f} | {mean(lambda r: r['latency_s']['p95']):.3f} "
        f"| {mean(lambda r: r['ttft_s']['mean']):.3f} | {mean(lambda r: r['qa_bank_hit_rate']):.2f} "
        f"| {mean(lambda r: r['chunk_state_prefix_overlap']):.2f} | {mean(lambda r: r['rouge_l_reference']):.3f} "
        f"| {mean(lambda r: r['f1_reference']):.3f} | {mean(lambda r: r['rouge_l_naive']):.3f} "
        f"| {mean(lambda r: r['identical_to_naive']):.2f} | {mean(lambda r: r['idle']['seconds']):.1f}"
    )


def plot(result: dict[str, Any], folder: Path) -> list[Path]:
    """PNG figures: per-query latency of the showcase user, mean latency per user and
    system, and the tau trade-off (when swept). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    users = list(result["queries"])
    if users:
        showcase = result["queries"][users[0]]
        figure, axis = plt.subplots(figsize=(9, 4))
        for name, records in showcase.items():
            axis.plot([r.get("latency_s", np.nan) for r in records], marker="o", label=name)
        axis.set(xlabel="query", ylabel="latency (s)", title=f"Per-query latency, {users[0]}")
        axis.legend(fontsize=7)
        figure.tight_layout()
        written.append(folder / "per_query_latency.png")
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)

        figure, axis = plt.subplots(figsize=(10, 4))
        names = list(result["per_user"][users[0]])
        width = 0.8 / max(1, len(names))
        for index, name in enumerate(names):
            values = [result["per_user"][u][name]["latency_s"]["mean"] for u in users]
            axis.bar(np.arange(len(users)) + index * width, values, width, label=name)
        axis.set_xticks(
            np.arange(len(users)) + 0.4 - width / 2, [u.split("/")[-1] for u in users], fontsize=7
        )
        axis.set(ylabel="mean latency (s)", title="Mean latency per user and system")
        axis.legend(fontsize=7)
        figure.tight_layout()
        written.append(folder / "latency_per_user.png")
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)
    if users:
        written += _plot_ttft_by_source(result, folder, plt)
    if result["tau_sweep"]:
        sweep = result["tau_sweep"]
        figure, left = plt.subplots(figsize=(6, 4))
        taus = [row["tau"] for row in sweep]
        left.plot(
            taus, [row["latency_mean_s"] for row in sweep], marker="o", color="tab:blue", label="latency"
        )
        left.set(xlabel="tau", ylabel="mean latency (s)", title="Similarity threshold trade-off")
        right = left.twinx()
        right.plot(
            taus,
            [row["qa_bank_hit_rate"] for row in sweep],
            marker="s",
            color="tab:orange",
            label="QA hit rate",
        )
        right.plot(
            taus, [row["rouge_l_reference"] for row in sweep], marker="^", color="tab:green", label="ROUGE-L"
        )
        right.set(ylabel="rate / ROUGE-L")
        figure.legend(fontsize=7, loc="upper center")
        figure.tight_layout()
        written.append(folder / "tau_tradeoff.png")
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)
    others = [row for row in result.get("sensitivity", []) if row["sweep"] != "tau"]
    if others:
        figure, axis = plt.subplots(figsize=(8, 4))
        labels = [f"{row['sweep']}={row['value']}" for row in others]
        axis.bar(range(len(others)), [row["latency_s"]["mean"] for row in others])
        axis.set_xticks(range(len(others)), labels, rotation=30, ha="right", fontsize=7)
        axis.set(ylabel="mean latency (s)", title="PerCache: stride, budget and ablations")
        figure.tight_layout()
        written.append(folder / "sensitivity.png")
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)
    return written


def _plot_ttft_by_source(result: dict[str, Any], folder: Path, plt: Any) -> list[Path]:
    """Time to first token of PerCache's answers by where they came from, over every user,
    beside the mean of the systems without a cache (stock llama.cpp, naive) on the same
    questions."""
    by_source: dict[str, list[float]] = {}
    baselines: dict[str, list[float]] = {}
    for records in result["queries"].values():
        for record in records.get("percache", []):
            by_source.setdefault(record["source"], []).append(record["ttft_s"])
        for name in ("stock", "naive"):
            baselines.setdefault(name, []).extend(r["ttft_s"] for r in records.get(name, []))
    if not by_source:
        return []
    figure, axis = plt.subplots(figsize=(7, 4))
    labels = [f"PerCache: {source}\n({len(values)} answers)" for source, values in by_source.items()]
    axis.bar(labels, [sum(v) / len(v) for v in by_source.values()], color="tab:green")
    colours = {"stock": "tab:blue", "naive": "tab:orange"}
    for name, values in baselines.items():
        if values:
            axis.axhline(sum(values) / len(values), color=colours[name], linestyle="--", label=f"{name} (mean)")
    axis.set(ylabel="mean time to first token (s)", title="Time to first token by answer source")
    if any(baselines.values()):  # a run of PerCache alone has no baseline line to name
        axis.legend(fontsize=7)
    axis.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    path = folder / "ttft_by_source.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return [path]


def write_report(result: dict[str, Any], out: Path) -> list[Path]:
    """JSON, Markdown and PNGs into *out*'s folder; returns the files written."""
    write_json(result, out)
    table = out.with_suffix(".md")
    table.write_text(markdown_table(result) + "\n")
    written = [out, table]
    try:
        written += plot(result, out.parent / "plots")
    except ImportError:
        pass  # matplotlib is optional: pip install "percache-core[bench]"
    return written
