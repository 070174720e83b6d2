"""The results a user reads, written from the benchmarks' JSON: the README's table (between
its ``results`` markers), docs/evaluation.md's "Current results" and docs/figures/results.png.

    .venv/bin/python -m benchmarks.report                 # from benchmarks/results/*.json
    .venv/bin/python -m benchmarks.report --quick --data ../shared/data   # run small versions first
    .venv/bin/python -m benchmarks.report --check         # exit 1 where the README is not its output

One row per thing a user runs (:data:`benchmarks.report_rows.ROWS`): PerCache's time over
what the user runs instead, how many answers were that system's fresh text, the machine
and date of the run and the command that measured it (each result's ``run`` stamp).
``--quick`` runs every row's command at a small scale (one user, two or three questions:
about 13 minutes on 2 cores), overwriting the results, then writes the tables and the figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .output import quoted
from .report_rows import ROWS, Measured, Row, clients_at_once, first_model_rows, read_result, runs

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
EVALUATION = REPO / "docs" / "evaluation.md"
FIGURE = REPO / "docs" / "figures" / "results.png"
START = "<!-- results: written by python -m benchmarks.report; do not edit by hand -->"
END = "<!-- /results -->"
HEADER = ("| you run | instead of | PerCache | same answer | asked | measured | reproduce |",
          "|---|---|---|---|---|---|---|")


def measured_rows(folder: Path) -> list[tuple[Row, Measured | None, dict[str, Any]]]:
    """Each row with what its result says (None where the file is missing) and the
    result's run stamp."""
    rows = []
    for row in ROWS:
        result = read_result(folder, row)
        rows.append((row, row.read(result) if result else None, (result or {}).get("run", {})))
    return rows


def table(folder: Path) -> str:
    """The results table, one line per row (a missing result says how to measure it).

    >>> print(table(Path("/nonexistent")).splitlines()[2][:60])
    | your own RAG pipeline (`PerCache.answer`) | the same retri
    """
    lines = list(HEADER)
    writers = {row.result: row for row in runs()}  # the row whose command writes each file
    for row, measured, run in measured_rows(folder):
        writer = writers[row.result]
        command = run.get("command") or " ".join(["python", *map(quoted, writer.command(writer.full))])
        command = command.split(" --out ")[0]
        if measured is None:
            lines.append(f"| {row.what} | {row.against} | not measured yet | | | | `{command}` |")
            continue
        when = f"{run.get('date', '?')}, {run.get('cores', '?')} cores" if run else "?"
        lines.append(f"| {row.what} | {row.against} | {measured.figure} | {measured.same} | {measured.scale} "
                     f"| {when} | `{command}` |")  # fmt: skip
    return "\n".join(lines)


def replace_between_markers(text: str, body: str, where: str) -> str:
    """*text* with what lies between :data:`START` and :data:`END` replaced by *body*.

    >>> replace_between_markers(f"a\\n{START}\\nold\\n{END}\\nb", "new", "x")
    'a\\n<!-- results: written by python -m benchmarks.report; do not edit by hand -->\\nnew\\n<!-- /results -->\\nb'
    """
    head, start, rest = text.partition(START)
    old, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"{where} has no {START} ... {END} markers")
    return f"{head}{START}\n{body}\n{END}{tail}"


def plot(folder: Path, path: Path) -> Path | None:
    """Per app and engine, the mean seconds per question before and after the swap; for
    the server, wall time over the server alone's by number of clients. None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [(row, m) for row, m, _ in measured_rows(folder) if m is not None and m.before_s is not None]
    load = read_result(folder, next(r for r in ROWS if r.read is clients_at_once))
    clients = [r for r in first_model_rows(load) if r["workload"] == "load"] if load else []
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1.2]})
    names = [row.what.replace("`", "").replace(", swapped", "") for row, _ in rows]
    y = range(len(rows))
    axes[0].barh([i - 0.2 for i in y], [m.before_s for _, m in rows], 0.4, label="what you run today", color="#999999")
    axes[0].barh([i + 0.2 for i in y], [m.after_s for _, m in rows], 0.4, label="with PerCache", color="#2a7ab9")
    axes[0].set_yticks(list(y), names, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("seconds per question (mean)")
    axes[0].legend(fontsize=8)
    if clients:
        counts = [r["clients"] for r in clients]
        axes[1].axhline(1.0, color="#999999", linestyle="--", label="the server alone")
        axes[1].plot(counts, [r["ratio"] for r in clients], "o-", color="#2a7ab9", label="percache serve")
        axes[1].set_xticks(counts)
        axes[1].set_xlabel("clients at once")
        axes[1].set_ylabel("wall time / the server alone's")
        axes[1].legend(fontsize=8)
    else:
        axes[1].axis("off")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def run_quick(data: str, folder: Path, only: Sequence[str] = ()) -> None:
    """Every row's quick command (:func:`benchmarks.report_rows.runs`), one after the
    other, alone, each writing its result file into *folder*."""
    out = os.path.relpath(folder.resolve(), REPO)
    for row in runs():
        if only and row.result not in only:
            continue
        arguments = tuple(data if previous == "--data" else a for previous, a in zip(("",) + row.quick, row.quick))
        command = [sys.executable, *row.command(arguments, out)]
        print(f"report --quick: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True)
        print(f"report --quick: {row.result} in {time.perf_counter() - started:.0f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the folder of the benchmarks' JSON (--quick writes there)")
    parser.add_argument("--quick", action="store_true", help="first run a small version of every row's benchmark")
    parser.add_argument("--only", default="", help="with --quick: these result files only (comma-separated)")
    parser.add_argument("--data", default="../shared/data", help="with --quick: the data folder")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where the README differs")
    args = parser.parse_args(argv)
    if args.quick:
        if not (Path(args.data) / "qmsum" / "documents.jsonl").is_file():
            parser.error(f"no qmsum/documents.jsonl under {args.data}")
        data = os.path.relpath(Path(args.data).resolve(), REPO)  # as the README's commands write it
        run_quick(data, args.results, [name for name in args.only.split(",") if name])
    body = table(args.results)
    targets = {README: README.read_text("utf-8"), EVALUATION: EVALUATION.read_text("utf-8")}
    written = {path: replace_between_markers(text, body, path.name) for path, text in targets.items()}
    if args.check:
        stale = [path.name for path, text in written.items() if text != targets[path]]
        print("up to date" if not stale else f"not the report's output: {', '.join(stale)}")
        return 1 if stale else 0
    for path, text in written.items():
        path.write_text(text, "utf-8")
    figure = plot(args.results, FIGURE)
    print(body)
    print(f"wrote {README.name}, {EVALUATION.relative_to(REPO)}" + (f", {figure.relative_to(REPO)}" if figure else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
