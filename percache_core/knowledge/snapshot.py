"""The knowledge's retrieval index written beside its store, so that a large knowledge
reopens without reading every chunk record and tokenizing every text again.

A snapshot is the index as it was at one store version (chunks, embedding blocks, BM25
postings, documents), in one ``.npz`` file of arrays (no pickles: read back as data).
It only ever saves time: the knowledge takes in what was written after that version as
additions, and reads the records as before when anything was removed or rewritten since,
when the snapshot's chunk count does not match the store's, or when the file is missing,
damaged or of another format.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ..storage import Store
from .index import ChunkIndex

logger = logging.getLogger(__name__)

FILE_NAME = "knowledge-index"
FORMAT = 1


@dataclass
class Snapshot:
    """An index and the documents it holds, as of store version *version*."""

    index: ChunkIndex
    documents: dict[str, dict[str, Any]]
    version: int


def _json_array(value: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"), dtype=np.uint8)


def _from_json_array(array: np.ndarray) -> Any:
    return json.loads(array.tobytes().decode("utf-8"))


def write_snapshot(store: Store, snapshot: Snapshot) -> None:
    """Write *snapshot* beside *store* (whole or not at all)."""
    packed = snapshot.index.packed()
    bm25 = packed["bm25"]

    def write(handle: BinaryIO) -> None:
        np.savez(
            handle,
            meta=_json_array(
                {"format": FORMAT, "version": snapshot.version, "chunks": len(snapshot.index), "blocks": len(packed["blocks"])}
            ),
            chunks=_json_array(packed["chunks"]),
            documents=_json_array(snapshot.documents),
            **{f"matrix_{i}": block for i, block in enumerate(packed["blocks"])},
            bm25_words=_json_array(bm25["words"]),
            bm25_offsets=bm25["offsets"],
            bm25_rows=bm25["rows"],
            bm25_counts=bm25["counts"],
            bm25_lengths=bm25["lengths"],
        )

    store.files.write(FILE_NAME, write)


def read_snapshot(store: Store) -> Snapshot | None:
    """The snapshot beside *store*, or None when there is none or it cannot be used."""
    path = store.files.path(FILE_NAME)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as arrays:
            meta = _from_json_array(arrays["meta"])
            if meta.get("format") != FORMAT:
                return None
            bm25 = {
                "words": _from_json_array(arrays["bm25_words"]),
                "offsets": arrays["bm25_offsets"],
                "rows": arrays["bm25_rows"],
                "counts": arrays["bm25_counts"],
                "lengths": arrays["bm25_lengths"],
            }
            blocks = [arrays[f"matrix_{i}"] for i in range(int(meta["blocks"]))]
            index = ChunkIndex.from_packed(_from_json_array(arrays["chunks"]), blocks, bm25)
            documents = _from_json_array(arrays["documents"])
        if len(index) != meta["chunks"] or not isinstance(documents, dict):
            return None
        return Snapshot(index, documents, int(meta["version"]))
    except Exception as error:  # damaged or foreign: the records are read instead
        logger.warning("knowledge index snapshot %s not used: %s", path, error)
        return None
