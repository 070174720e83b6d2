"""Which retrieval paths idle time prefills: the knowledge prefill's [chunk] and
[chunk, neighbour] prefixes, in the order that serves the most prompts first, within the
prefill share of the chunk-state budget."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..knowledge.bank import matches_scope
from ..parts import CacheParts
from ..types import Chunk
from .budget import PREFILL_BUDGET_SHARE


def knowledge_prefill_paths(parts: CacheParts, scope: Mapping[str, Any] | None) -> Iterator[list[Chunk]]:
    """Knowledge prefill paths whose state is not stored, lazily, in the order to
    prefill them, while the tree is under its prefill share of the budget: first
    [chunk] for every chunk (chunks of recent QA entries, user questions and predictions,
    newest first; then chunks in the latest question's scope; then the rest in
    knowledge order), then [chunk, neighbour] for each chunk's nearest neighbour in the
    same order, then for the second nearest, up to ``knowledge_prefill_neighbours``
    (``KnowledgeBank.neighbours``, within the fields of *scope*: the latest question's)."""
    config = parts.config
    if not (config.chunk_states and config.knowledge_prefill) or not len(parts.knowledge):
        return
    chunks = parts.knowledge.chunks
    by_id = {c.id: c for c in chunks}
    ordered: dict[str, Chunk] = {}
    for entry in reversed(parts.qa_bank.entries):
        ordered.update((i, by_id[i]) for i in entry.chunk_ids if i in by_id and i not in ordered)
    in_scope = [c for c in chunks if scope and matches_scope(c, scope)]
    for chunk in in_scope + list(chunks):
        ordered.setdefault(chunk.id, chunk)
    runner = parts.runtime.runner
    limit = PREFILL_BUDGET_SHARE * parts.runtime.state_budget_bytes
    for chunk in ordered.values():
        if runner.states.bytes >= limit:
            return
        if not runner.path_is_stored("", [chunk], 1):
            yield [chunk]
    count = config.knowledge_prefill_neighbours
    scope_fields = list(scope or {})
    nearest: dict[str, list[Chunk]] = {}  # each chunk's neighbours, retrieved once per walk
    for rank in range(count):
        for chunk in ordered.values():
            if runner.states.bytes >= limit:
                return
            if chunk.id not in nearest:
                nearest[chunk.id] = parts.knowledge.neighbours(chunk, count, scope_fields=scope_fields)
            neighbours = nearest[chunk.id]
            if rank < len(neighbours) and not runner.path_is_stored("", [chunk, neighbours[rank]], 1):
                yield [chunk, neighbours[rank]]
