"""``PerCacheNodePostprocessor`` for users who keep their own query engine."""

from __future__ import annotations

from typing import Any

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle
from pydantic import Field, PrivateAttr

from percache_core import PerCache

from .nodes import node_chunks, record_chunks


class PerCacheNodePostprocessor(BaseNodePostprocessor):
    """Records retrieved nodes into PerCache's knowledge bank (so that prediction and
    chunk states cover them) and, with ``reorder=True``, puts first the nodes whose
    chunk-state path is already stored.

    ``reorder`` is off by default: it changes the order of the context in the prompt, and
    so possibly the answer.
    """

    reorder: bool = Field(default=False, description="reorder nodes to follow stored chunk-state paths")
    _percache: Any = PrivateAttr()

    def __init__(self, percache: PerCache, **kwargs: Any) -> None:
        if not isinstance(percache, PerCache):
            raise TypeError(f"percache must be a PerCache, got {type(percache).__name__}")
        super().__init__(**kwargs)
        self._percache = percache

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name of this component.

        Returns:
            ``"PerCacheNodePostprocessor"``.

        >>> PerCacheNodePostprocessor.class_name()
        'PerCacheNodePostprocessor'
        """
        return "PerCacheNodePostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        chunks = node_chunks(nodes)
        record_chunks(self._percache, chunks)
        if not self.reorder or not nodes:
            return nodes
        by_id = {node.node.node_id: node for node in nodes}
        ordered = self._percache.caller.stored_order(chunks)
        return [by_id[chunk.id] for chunk in ordered]
