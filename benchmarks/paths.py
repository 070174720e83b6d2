"""Paths that pay: how much of each real question's chunk tokens a stored prefix covers, per
knowledge-prefill policy and chunk-state budget.

Retrieval only (the cache's own hybrid retrieval with the real embedder, each question in
its scope, ``top_k`` chunks in rank order); no LLM decode. Token counts are the bundled
model's (each chunk segment tokenized as the prompt layout does), and the bytes a state
costs per token and the prefill speed are measured on the loaded model at start. For each
user, questions are taken in order; before each, idle time fills the chunk-state tree by
the policy up to the prefill share of the budget (80%, as the knowledge prefill does); the
question's longest stored prefix is restored (its coverage: the share of its chunk tokens
inside it; "whole": every chunk); then its own path is kept, evicting least frequently used
leaves down to the budget, as the runner does. States are slices: a node costs its own
segment's tokens.

Policies:

- ``none``: only the paths questions ran before;
- ``singles``: [chunk] for every chunk (chunks of recent questions first, then the latest
  question's scope, then the rest), the knowledge prefill without pairs;
- ``neighbours-N``: singles, then [chunk, neighbour] for each chunk's N nearest neighbours
  (``KnowledgeBank.neighbours``: what retrieval ranks next when the chunk's own text is the
  question, within the question's scope fields), nearest first (the default is N=2);
- ``co-retrieved+neighbours-N``: as ``neighbours-N``, with the pairs of chunks earlier
  questions retrieved together (each ordered pair of a question's chunks) first;
- ``all-pairs``: singles, then every ordered pair inside a scope (the pairs ceiling);
- ``demand``: the paths the idle round's demand estimate names
  (:mod:`percache_core.prediction.demand`, the same code), likeliest first, evicting stored
  paths it finds less likely to make room (``prediction.paths.make_room``);
- ``scheduler``: what an idle round does (``prediction.scheduler``): ``demand`` first
  (evicting only where the bulk prefill's first pass, every [chunk], does not fit the
  budget), then ``neighbours-8`` where it fits;
- ``oracle``: the next question's own path (what a perfect estimate would prefill).

``--merged`` takes every QMSum meeting as ONE user's knowledge (4,517 chunks) and asks it
as a person moves between topics (``--per-series`` questions of one meeting series, then
the next series), with ``--idle-seconds`` of idle prefill before each question (tokens at
the measured prefill speed; the policies above, unlimited idle, otherwise). Its rows give
the coverage per GiB and per idle minute, and the demand estimate's hit rate (the share of
each next question's chunks among the estimate's top 50 chunks; the oracle's is 1).

Writes JSON (``--out``) with, per policy and budget, the mean coverage and whole-path share
per data set, states and bytes stored, and the idle prefill it costs (tokens, seconds at the
measured speed); ``--compare`` also sets the per-question depth beside an e2e run's
(``prefix_overlap`` of ``benchmarks.e2e``'s JSON) for the same users and questions.

    .venv/bin/python -m benchmarks.paths --data ../shared/data
    .venv/bin/python -m benchmarks.paths --data ../shared/data --merged --budgets-gib 1 2 4 8 \
        --idle-seconds 10 20 60 --policies neighbours-8 demand oracle
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path as FolderPath
from typing import Any

from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.kv.budget import PREFILL_BUDGET_SHARE, prefill_state_bytes, sized_state_budget
from percache_core.models import resolve_model_path
from percache_core.prediction.demand import DemandEstimate, Knowledge
from percache_core.serving.activity import AskedQuestion
from percache_core.serving.prompting import chunk_text

from .data_sets import (
    SCOPE_FIELDS,
    add_user_arguments,
    default_data_folder,
    load_merged_user,
    query_scope,
    users_from_arguments,
)
from .output import write_json

GIB = 1024**3
BUDGETS_GIB = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
POLICIES = (
    "none",
    "singles",
    "neighbours-1",
    "neighbours-2",
    "neighbours-4",
    "neighbours-8",
    "co-retrieved+neighbours-2",
    "co-retrieved+neighbours-4",
    "all-pairs",
    "demand",
    "scheduler",
    "oracle",
)
MAX_NEIGHBOURS = 8

Path = tuple[str, ...]


@dataclass
class UserPaths:
    """What the simulation needs of one user: chunk token counts and scopes, each chunk's
    neighbours, and each question's retrieved path and scope, in order."""

    name: str
    dataset: str
    tokens: dict[str, int]
    scopes: dict[str, tuple]
    order: list[str]
    neighbours: dict[str, list[str]]
    questions: list[Path]
    question_scopes: list[tuple]
    asked: list[AskedQuestion] = field(default_factory=list)  # what the demand estimate learns from


