"""Documents read from files: ``.txt`` and ``.md`` files (one document each, its id the
file's stem) and ``.jsonl`` records (``{"id" or "doc_id", "text", "metadata"}``), for
``percache ingest`` and ``percache serve --documents``.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import PerCacheError

DOCUMENT_SUFFIXES = (".txt", ".md", ".jsonl")


def read_documents(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The documents in the files *paths*.

    Raises:
        PerCacheError: a path that is not a file.
    """
    documents: list[dict[str, Any]] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise PerCacheError(f"not a file: {path}")
        if path.suffix == ".jsonl":
            for line_number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
                if line.strip():
                    record = json.loads(line)
                    record.setdefault("id", record.get("doc_id") or f"{path.stem}-{line_number}")
                    documents.append(record)
        else:
            documents.append({"id": path.stem, "text": path.read_text("utf-8"), "metadata": {"path": str(path)}})
    return documents


def document_files(pattern: str | Path) -> list[Path]:
    """The document files a folder (searched recursively) or a glob names, sorted.

    >>> document_files("/nonexistent-folder/*.txt")
    []
    """
    path = Path(pattern).expanduser()
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file()]
    else:
        found = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    return sorted(p for p in found if p.suffix in DOCUMENT_SUFFIXES)
