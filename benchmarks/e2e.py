"""End-to-end evaluation against every baseline (the harness is benchmarks/e2e_harness.py).

    .venv/bin/python -m benchmarks.e2e --data ../shared/data --quick --taus 0.6,0.75,0.85,0.95
    .venv/bin/python -m benchmarks.e2e --data my/data --qmsum-users 5 --squad-users 2 --queries-per-user 12
    .venv/bin/python -m benchmarks.e2e --data ../shared/data --merged 6,4 --idle-seconds 20 --budget-gib 2 \
        --systems stock,naive,ragcache,percache

Writes JSON, a Markdown table and PNG plots.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .data_sets import default_data_folder
from .e2e_harness import ABLATIONS, OPT_INS, SYSTEMS, evaluate, markdown_table, write_report

QUICK = {"qmsum_users": 2, "squad_users": 1, "queries_per_user": 5, "stride": 3, "max_new_tokens": 48}
FULL = {"qmsum_users": 5, "squad_users": 2, "queries_per_user": 12, "stride": 5, "max_new_tokens": 64}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="folder with <set>/documents.jsonl and queries.jsonl (default ../shared/data)")
    parser.add_argument("--qmsum-users", type=int)
    parser.add_argument("--squad-users", type=int)
    parser.add_argument("--queries-per-user", type=int)
    parser.add_argument("--stride", type=int, help="prediction stride (default 5; quick 3)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-users", type=int, default=0, help="leave out the first N users (already run)")
    parser.add_argument("--taus", help="comma-separated tau values for PerCache's sweep on the first user")
    parser.add_argument(
        "--systems", help="comma-separated systems to compare (default: all seven; opt-ins and ablations by name)"
    )
    parser.add_argument("--strides", help="comma-separated prediction strides to sweep on the first user")
    parser.add_argument("--budgets-mb", help="comma-separated chunk-state budgets (MB) to sweep on the first user")
    parser.add_argument(
        "--ablations",
        action="store_true",
        help="also run PerCache without the QA bank, without chunk states and without prediction",
    )
    parser.add_argument("--quick", action="store_true", help="a run of a few minutes: 3 users, 5 questions each")
    parser.add_argument(
        "--merged",
        help="SERIES,PER_SERIES: every QMSum meeting as one knowledge, asked PER_SERIES questions per series",
    )
    parser.add_argument(
        "--consecutive", action="store_true", help="--merged: PER_SERIES questions in a row (mostly one meeting)"
    )
    parser.add_argument("--idle-seconds", type=float, help="one idle round of at most this long before each question")
    parser.add_argument("--budget-gib", type=float, help="every system's chunk-state budget (default: sized)")
    parser.add_argument(
        "--server", action="store_true",
        help="run the systems on llama-servers, with stock = the same llama-server alone (make llama-server)",
    )
    parser.add_argument("--out", default="benchmarks/results/e2e.json")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = QUICK if args.quick else FULL
    settings = {
        name: default if getattr(args, name) is None else getattr(args, name) for name, default in defaults.items()
    }
    result = evaluate(
        data=Path(args.data) if args.data else default_data_folder(),
        seed=args.seed,
        taus=_numbers(args.taus, float),
        strides=_numbers(args.strides, int),
        budgets_mb=_numbers(args.budgets_mb, int),
        ablations=args.ablations,
        systems=_systems(args.systems),
        partial=Path(args.out).with_suffix(".partial.json"),
        skip_users=args.skip_users,
        merged=tuple(_numbers(args.merged, int)) if args.merged else None,  # type: ignore[arg-type]
        consecutive=args.consecutive,
        idle_seconds=args.idle_seconds,
        budget_gib=args.budget_gib,
        server=args.server,
        **settings,
    )
    print()
    print(markdown_table(result))
    for path in write_report(result, Path(args.out)):
        print(f"wrote {path}")
    return 0


def _systems(names: str | None) -> Any:
    if not names:
        return SYSTEMS
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = {system.name: system for system in (*SYSTEMS, *OPT_INS, *ABLATIONS)}
    unknown = [name for name in wanted if name not in known]
    if unknown or "percache" not in wanted:
        raise SystemExit(f"--systems: choose among {', '.join(known)} (percache included); got {names!r}")
    return [known[name] for name in wanted]


def _numbers(text: str | None, kind: type) -> list[Any]:
    """Comma-separated numbers ("0.6,0.85" -> [0.6, 0.85]); none for None."""
    return [kind(part) for part in text.split(",") if part.strip()] if text else []


if __name__ == "__main__":
    sys.exit(main())