@dataclass
class _Node:
    hits: int = 0
    last_used: int = 0


@dataclass
class SimulatedTree:
    """Stored paths of chunk ids (the system prompt's state is always there and not
    counted), each costing its last segment's tokens x bytes per token, evicted least
    frequently used leaves first, as the state store does."""

    budget_bytes: float
    bytes_per_token: float
    tokens: dict[str, int]
    nodes: dict[Path, _Node] = field(default_factory=dict)
    bytes: float = 0.0
    clock: int = 0

    def cost(self, path: Path) -> float:
        return self.tokens[path[-1]] * self.bytes_per_token

    def add(self, path: Path) -> int:
        """Store *path* and its missing prefixes; the tokens that had to be prefilled."""
        prefilled = 0
        for depth in range(1, len(path) + 1):
            prefix = path[:depth]
            if prefix not in self.nodes:
                self.clock += 1
                self.nodes[prefix] = _Node(last_used=self.clock)
                self.bytes += self.cost(prefix)
                prefilled += self.tokens[prefix[-1]]
        return prefilled

    def restore(self, path: Path) -> int:
        """The depth of the longest stored prefix of *path* (its nodes counted as used)."""
        depth = 0
        while depth < len(path) and path[: depth + 1] in self.nodes:
            depth += 1
            self.clock += 1
            node = self.nodes[path[:depth]]
            node.hits += 1
            node.last_used = self.clock
        return depth

    def make_room(self, limit: float, estimate: dict[Path, float], probability: float) -> bool:
        """Evict leaves whose *estimate* is below *probability* (ties: fewest hits, least
        recently used) until the tree is under *limit*, as ``prediction.paths.make_room``."""
        parents = {p[:-1] for p in self.nodes if len(p) > 1}
        ranked = sorted(
            (p for p in self.nodes if p not in parents and estimate.get(p, 0.0) < probability),
            key=lambda p: (estimate.get(p, 0.0), self.nodes[p].hits, self.nodes[p].last_used),
        )
        for victim in ranked:
            if self.bytes < limit:
                break
            del self.nodes[victim]
            self.bytes -= self.cost(victim)
        return self.bytes < limit

    def evict_to_budget(self, protected: Path) -> int:
        """Evict least used leaves (never a prefix of *protected*) down to the budget."""
        keep = {protected[:d] for d in range(1, len(protected) + 1)}
        evicted = 0
        while self.bytes > self.budget_bytes:
            parents = {p[:-1] for p in self.nodes if len(p) > 1}
            leaves = [p for p in self.nodes if p not in parents and p not in keep]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: (self.nodes[p].hits, self.nodes[p].last_used, p))
            del self.nodes[victim]
            self.bytes -= self.cost(victim)
            evicted += 1
        return evicted


def policy_paths(policy: str, user: UserPaths, asked: list[Path], scope: tuple) -> Iterator[Path]:
    """The paths *policy* prefills, in its order, given the questions *asked* so far and
    the latest question's *scope* (as ``prediction.paths.knowledge_prefill_paths``)."""
    if policy == "none":
        return
    ordered: dict[str, None] = {}
    for path in reversed(asked):
        ordered.update((c, None) for c in path if c not in ordered)
    for chunk in user.order:
        if scope and user.scopes[chunk] == scope:
            ordered.setdefault(chunk, None)
    for chunk in user.order:
        ordered.setdefault(chunk, None)
    for chunk in ordered:
        yield (chunk,)
    if policy.startswith("co-retrieved"):
        for path in reversed(asked):
            for first in path:
                for second in path:
                    if first != second:
                        yield (first, second)
    if policy == "all-pairs":
        for chunk in ordered:
            for other in user.order:
                if other != chunk and user.scopes[other] == user.scopes[chunk]:
                    yield (chunk, other)
        return
    if "neighbours-" in policy:
        count = int(policy.rsplit("-", 1)[1])
        for rank in range(count):
            for chunk in ordered:
                near = user.neighbours[chunk]
                if rank < len(near):
                    yield (chunk, near[rank])


