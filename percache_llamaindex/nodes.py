"""Translating LlamaIndex nodes to PerCache chunks."""

from __future__ import annotations

from llama_index.core.schema import MetadataMode, NodeWithScore

from percache_core import Chunk, PerCache


def _plain_metadata(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if isinstance(v, (str, int, float, bool))}


def node_chunks(nodes: list[NodeWithScore]) -> list[Chunk]:
    """PerCache chunks with the nodes' ids and the text LlamaIndex would put in a prompt."""
    return [
        Chunk(
            n.node.node_id,
            n.node.node_id,
            n.node.get_content(metadata_mode=MetadataMode.LLM),
            _plain_metadata(n.node.metadata),
        )
        for n in nodes
    ]


def record_chunks(percache: PerCache, chunks: list[Chunk]) -> None:
    """Give the chunks of retrieved nodes (``node_chunks``) to the knowledge bank: the
    next idle round embeds and adds them (``pc.caller.record_passages``; known nodes with
    the same text are skipped then), so no answer waits for them."""
    kept = [c for c in chunks if c.text.strip()]
    if kept:
        percache.caller.record_passages([{"id": c.id, "text": c.text, "metadata": c.metadata} for c in kept])

