"""Chunk states in tiers: the local store on disk, and optionally a shared one behind it.

``TieredStateStore`` is the one object the prompt runner asks for states. Reads go
through the tiers (a deeper prefix that only the shared tier has is fetched, kept locally
and then restored from there); writes go to every tier. The tree (which prefixes are
stored locally) and the LFU budget are kept here too, so a node is in the tree exactly
when its state is in the local store.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from .state_store import StateStore
from .tree import ChunkStateTree, StateNode


class SharedStates(Protocol):
    """A tier behind the local one (the Redis tier implements it)."""

    @property
    def available(self) -> bool: ...

    def bind_states(self, fingerprint: str) -> None: ...

    def might_have_state(self, node_key: str) -> bool: ...

    def fetch_state(self, node_key: str, fingerprint: str) -> tuple[StateNode, bytes] | None: ...

    def put_state(self, node: StateNode, data: bytes) -> None: ...


class TieredStateStore:
    """The stored chunk states of one engine fingerprint, local first, shared behind."""

    def __init__(self, local: StateStore, shared: SharedStates | None = None) -> None:
        self.local = local
        self.shared = shared
        self.tree: ChunkStateTree = local.load_tree()
        self.evictions = 0
        if shared is not None:
            shared.bind_states(local.fingerprint)

    @property
    def root_key(self) -> str:
        return self.tree.root_key

    def __contains__(self, key: object) -> bool:
        return key in self.tree

    @property
    def bytes(self) -> int:
        return self.tree.bytes

    def pinned(self, keys: Sequence[str]) -> AbstractContextManager[None]:
        """Keep these prefixes from eviction while a query uses them."""
        return self.tree.pinned(keys)

    def candidates(self, keys: Sequence[str]) -> list[StateNode]:
        """Stored prefixes among *keys*, deepest first (read-through: a deeper prefix held
        by the shared tier is fetched and kept locally first)."""
        if self.shared is not None:
            self._read_through(keys)
        return self.tree.match(keys)

    def get(self, node: StateNode) -> bytes | None:
        """The verified state bytes of *node*, or None (a damaged blob is deleted)."""
        return self.local.get(node.key)

    def record_use(self, node: StateNode) -> None:
        """Count a restore of *node* (its LFU frequency; persisted off the answer path)."""
        self.tree.touch(node)
        self.local.record_use(node)

    def put(self, node: StateNode, data: bytes) -> None:
        """Store *node*'s state in every tier (write-through)."""
        self._put_local(node, data)
        if self.shared is not None:
            self.shared.put_state(node, data)

    def drop(self, key: str) -> None:
        """Remove a prefix from the local tier."""
        self.tree.remove(key)
        self.local.delete(key)

    def evict_to(self, budget_bytes: int) -> int:
        """Evict least frequently used unpinned leaves down to *budget_bytes*; the count."""
        evicted = self.tree.evict(budget_bytes)
        for node in evicted:
            self.local.delete(node.key)
        self.evictions += len(evicted)
        return len(evicted)

    def close(self) -> None:
        self.local.close()

    def _put_local(self, node: StateNode, data: bytes) -> None:
        self.local.put(node, data)
        self.tree.insert(
            node.key, node.parent_key, depth=node.depth, n_tokens=node.n_tokens, label=node.label, size=node.size
        )

    def _read_through(self, keys: Sequence[str]) -> None:
        assert self.shared is not None
        local = self.tree.match(keys)
        local_depth = local[0].depth if local else 0
        for depth in range(len(keys), local_depth, -1):
            key = keys[depth - 1]
            if not self.shared.available or not self.shared.might_have_state(key):
                continue
            fetched = self.shared.fetch_state(key, self.root_key)
            if fetched is not None:
                self._put_local(*fetched)
                return