def simulate(
    policy: str,
    user: UserPaths,
    budget_bytes: float,
    bytes_per_token: float,
    *,
    idle_tokens_per_question: float | None = None,
    knowledge: Knowledge | None = None,
) -> dict[str, Any]:
    """One user's questions under *policy* and *budget_bytes* (see the module docstring),
    with at most *idle_tokens_per_question* of idle prefill before each question (None:
    unlimited). ``demand`` needs the user's *knowledge* (retrieval for its estimate)."""
    tree = SimulatedTree(budget_bytes, bytes_per_token, user.tokens)
    limit = PREFILL_BUDGET_SHARE * budget_bytes
    # as the runtime decides it: does the bulk prefill's first pass (every [chunk]) fit?
    fits = prefill_state_bytes(sum(user.tokens.values()), bytes_per_token=bytes_per_token,
                               neighbours=0, slices=True) <= limit
    idle_tokens = 0
    rows = []
    asked: list[Path] = []
    estimate = DemandEstimate()

    def room_left(spent: float, cost: float) -> bool:
        return idle_tokens_per_question is None or spent + cost <= idle_tokens_per_question

    for index, (path, scope) in enumerate(zip(user.questions, user.question_scopes)):
        spent = 0
        if policy in ("demand", "oracle", "scheduler"):
            if policy == "oracle":
                probabilities = {path[:d]: 1.0 for d in range(1, len(path) + 1)}
            else:
                assert knowledge is not None, f"the {policy} policy needs the knowledge"
                probabilities = estimate.probabilities(knowledge, limit=4096) if estimate.asked else {}
            evict = policy != "scheduler" or not fits  # the scheduler evicts only where the bulk does not fit
            for candidate, probability in probabilities.items():
                if candidate in tree.nodes or candidate[:-1] not in tree.nodes and len(candidate) > 1:
                    continue
                if not room_left(spent, user.tokens[candidate[-1]]):
                    break
                if not tree.make_room(limit, probabilities, probability if evict else 0.0):
                    break
                spent += tree.add(candidate)
        if policy not in ("demand", "oracle") and (policy != "scheduler" or fits):
            bulk = "neighbours-8" if policy == "scheduler" else policy
            for candidate in policy_paths(bulk, user, asked, scope):  # idle time before the question
                if tree.bytes >= limit:
                    break
                missing = sum(user.tokens[candidate[d - 1]] for d in range(1, len(candidate) + 1)
                              if candidate[:d] not in tree.nodes)
                if not room_left(spent, missing):
                    break
                spent += tree.add(candidate)
        idle_tokens += spent
        depth = tree.restore(path)
        total = sum(user.tokens[c] for c in path)
        rows.append(
            {
                "depth": depth,
                "chunks": len(path),
                "coverage": sum(user.tokens[c] for c in path[:depth]) / max(1, total),
                "whole": depth == len(path),
            }
        )
        tree.add(path)  # the question's own run keeps its states
        tree.evict_to_budget(path)
        asked.append(path)
        if policy in ("demand", "scheduler") and knowledge is not None:
            estimate.observe(user.asked[index], knowledge)
    return {
        "coverage": statistics.fmean(r["coverage"] for r in rows),
        "whole_path": statistics.fmean(r["whole"] for r in rows),
        "prefix_overlap": statistics.fmean(r["depth"] / r["chunks"] for r in rows),
        "states": len(tree.nodes),
        "bytes": tree.bytes,
        "idle_prefill_tokens": idle_tokens,
        "budget_bytes": budget_bytes,
        "depths": [r["depth"] for r in rows],
        "hit_rate": estimate.hit_rate.as_dict() if policy in ("demand", "scheduler") else None,
    }


