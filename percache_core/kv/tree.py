"""The chunk-state tree: which prompt prefixes have a stored KV state.

A node stands for the prefix [segment 1, ..., segment d] of some prompt. Its key chains
the parent's key with the segment's token ids (``node_key``), starting from a root key
that fingerprints everything that changes the state bytes; so the same key always means
the same tokens at the same positions under the same engine settings, and a key from
another fingerprint can never match.

A node's state is either whole (every position of its prefix) or, with state slices, only
the positions after its parent's (``parent_key`` names the nearest stored shorter prefix;
a depth-1 node, or any node whose parent is the root, is always whole). A sliced node is
restored from its chain of ancestors (``chain``), so it is usable only while they are all
stored.

The tree is metadata only (the state bytes live in a
:class:`~percache_core.kv.state_store.StateStore`, which also enforces the byte budget
over what every process stored, least frequently used leaves first). Its API is
``match``, ``insert``, ``remove`` and ``pinned`` (the nodes a query uses, which this
process never evicts).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


def node_key(parent_key: str, tokens: Sequence[int]) -> str:
    """The key of the node reached from *parent_key* by a segment of *tokens*.

    >>> node_key("root", [1, 2]) == node_key("root", (1, 2))
    True
    >>> node_key("root", [1, 2]) == node_key("other", [1, 2])
    False
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_key.encode("ascii"))
    digest.update(b"|")
    digest.update(",".join(map(str, map(int, tokens))).encode("ascii"))
    return digest.hexdigest()


def path_keys(root_key: str, segments: Sequence[Sequence[int]]) -> list[str]:
    """The keys of every prefix of *segments*: ``keys[i]`` covers ``segments[: i + 1]``."""
    keys: list[str] = []
    parent = root_key
    for tokens in segments:
        parent = node_key(parent, tokens)
        keys.append(parent)
    return keys


