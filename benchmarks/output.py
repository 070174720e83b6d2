"""Where benchmarks put their results: JSON files under ``benchmarks/results/`` (ignored by git)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(result: Any, out: str | Path, *, indent: int = 2) -> Path:
    """Write *result* as JSON to *out*, creating its folder; returns the path.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     write_json({"ratio": 0.5}, Path(folder) / "new" / "r.json").read_text()
    '{\\n  "ratio": 0.5\\n}'
    """
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent))
    return path
