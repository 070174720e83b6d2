"""Paraphrase hit rate and near-miss false-hit rate at several tau, with and without the
hit verifier, on labelled question pairs (``--pairs``, default the project's own set).

    .venv/bin/python -m benchmarks.verify --pairs tests/data/verify_pairs.jsonl --out benchmarks/results/verify.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from percache_core.knowledge.bert import BertEmbedder

from .output import write_json
from .verify_harness import evaluate, print_table, read_pairs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pairs",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "tests" / "data" / "verify_pairs.jsonl",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/verify.json"))
    args = parser.parse_args(argv)
    if not args.pairs.is_file():
        raise SystemExit(f"no pair file at {args.pairs}: pass --pairs")
    result = evaluate(read_pairs(args.pairs), BertEmbedder())
    result["pairs_file"] = str(args.pairs)
    print_table(result)
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
