"""A LlamaIndex ``BaseEmbedding`` over a PerCache embedder (the bundled MiniLM by default)."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from pydantic import PrivateAttr

from percache_core import BertEmbedder, Embedder


class PerCacheEmbedding(BaseEmbedding):
    """Embeds with the same model PerCache uses, so an index and its cache agree.

    >>> from llama_index.core import Settings            # doctest: +SKIP
    >>> Settings.embed_model = PerCacheEmbedding()       # doctest: +SKIP
    """

    _embedder: Any = PrivateAttr()

    def __init__(self, embedder: Embedder | None = None, **kwargs: Any) -> None:
        embedder = embedder or BertEmbedder()
        kwargs.setdefault("model_name", embedder.name)
        super().__init__(**kwargs)
        self._embedder = embedder

    @property
    def embedder(self) -> Embedder:
        """The PerCache embedder it wraps (a cache opened with it embeds the same way)."""
        return self._embedder

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name of this component.

        Returns:
            ``"PerCacheEmbedding"``.

        >>> PerCacheEmbedding.class_name()
        'PerCacheEmbedding'
        """
        return "PerCacheEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.embed([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.embed(texts).tolist()
