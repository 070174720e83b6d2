"""The rows of the results table: one per thing a user runs, each read from a benchmark's
JSON under ``benchmarks/results/`` (:data:`ROWS`), with the command that measured it and a
small version of that command for ``benchmarks.report --quick``.

A row's figure is PerCache's time over the time of what the user runs instead (below 1:
faster), measured side by side per prompt with the order alternating; "same answer" counts
the answers equal to the fresh text of that other system (or, for the exactness sweep, the
(prompt, restored state) pairs equal to a fresh prefill's text)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Measured:
    """What one row shows: *ratio* (PerCache's time over the other side's; None where the
    row is not a timing), *figure* (the table's words for it), *same* (answers identical,
    as "n/m"), *scale* (how much was asked), and the mean seconds per question of each side
    (for the figure; None where the row has none)."""

    ratio: float | None
    figure: str
    same: str
    scale: str
    before_s: float | None = None
    after_s: float | None = None


@dataclass(frozen=True)
class Row:
    """One thing a user runs: what it is, what it is compared with, the result file it is
    read from, how to read it, the command that wrote it and the quick command's arguments
    (``python -m`` *module* and *quick*, writing to the same file)."""

    what: str
    against: str
    result: str
    read: Callable[[dict[str, Any]], Measured]
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...]

    def command(self, arguments: tuple[str, ...], folder: str = "benchmarks/results") -> list[str]:
        """``python -m`` arguments for *arguments* (:attr:`full` or :attr:`quick`), writing
        this row's result file into *folder*."""
        return ["-m", self.module, *arguments, "--out", f"{folder}/{self.result}"]


def times(ratio: float) -> str:
    """A ratio as the table writes it.

    >>> times(0.5434), times(1.0031)
    ('**0.54x** the time', '**1.00x** the time')
    """
    return f"**{ratio:.2f}x** the time"


def counted(count: int, noun: str) -> str:
    """*count* of *noun*, in the plural where it is not 1.

    >>> counted(1, "prompt"), counted(3, "prompt")
    ('1 prompt', '3 prompts')
    """
    return f"{count} {noun}{'' if count == 1 else 's'}"


def asked(users: int, questions: int) -> str:
    """How much a row asked.

    >>> asked(1, 3), asked(7, 42)
    ('1 user x 3 questions', '7 users x 6 questions')
    """
    return f"{counted(users, 'user')} x {counted(questions // users, 'question')}"


def first_model_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``benchmarks.endpoint``'s rows for its first model (the one the table shows)."""
    return next(iter(result["models"].values()))


def _apps(result: dict[str, Any]) -> Measured:
    """``benchmarks.apps``: every user's questions, both sides' mean time per question."""
    summary, users = result["summary"], result["per_user"]
    questions = sum(u["questions"] for u in users)
    before = sum(u["before_mean_s"] * u["questions"] for u in users) / questions
    after = sum(u["after_mean_s"] * u["questions"] for u in users) / questions
    first = summary.get("sessions", {}).get("first")
    figure = times(summary["ratio"])
    if first and len(users) > 1:
        figure += f" (a new user's first session {first['ratio']:.2f}x)"
    return Measured(summary["ratio"], figure, f"{summary['identical']}/{summary['questions']}",
                    asked(len(users), questions), before, after)


def _e2e(result: dict[str, Any]) -> Measured:
    """``benchmarks.e2e``: PerCache's pipeline against stock ``llama_cpp.Llama`` with the
    same retrieval and prompts; "same" against the pipeline without a cache (naive)."""
    users = result["per_user"]
    mean = {name: sum(u[name]["latency_s"]["mean"] for u in users.values()) / len(users) for name in ("stock", "percache")}
    questions = {user: len(result["queries"][user]["percache"]) for user in users}
    same = sum(round(users[user]["percache"]["identical_to_naive"] * n) for user, n in questions.items())
    total = sum(questions.values())
    ratio = mean["percache"] / mean["stock"]
    return Measured(ratio, times(ratio), f"{same}/{total}", asked(len(users), total),
                    mean["stock"], mean["percache"])


def _endpoint(workload: str) -> Callable[[dict[str, Any]], Measured]:
    """``benchmarks.endpoint``: one workload's row (the first model's)."""

    def read(result: dict[str, Any]) -> Measured:
        row = next(r for r in first_model_rows(result) if r["workload"] == workload)
        figure = times(row["ratio"])
        if workload == "restart":
            figure += f", first piece {row['ttft_ratio']:.2f}x"
        prompts = row["prompts"]
        return Measured(row["ratio"], figure, f"{row['percache_identical_to_fresh']:g}/{prompts}",
                        counted(prompts, "prompt"), row["server_alone_s"] / prompts, row["percache_s"] / prompts)

    return read


def clients_at_once(result: dict[str, Any]) -> Measured:
    """``benchmarks.endpoint --workloads load``: wall time of several clients at once."""
    rows = [r for r in first_model_rows(result) if r["workload"] == "load"]
    several = [r for r in rows if r["clients"] > 1]
    one = next((r for r in rows if r["clients"] == 1), None)
    figure = ", ".join(f"{r['clients']} client{'s' * (r['clients'] > 1)} **{r['ratio']:.2f}x**" for r in rows) + " the wall time"
    errors = sum(r["percache_errors"] for r in rows)
    compared = one["requests"] * one.get("rounds", 1) if one else 0
    same = f"{one['percache_identical_to_fresh']}/{compared} (one client)" if one else "not compared"
    if one and "percache_identical_to_launch_fresh" in one:  # a batch-invariant launch: its own fresh text
        same = f"{one['percache_identical_to_launch_fresh']}/{compared} (one client, that launch's fresh text)"
    scale = f"{several[0]['requests'] // several[0]['clients']} requests per client, {errors} errors" if several else ""
    return Measured(several[-1]["ratio"] if several else None, figure, same, scale)