def prefix_keys(root_key: str, tokens: Sequence[int], ends: Sequence[int]) -> list[str]:
    """The keys of the prefixes ``tokens[:end]`` for each of *ends* (ascending), whatever
    the cuts before them: ``node_key(root_key, tokens[:end])``. A caller's prompt is keyed
    this way, so that a state is found by any later prompt with the same leading tokens.

    >>> prefix_keys("root", [1, 2, 3], [1, 3]) == [node_key("root", [1]), node_key("root", [1, 2, 3])]
    True
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(root_key.encode("ascii"))
    digest.update(b"|")
    keys: list[str] = []
    position = 0
    for end in ends:
        if position < end:
            text = ",".join(map(str, map(int, tokens[position:end]))).encode("ascii")
            digest.update(b"," + text if position else text)
            position = end
        keys.append(digest.copy().hexdigest())
    return keys


@dataclass
class StateNode:
    """One stored prefix.

    Attributes:
        key: the prefix's key (``path_keys``).
        parent_key: the key of the nearest stored shorter prefix of the same prompt when
            the node was stored, or the root key.
        depth: number of segments covered.
        n_tokens: number of tokens covered (the sequence length of the stored state).
        label: what the last segment is: a chunk id, "system", or "text" (a piece of a
            caller's finished prompt, keyed by its leading tokens).
        size: bytes of the stored state.
        hits: times the node was restored (its LFU frequency).
        idle: stored by idle work (prediction, knowledge prefill) rather than by an answer.
    """

    key: str
    parent_key: str
    depth: int
    n_tokens: int
    label: str
    size: int
    hits: int = 0
    last_used_at: float = field(default_factory=time.time)
    children: int = 0
    idle: bool = False


class ChunkStateTree:
    """The stored prefixes of one engine fingerprint (*root_key*).

    >>> tree = ChunkStateTree("root")
    >>> keys = path_keys("root", [[1], [2, 3], [4]])
    >>> _ = tree.insert(StateNode(keys[0], "root", depth=1, n_tokens=1, label="system", size=10))
    >>> _ = tree.insert(StateNode(keys[1], keys[0], depth=2, n_tokens=3, label="c1", size=30))
    >>> [node.label for node in tree.match(keys)]
    ['c1', 'system']
    """

    def __init__(self, root_key: str) -> None:
        self.root_key = root_key
        self._nodes: dict[str, StateNode] = {}
        self._lock = threading.RLock()
        self._pins: dict[str, int] = {}
        self.bytes = 0
        self.request_bytes = 0  # of those, the states requests stored (not idle work's)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def get(self, key: str) -> StateNode | None:
        return self._nodes.get(key)

    @property
    def nodes(self) -> list[StateNode]:
        with self._lock:
            return list(self._nodes.values())

    def match(self, keys: Sequence[str]) -> list[StateNode]:
        """Stored nodes among the prefix *keys* (from ``path_keys``), deepest first.

        The first is the deepest stored prefix; the rest are fall-backs if it cannot be
        restored.
        """
        with self._lock:
            return [self._nodes[key] for key in reversed(keys) if key in self._nodes]

    def chain(self, node: StateNode) -> list[StateNode] | None:
        """*node* and its stored ancestors, root first (what restoring a sliced node needs),
        or None when one of them is missing.

        >>> tree = ChunkStateTree("root")
        >>> a = tree.insert(StateNode("a", "root", depth=1, n_tokens=2, label="system", size=1))
        >>> b = tree.insert(StateNode("b", "a", depth=3, n_tokens=9, label="c2", size=1))
        >>> [n.key for n in tree.chain(b)], tree.remove("a") is a, tree.chain(b)
        (['a', 'b'], True, None)
        """
        with self._lock:
            nodes = [node]
            while nodes[-1].parent_key != self.root_key:
                parent = self._nodes.get(nodes[-1].parent_key)
                if parent is None or len(nodes) > len(self._nodes):
                    return None
                nodes.append(parent)
            return nodes[::-1]

    def insert(self, node: StateNode) -> StateNode:
        """Add *node* (or return the node already stored under its key)."""
        with self._lock:
            if node.key in self._nodes:
                return self._nodes[node.key]
            self._nodes[node.key] = node
            self.bytes += node.size
            self.request_bytes += 0 if node.idle else node.size
            parent = self._nodes.get(node.parent_key)
            if parent is not None:
                parent.children += 1
            return node

    def remove(self, key: str) -> StateNode | None:
        """Remove one node.

        Its children stay in the tree (whole states remain usable; sliced ones are skipped
        by ``chain`` until they are evicted in turn).
        """
        with self._lock:
            node = self._nodes.pop(key, None)
            if node is None:
                return None
            self.bytes -= node.size
            self.request_bytes -= 0 if node.idle else node.size
            parent = self._nodes.get(node.parent_key)
            if parent is not None:
                parent.children -= 1
            return node

    def tokens_covered(self) -> int:
        """The prompt tokens the stored states cover, each once: every node's tokens past
        its stored parent's (all of them where the parent is gone).

        >>> tree = ChunkStateTree("root")
        >>> _ = tree.insert(StateNode("a", "root", depth=1, n_tokens=10, label="text", size=1))
        >>> _ = tree.insert(StateNode("b", "a", depth=2, n_tokens=25, label="text", size=1))
        >>> tree.tokens_covered()
        25
        """
        with self._lock:
            parents = {node.key: node.n_tokens for node in self._nodes.values()}
            return sum(node.n_tokens - parents.get(node.parent_key, 0) for node in self._nodes.values())

    def touch(self, node: StateNode) -> None:
        """Count one restore of *node*."""
        with self._lock:
            node.hits += 1
            node.last_used_at = time.time()

    def pinned_keys(self) -> set[str]:
        """The keys queries of this process are using now."""
        with self._lock:
            return set(self._pins)

    @contextmanager
    def pinned(self, keys: Sequence[str]) -> Iterator[None]:
        """Protect the nodes with these keys (present now or inserted inside) from eviction."""
        with self._lock:
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self._pins[key] -= 1
                    if not self._pins[key]:
                        del self._pins[key]