def sized_budget(user: UserPaths, policy: str, bytes_per_token: float, free_disk: int) -> int:
    """The budget ``chunk_state_budget_bytes=None`` gives *user*'s knowledge
    (:mod:`percache_core.kv.budget`) with *policy*'s neighbour count."""
    neighbours = int(policy.rsplit("-", 1)[1]) if "neighbours-" in policy else 0
    neighbours = MAX_NEIGHBOURS if policy == "scheduler" else neighbours  # the default's sizing
    needed = prefill_state_bytes(
        sum(user.tokens.values()), bytes_per_token=bytes_per_token, neighbours=neighbours, slices=True
    )
    return sized_state_budget(needed_bytes=needed, free_disk_bytes=free_disk)


def measure_model(engine: LlamaEngine) -> tuple[float, float]:
    """(bytes a state slice costs per token, prefill tokens per second) of *engine*."""
    tokens = engine.tokenize("The meeting moved the budget review to Friday. " * 40, True)[:512]
    engine.reset()
    engine.eval(tokens[:256])
    start = engine.n_past
    engine.eval(tokens[256:])
    per_token = len(engine.save_slice(start)) / (engine.n_past - start)
    engine.reset()
    started = time.perf_counter()
    engine.eval(tokens)
    speed = len(tokens) / (time.perf_counter() - started)
    engine.reset()
    return per_token, speed


def user_paths(user: Any, pc: PerCache, engine: LlamaEngine, top_k: int) -> UserPaths:
    """Retrieve each of *user*'s questions and count each chunk's prompt tokens."""
    pc.add_documents(user.documents, split=False, progress=len(user.documents) > 1000)
    chunks = internals(pc).knowledge.chunks
    asked = []
    for query in user.queries:
        embedding = internals(pc).parts.embed_question(query["question"])
        found = internals(pc).knowledge.retrieve(query["question"], top_k, question_embedding=embedding, where=query_scope(query))
        asked.append(AskedQuestion(query["question"], embedding, query_scope(query), tuple(r.chunk.id for r in found)))
    return UserPaths(
        name=user.name,
        dataset=user.dataset,
        tokens={c.id: len(engine.tokenize(chunk_text(c))) for c in chunks},
        scopes={c.id: tuple(c.metadata.get(f) for f in SCOPE_FIELDS) for c in chunks},
        order=[c.id for c in chunks],
        neighbours={
            c.id: [n.id for n in internals(pc).knowledge.neighbours(c, MAX_NEIGHBOURS, scope_fields=SCOPE_FIELDS)]
            for c in chunks
        },
        questions=[question.chunk_ids for question in asked],
        question_scopes=[tuple((query_scope(q) or {}).get(f) for f in SCOPE_FIELDS) for q in user.queries],
        asked=asked,
    )


def compare_with_e2e(users: list[UserPaths], e2e_path: str, bytes_per_token: float) -> list[dict[str, Any]]:
    """Per question, the simulated depth (the e2e run's policy and budget) beside the e2e run's
    (``prefix_overlap`` x chunks) for the users both have, and whether the paths agree."""
    recorded = json.loads(open(e2e_path, encoding="utf-8").read())["queries"]
    rows = []
    for user in users:
        queries = recorded.get(f"{user.dataset}/{user.name}", {}).get("percache")
        if not queries:
            continue
        # the e2e run's settings: two neighbours, 1 GiB
        simulated = simulate("neighbours-2", user, GIB, bytes_per_token)["depths"]
        for query, path, depth in zip(queries, user.questions, simulated):
            rows.append(
                {
                    "user": f"{user.dataset}/{user.name}",
                    "same_path": list(path) == query["chunk_ids"],
                    "simulated_depth": depth,
                    "e2e_depth": round(query["prefix_overlap"] * len(query["chunk_ids"])),
                }
            )
    return rows