def _cold_start(result: dict[str, Any]) -> Measured:
    """``benchmarks.cold_start``: ``percache ask`` in a new process against stock starting
    and answering in one."""
    summary, rows = result["summary"], result["rows"]
    first, again = summary["percache ask (first)"], summary["percache ask (again)"]
    same = sum(r["percache ask (first)"]["text"] == r["stock"]["text"] for r in rows)
    figure = f"first ask **{first['ratio_of_means']:.2f}x**, asked again **{again['ratio_of_means']:.2f}x** the time"
    return Measured(first["ratio_of_means"], figure, f"{same}/{len(rows)}", counted(len(rows), "question"),
                    summary["stock"]["mean_wall_s"], first["mean_wall_s"])


def _sweep(result: dict[str, Any]) -> Measured:
    """``benchmarks.exactness_sweep``: (prompt, restored state) pairs against a fresh prefill."""
    models = result.get("models") or [result]
    names = ", ".join(dict.fromkeys(m["model"].split(".")[0] for m in models))  # each model once
    same = f"{result['pairs'] - result['differed']}/{result['pairs']}"
    return Measured(None, f"**{result['differed']} differed** of {result['pairs']} restores", same, names)


DATA = ("--data", "../shared/data")
STARTER = ("--apps", "llamaindex_starter", "--idle-seconds", "30")
TUTORIAL = ("--apps", "langchain_tutorial", "--idle-seconds", "30")
LCEL = ("--apps", "langchain", "--idle-seconds", "30")
ENDPOINT = ("--models", "bundled", "--workloads", "first asks,chat turns,restart,load")

ROWS: tuple[Row, ...] = (
    Row("your own RAG pipeline (`PerCache.answer`)", "the same retrieval and prompt on stock `llama_cpp.Llama`",
        "e2e.json", _e2e, "benchmarks.e2e",
        (*DATA, "--qmsum-users", "1", "--squad-users", "1", "--queries-per-user", "6", "--systems", "stock,naive,percache"),
        (*DATA, "--qmsum-users", "0", "--squad-users", "1", "--queries-per-user", "2", "--systems", "stock,naive,percache")),
    Row("LlamaIndex's starter app, swapped", "the same app on stock llama.cpp", "apps_starter.json", _apps,
        "benchmarks.apps", (*DATA, "--qmsum-users", "5", "--squad-users", "2", "--queries-per-user", "6", *STARTER),
        (*DATA, "--qmsum-users", "1", "--squad-users", "0", "--queries-per-user", "3", *STARTER)),
    Row("LangChain's RAG tutorial app, swapped", "the same app on stock llama.cpp", "apps_tutorial.json", _apps,
        "benchmarks.apps", (*DATA, "--qmsum-users", "1", "--squad-users", "1", "--queries-per-user", "6", *TUTORIAL),
        (*DATA, "--qmsum-users", "0", "--squad-users", "1", "--queries-per-user", "3", *TUTORIAL)),
    Row("a LangChain LCEL app, swapped", "the same app on stock llama.cpp", "apps_lcel.json", _apps,
        "benchmarks.apps", (*DATA, "--qmsum-users", "1", "--squad-users", "1", "--queries-per-user", "6", *LCEL),
        (*DATA, "--qmsum-users", "0", "--squad-users", "1", "--queries-per-user", "3", *LCEL)),
    Row("`percache serve`, one client's new chats", "the llama-server alone", "endpoint.json",
        _endpoint("first asks"), "benchmarks.endpoint", (*DATA, *ENDPOINT, "--requests", "4"),
        (*DATA, *ENDPOINT, "--turns", "2", "--restarts", "1", "--requests", "2")),
    Row("`percache serve`, a chat's next turns", "the llama-server alone", "endpoint.json",
        _endpoint("chat turns"), "benchmarks.endpoint", (), ()),
    Row("`percache serve`, several clients at once", "a default llama-server alone (4 slots)", "endpoint.json",
        clients_at_once, "benchmarks.endpoint", (), ()),
    Row("`percache serve` after server and cache restarted", "the llama-server alone, restarted", "endpoint.json",
        _endpoint("restart"), "benchmarks.endpoint", (), ()),
    Row("`percache ask` in a new process", "stock llama.cpp starting and answering", "cold_start.json",
        _cold_start, "benchmarks.cold_start", (), ("--questions", "2")),
    Row("every state restored, generated prompts up to `n_ctx`", "a fresh prefill on stock llama.cpp",
        "exactness_sweep.json", _sweep, "benchmarks.exactness_sweep", (*DATA, "--models", "bundled,smollm2"),
        (*DATA, "--models", "bundled", "--prompts", "2")),
)


def runs() -> list[Row]:
    """The rows whose result file one command writes, once each (the endpoint's four rows
    come from one run): the commands ``--quick`` runs."""
    seen: set[str] = set()
    unique = []
    for row in ROWS:
        if row.result not in seen:
            seen.add(row.result)
            unique.append(row)
    return unique


def read_result(folder: Path, row: Row) -> dict[str, Any] | None:
    """*row*'s result file under *folder*, or None where it is missing."""
    path = folder / row.result
    return json.loads(path.read_text()) if path.is_file() else None
