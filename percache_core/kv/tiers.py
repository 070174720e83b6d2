"""Chunk states in tiers: the local store on disk, and optionally a shared one behind it.

``TieredStateStore`` is the one object the prompt runner asks for states. Reads go
through the tiers (a deeper prefix that only the shared tier has is fetched, kept locally
and then restored from there); writes go to every tier. The tree (which prefixes are
stored locally) and the LFU budget are kept here too, so a node is in the tree exactly
when its state is in the local store. The tree follows what other processes store and
evict in the same folder (:meth:`TieredStateStore.sync`, at every lookup).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from ..errors import StorageWriteError
from .state_store import StateStore
from .tree import ChunkStateTree, StateNode

logger = logging.getLogger(__name__)


class SharedStates(Protocol):
    """A tier behind the local one (the Redis tier implements it)."""

    @property
    def available(self) -> bool: ...

    def bind_states(self, fingerprint: str) -> None: ...

    def might_have_state(self, node_key: str) -> bool: ...

    def fetch_state(self, node_key: str, fingerprint: str) -> tuple[StateNode, bytes] | None: ...

    def put_state(self, node: StateNode, data: bytes) -> None: ...


class TieredStateStore:
    """The stored chunk states of one engine fingerprint, local first, shared behind.

    With *slices*, a node's state holds only the positions after its parent's (see
    :meth:`chain`); the fingerprint must tell the two kinds apart, as they never mix.
    """

    def __init__(self, local: StateStore, shared: SharedStates | None = None, *, slices: bool = False) -> None:
        self.local = local
        self.shared = shared
        self.slices = slices
        self.tree = ChunkStateTree(local.fingerprint)
        self._version = 0
        self.evictions = 0
        self.sync()
        local.delete_orphans(self.tree)
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

    def sync(self) -> None:
        """Take in the nodes other processes stored or evicted since the last sync."""
        if self.local.version() == self._version:
            return
        changes = self.local.changes(self._version)
        self.local.apply(self.tree, changes)
        self._version = changes.version

    def candidates(self, keys: Sequence[str], *, budget_bytes: int | None = None) -> list[StateNode]:
        """Stored prefixes among *keys*, deepest first (read-through: a deeper prefix held
        by the shared tier is fetched and kept locally first, within *budget_bytes*)."""
        self.sync()
        if self.shared is not None and budget_bytes is not None:
            self._read_through(keys, budget_bytes)
        return self.tree.match(keys)

    def chain(self, node: StateNode) -> list[StateNode] | None:
        """The nodes whose states rebuild *node*'s prefix, root first: *node* alone for whole
        states, *node* and its stored ancestors for slices (None when one is missing)."""
        return self.tree.chain(node) if self.slices else [node]

    def get(self, node: StateNode) -> bytes | None:
        """The verified state bytes of *node*, or None (a damaged blob is deleted)."""
        return self.local.get(node.key)

    def record_use(self, node: StateNode) -> None:
        """Count a restore of *node* (its LFU frequency; persisted off the answer path)."""
        self.tree.touch(node)
        self.local.record_use(node)

    def put(self, node: StateNode, data: bytes, *, budget_bytes: int) -> None:
        """Store *node*'s state in every tier (write-through), evicting local nodes of any
        process down to *budget_bytes*. Raises StorageWriteError when it cannot be stored
        locally (then it is not shared either)."""
        self._put_local(node, data, budget_bytes)
        if self.shared is not None:
            self.shared.put_state(node, data)

    def delete(self, key: str) -> None:
        """Remove a prefix from the local tier."""
        self.tree.remove(key)
        self.local.delete(key)

    def evict(self, key: str) -> None:
        """Evict one prefix from the local tier by choice of the caller (idle work making
        room for a likelier path), counted with the budget's evictions."""
        self.local.delete(key)
        self._forget([key])

    def evict_to(self, budget_bytes: int) -> int:
        """Evict least frequently used leaves (of every process; never one a query here
        uses) down to *budget_bytes*; the count."""
        evicted = self.local.trim(budget_bytes, self.tree.pinned_keys())
        self._forget(evicted)
        return len(evicted)

    def _forget(self, evicted: list[str]) -> None:
        for key in evicted:
            self.tree.remove(key)
        self.evictions += len(evicted)

    def close(self) -> None:
        self.local.close()

    def _put_local(self, node: StateNode, data: bytes, budget_bytes: int) -> None:
        evicted = self.local.put(node, data, budget_bytes=budget_bytes, protected=self.tree.pinned_keys())
        self.tree.insert(node)
        self._forget(evicted)

    def _read_through(self, keys: Sequence[str], budget_bytes: int) -> None:
        assert self.shared is not None
        local = self.tree.match(keys)
        local_depth = list(keys).index(local[0].key) + 1 if local else 0  # its place in this prompt
        for depth in range(len(keys), local_depth, -1):
            key = keys[depth - 1]
            if not self.shared.available or not self.shared.might_have_state(key):
                continue
            fetched = self._fetch_chain(key)
            if fetched:
                try:
                    for node, data in fetched:
                        self._put_local(node, data, budget_bytes)
                except StorageWriteError as error:
                    logger.warning("shared chunk state not kept locally: %s", error)
                return

    def _fetch_chain(self, key: str) -> list[tuple[StateNode, bytes]]:
        """The shared state of *key* and, for slices, of its ancestors missing here, root
        first; empty when the shared tier lacks one of them."""
        assert self.shared is not None
        fetched: list[tuple[StateNode, bytes]] = []
        while True:
            item = self.shared.fetch_state(key, self.root_key)
            if item is None or len(fetched) > len(self.tree) + 64:
                return []
            fetched.append(item)
            key = item[0].parent_key
            if not self.slices or key == self.root_key or key in self.tree:
                return fetched[::-1]
