"""Where benchmarks put their results: JSON files under ``benchmarks/results/``, each
stamped with the run that wrote it (date, machine, command), which ``benchmarks.report``
shows beside its figures. The results the README's table is written from are committed."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def run_stamp(argv: list[str] | None = None) -> dict[str, Any]:
    """When, where and how a result was measured: the UTC date, the machine (architecture
    and cores) and the command (``python -m <module> <arguments>``, as typed).

    >>> stamp = run_stamp(["-m", "benchmarks.apps", "--apps", "langchain"])
    >>> sorted(stamp), stamp["command"]
    (['command', 'cores', 'date', 'machine'], 'python -m benchmarks.apps --apps langchain')
    """
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0] != "-m" and argv[0].endswith(".py"):  # python -m module: argv[0] is its file
        module = Path(argv[0]).resolve()
        parts = module.with_suffix("").parts
        argv = ["-m", ".".join(parts[parts.index("benchmarks") :])] + argv[1:] if "benchmarks" in parts else argv
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "machine": platform.machine() or "unknown",
        "cores": os.cpu_count(),
        "command": " ".join(["python", *(quoted(a) for a in argv)]),
    }


def quoted(argument: str) -> str:
    """*argument* as a shell line shows it.

    >>> quoted("first asks,load"), quoted("--apps")
    ('"first asks,load"', '--apps')
    """
    return f'"{argument}"' if " " in argument and not argument.startswith('"') else argument


def write_json(result: Any, out: str | Path, *, indent: int = 2) -> Path:
    """Write *result* as JSON to *out*, creating its folder; a dict gets a ``"run"`` stamp
    (:func:`run_stamp`) unless it has one; returns the path.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     written = json.loads(write_json({"ratio": 0.5}, Path(folder) / "new" / "r.json").read_text())
    >>> written["ratio"], sorted(written["run"])
    (0.5, ['command', 'cores', 'date', 'machine'])
    """
    if isinstance(result, dict) and "run" not in result:
        result = {**result, "run": run_stamp()}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, default=str))
    return path
