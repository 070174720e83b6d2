"""Which retrieval paths idle time prefills, within the prefill share of the chunk-state
budget: the paths the demand estimate names, likeliest first, making room by evicting
stored paths it finds less likely (:func:`predicted_paths`, :func:`make_room`); and, only
where every chunk's [system, chunk] state fits the budget, the bulk knowledge prefill's
[chunk] and [chunk, neighbour] prefixes (:func:`knowledge_prefill_paths`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..answering.parts import CacheParts
from ..knowledge.bank import matches_scope
from ..kv.budget import PREFILL_BUDGET_SHARE
from ..kv.tree import StateNode
from ..types import Chunk
from .demand import Path


def knowledge_prefill_paths(parts: CacheParts, scope: Mapping[str, Any] | None) -> Iterator[list[Chunk]]:
    """Knowledge prefill paths whose state is not stored, lazily, in the order to
    prefill them, while the tree is under its prefill share of the budget: first
    [chunk] for every chunk (chunks of recent QA entries, user questions and predictions,
    newest first; then chunks in the latest question's scope; then the rest in
    knowledge order), then [chunk, neighbour] for each chunk's nearest neighbour in the
    same order, then for the second nearest, up to ``knowledge_prefill_neighbours``
    (``KnowledgeBank.neighbours``, within the fields of *scope*: the latest question's)."""
    config = parts.config
    if not (config.tiers.chunk_states and config.idle.knowledge_prefill) or not len(parts.knowledge):
        return
    chunks = parts.knowledge.chunks
    if not parts.runtime.knowledge_prefill_fits(chunks):
        return
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
    count = config.idle.knowledge_prefill_neighbours
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


def predicted_paths(parts: CacheParts, probabilities: Mapping[Path, float]) -> Iterator[tuple[list[Chunk], float]]:
    """The paths of *probabilities* (chunk ids, likeliest first) whose state is not
    stored, as chunks, with their probability."""
    runner = parts.runtime.runner
    for path, probability in probabilities.items():
        chunks = [chunk for chunk in map(parts.knowledge.get_chunk, path) if chunk is not None]
        if len(chunks) == len(path) and not runner.path_is_stored("", chunks, 1):
            yield chunks, probability


def make_room(parts: CacheParts, probabilities: Mapping[Path, float], probability: float) -> bool:
    """Evict stored leaves of PerCache's own prompt whose estimate (0 where the estimate
    does not name them; ties: fewest restores, least recently used) is below
    *probability*, until the states are under the prefill share of the budget; whether
    they are (a path of *probability* is then worth prefilling)."""
    runtime = parts.runtime
    states = runtime.runner.states
    limit = PREFILL_BUDGET_SHARE * runtime.state_budget_bytes
    if states.bytes < limit:
        return True
    pinned = states.tree.pinned_keys()
    ranked: list[tuple[float, int, float, StateNode]] = []
    for node in states.tree.nodes:
        if node.children or node.key in pinned:
            continue
        chain = states.tree.chain(node)
        if not chain or chain[0].label != "system" or len(chain) == 1:
            continue  # a caller's prompt, or the system prompt every path starts with
        estimate = probabilities.get(tuple(n.label for n in chain[1:]), 0.0)
        if estimate < probability:
            ranked.append((estimate, node.hits, node.last_used_at, node))
    ranked.sort(key=lambda item: item[:3])
    for *_, node in ranked:
        if states.bytes < limit:
            break
        states.evict(node.key)
    return states.bytes < limit
