"""Reading evaluation data: ``documents.jsonl`` + ``queries.jsonl`` per set (see
``../shared/data/README.md``), grouped by user, with queries sampled by a fixed seed and
kept in their original order."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SCOPE_FIELDS = ("meeting_id",)  # query fields that name the part of the knowledge asked about


@dataclass
class User:
    dataset: str
    name: str
    documents: list[dict]
    queries: list[dict]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def default_data_folder() -> Path:
    """``../shared/data`` beside the checkout, when present; else ``./data``."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "data"
    return beside if beside.is_dir() else Path("data")


def read_data_set(data: Path, dataset: str) -> tuple[list[dict], dict[str, list[dict]]]:
    """*dataset*'s documents, and its queries grouped by user in their original order."""
    folder = data / dataset
    if not (folder / "documents.jsonl").is_file() or not (folder / "queries.jsonl").is_file():
        raise SystemExit(f"{folder} has no documents.jsonl and queries.jsonl: pass --data")
    by_user: dict[str, list[dict]] = {}
    for query in read_jsonl(folder / "queries.jsonl"):
        by_user.setdefault(query["user"], []).append(query)
    return read_jsonl(folder / "documents.jsonl"), by_user


def load_users(data: Path, dataset: str, *, users: int, queries_per_user: int, seed: int) -> list[User]:
    """The first *users* users of *dataset* (fewest queries first, then by name), each with
    *queries_per_user* queries sampled with *seed* and kept in their original order.
    Documents keep the scope fields (:data:`SCOPE_FIELDS`) as chunk metadata."""
    documents, by_user = read_data_set(data, dataset)
    names = sorted(by_user, key=lambda name: (len(by_user[name]), name))[:users]
    chosen = []
    for name in names:
        user_queries = by_user[name]
        picked = sorted(
            random.Random(f"{seed}:{name}").sample(
                range(len(user_queries)), min(queries_per_user, len(user_queries))
            )
        )
        chosen.append(
            User(
                dataset,
                name,
                [
                    {
                        "id": d["doc_id"],
                        "text": d["text"],
                        "metadata": {f: d[f] for f in SCOPE_FIELDS if f in d},
                    }
                    for d in documents
                    if d["user"] == name
                ],
                [user_queries[i] for i in picked],
            )
        )
    return chosen


def load_merged_user(
    data: Path, dataset: str, *, series: int, per_series: int, seed: int, consecutive: bool = False
) -> User:
    """Every document of *dataset* as ONE user's knowledge (a whole archive: QMSum's 4,517
    chunks), asked as a person moves between topics: *per_series* questions of one
    original user (a meeting series), sampled with *seed* and kept in their order (with
    *consecutive*, a run of that many questions in a row from a seeded start: mostly about
    one meeting), then the next series, for *series* series in an order shuffled by *seed*."""
    documents, by_user = read_data_set(data, dataset)
    names = sorted(by_user)
    random.Random(seed).shuffle(names)
    asked = []
    for name in names[:series]:
        count, chooser = len(by_user[name]), random.Random(f"{seed}:{name}")
        if consecutive:
            start = chooser.randrange(max(1, count - per_series + 1))
            picked = list(range(start, min(count, start + per_series)))
        else:
            picked = sorted(chooser.sample(range(count), min(per_series, count)))
        asked += [by_user[name][i] for i in picked]
    knowledge = [
        {"id": d["doc_id"], "text": d["text"], "metadata": {f: d[f] for f in SCOPE_FIELDS if f in d}}
        for d in documents
    ]
    return User(dataset, "merged", knowledge, asked)


def query_scope(query: dict) -> dict | None:
    """The scope a query is asked in (e.g. QMSum's ``meeting_id``: "Summarize the meeting"
    means that meeting), or None.

    >>> query_scope({"question": "Summarize the meeting", "meeting_id": "Bed003"})
    {'meeting_id': 'Bed003'}
    """
    scope = {f: query[f] for f in SCOPE_FIELDS if query.get(f)}
    return scope or None


def add_user_arguments(
    parser: argparse.ArgumentParser, *, qmsum_users: int, squad_users: int, queries: int
) -> None:
    """The options that pick the users of a benchmark: --data, --qmsum-users,
    --squad-users, --queries-per-user, --seed (with these defaults) and --users."""
    parser.add_argument(
        "--data",
        help="folder with <set>/documents.jsonl and queries.jsonl (default ../shared/data)",
    )
    parser.add_argument("--qmsum-users", type=int, default=qmsum_users)
    parser.add_argument("--squad-users", type=int, default=squad_users)
    parser.add_argument("--queries-per-user", type=int, default=queries)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--users", help="comma-separated names: only these of the users picked")


def users_from_arguments(args: argparse.Namespace) -> list[User]:
    """The QMSum users, then the SQuAD users, that :func:`add_user_arguments` options pick."""
    data = Path(args.data) if args.data else default_data_folder()
    picked = {"qmsum": args.qmsum_users, "squad11-dev": args.squad_users}
    names = set(args.users.split(",")) if getattr(args, "users", None) else None
    users = [
        user
        for dataset, count in picked.items()
        if count
        for user in load_users(
            data, dataset, users=count, queries_per_user=args.queries_per_user, seed=args.seed
        )
        if names is None or user.name in names
    ]
    missing = (names or set()) - {user.name for user in users}
    if missing:
        raise SystemExit(f"--users: not among the users picked: {', '.join(sorted(missing))}")
    return users