def summary_row(
    policy: str,
    gib: float | str,
    idle_s: float | None,
    per_user: dict[str, dict[str, Any]],
    users: list[UserPaths],
    prefill_speed: float,
) -> dict[str, Any]:
    """One policy, budget and idle time: per data set, the means over its users, with the
    coverage per GiB stored and per idle minute spent."""
    row: dict[str, Any] = {"policy": policy, "budget_gib": gib, "idle_seconds_per_question": idle_s}
    for dataset in sorted({u.dataset for u in users}):
        runs = [r for name, r in per_user.items() if name.startswith(dataset + "/")]
        coverage = statistics.fmean(r["coverage"] for r in runs)
        gib_stored = statistics.fmean(r["bytes"] for r in runs) / GIB
        idle_minutes = statistics.fmean(r["idle_prefill_tokens"] for r in runs) / prefill_speed / 60
        hits = [r["hit_rate"]["chunk_hit_rate"] for r in runs if r["hit_rate"] and r["hit_rate"]["chunk_hit_rate"] is not None]
        row[dataset] = {
            "coverage": coverage,
            "whole_path": statistics.fmean(r["whole_path"] for r in runs),
            "prefix_overlap": statistics.fmean(r["prefix_overlap"] for r in runs),
            "states_per_user": statistics.fmean(r["states"] for r in runs),
            "gib_per_user": gib_stored,
            "budget_gib_per_user": statistics.fmean(r["budget_bytes"] for r in runs) / GIB,
            "idle_prefill_tokens_per_user": statistics.fmean(r["idle_prefill_tokens"] for r in runs),
            "idle_prefill_s_per_user": idle_minutes * 60,
            "coverage_per_gib": coverage / gib_stored if gib_stored else None,
            "coverage_per_idle_minute": coverage / idle_minutes if idle_minutes else None,
            "chunk_hit_rate": statistics.fmean(hits) if hits else None,
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_user_arguments(parser, qmsum_users=5, squad_users=2, queries=12)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--budgets-gib", nargs="+", type=float, default=list(BUDGETS_GIB))
    parser.add_argument("--merged", action="store_true", help="every QMSum meeting as one user's knowledge")
    parser.add_argument("--series", type=int, default=15, help="--merged: meeting series asked, in turn")
    parser.add_argument("--per-series", type=int, default=4, help="--merged: questions per series")
    parser.add_argument("--consecutive", action="store_true", help="--merged: questions in a row per series")
    parser.add_argument(
        "--idle-seconds", nargs="+", type=float, default=[], help="idle prefill before each question (default: unlimited)"
    )
    parser.add_argument("--compare", help="an e2e JSON (benchmarks.e2e --out) to set the default policy beside")
    parser.add_argument("--out", default="benchmarks/results/paths.json")
    args = parser.parse_args(argv)
    engine = LlamaEngine(resolve_model_path(None))
    bytes_per_token, prefill_speed = measure_model(engine)
    print(f"{bytes_per_token:,.0f} bytes per token, prefill {prefill_speed:,.0f} tokens/s", flush=True)
    embedder = BertEmbedder()
    config = PerCacheConfig(chunk_states=False, qa_bank=False, prediction=False, top_k=args.top_k)
    if args.merged:
        data = FolderPath(args.data) if args.data else default_data_folder()
        picked = [
            load_merged_user(
                data, "qmsum", series=args.series, per_series=args.per_series, seed=args.seed,
                consecutive=args.consecutive,
            )
        ]
    else:
        picked = users_from_arguments(args)
    users: list[UserPaths] = []
    knowledges: dict[str, Knowledge] = {}
    with ExitStack() as stack:
        for user in picked:
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            pc = stack.enter_context(PerCache.open(folder, config=config, embedder=embedder))
            users.append(user_paths(user, pc, engine, args.top_k))
            knowledges[f"{user.dataset}/{user.name}"] = internals(pc).knowledge
            print(f"{user.dataset}/{user.name}: {len(users[-1].order)} chunks", flush=True)
        free_disk = shutil.disk_usage(tempfile.gettempdir()).free
        results = []
        for policy in args.policies:
            for idle_s in args.idle_seconds or [None]:
                idle_tokens = None if idle_s is None else idle_s * prefill_speed
                for gib in [*args.budgets_gib, *([] if args.merged else ["sized"])]:
                    per_user = {
                        f"{u.dataset}/{u.name}": simulate(
                            policy,
                            u,
                            sized_budget(u, policy, bytes_per_token, free_disk) if gib == "sized" else gib * GIB,
                            bytes_per_token,
                            idle_tokens_per_question=idle_tokens,
                            knowledge=knowledges[f"{u.dataset}/{u.name}"],
                        )
                        for u in users
                    }
                    row = summary_row(policy, gib, idle_s, per_user, users, prefill_speed)
                    results.append(row)
                    print(
                        f"{policy:28s} {gib:>5} GiB  idle {idle_s or 'unlimited'} s  "
                        + "  ".join(
                            f"{d}: cov {row[d]['coverage']:.3f} whole {row[d]['whole_path']:.3f} "
                            f"{row[d]['gib_per_user']:.2f} GiB hit {row[d]['chunk_hit_rate'] or 0:.2f}"
                            for d in row if isinstance(row[d], dict)
                        ),
                        flush=True,
                    )
    result: dict[str, Any] = {
        "benchmark": "paths",
        "settings": {
            "top_k": args.top_k,
            "queries_per_user": args.queries_per_user,
            "seed": args.seed,
            "merged": args.merged,
            "series": args.series if args.merged else None,
            "per_series": args.per_series if args.merged else None,
            "consecutive": args.consecutive,
            "idle_seconds": args.idle_seconds,
        },
        "bytes_per_token": bytes_per_token,
        "prefill_tokens_per_s": prefill_speed,
        "users": {f"{u.dataset}/{u.name}": {"chunks": len(u.order), "tokens": sum(u.tokens.values())} for u in users},
        "results": results,
    }
    if args.compare:
        rows = compare_with_e2e(users, args.compare, bytes_per_token)
        same = [r for r in rows if r["same_path"]]
        result["e2e_agreement"] = {
            "questions": len(rows),
            "same_path": len(same),
            "same_depth": sum(r["simulated_depth"] == r["e2e_depth"] for r in same),
            "rows": rows,
        }
        print(f"e2e agreement: {result['e2e_agreement']['same_depth']} of {len(same)} same-path questions", flush=True)
    engine.close()
    print(f"written to {write_json(result, args.out)}")
    for path in plot_coverage(result, FolderPath(args.out).parent / "plots"):
        print(f"written to {path}")
    return 0


def plot_coverage(result: dict[str, Any], folder: FolderPath) -> list[FolderPath]:
    """PNG figures beside the JSON: mean coverage per chunk-state budget (GiB per user) for
    each policy and data set, and, with ``--idle-seconds``, per idle minute before each
    question. Needs matplotlib (``pip install "percache-core[bench]"``); none without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for r in result["results"] if r["budget_gib"] != "sized"]
    sets = sorted({d for r in rows for d in r if isinstance(r[d], dict)})
    written = []
    for axis_name, key, label in (
        ("gib", "budget_gib", "chunk-state budget (GiB per user)"),
        ("idle_minute", "idle_seconds_per_question", "idle time before each question (minutes)"),
    ):
        chosen = [r for r in rows if r.get(key) is not None]
        if len({r[key] for r in chosen}) < 2:
            continue
        figure, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
        for axis, dataset in zip(axes[0], sets):
            for policy in dict.fromkeys(r["policy"] for r in chosen):
                points = sorted((float(r[key]), r[dataset]["coverage"]) for r in chosen if r["policy"] == policy)
                xs = [x / 60 if axis_name == "idle_minute" else x for x, _ in points]
                axis.plot(xs, [y for _, y in points], marker="o", label=policy)
            axis.set(xlabel=label, ylabel="coverage of a question's chunk tokens", title=dataset, ylim=(0, 1))
            axis.legend(fontsize=7)
        figure.tight_layout()
        path = folder / f"coverage_per_{axis_name}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


if __name__ == "__main__":
    raise SystemExit(main())
