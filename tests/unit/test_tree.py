"""The chunk-state tree's keys and matching, and the state store's LFU budget."""

from percache_core.kv.state_store import StateStore
from percache_core.kv.tree import ChunkStateTree, StateNode, node_key, path_keys


def build(sizes: list[int]) -> tuple[ChunkStateTree, list[str]]:
    tree = ChunkStateTree("root")
    keys = path_keys("root", [[i] for i in range(len(sizes))])
    parent = "root"
    for depth, (key, size) in enumerate(zip(keys, sizes), 1):
        tree.insert(StateNode(key, parent, depth=depth, n_tokens=depth * 10, label=f"s{depth}", size=size))
        parent = key
    return tree, keys


def test_keys_chain_parent_and_tokens():
    assert node_key("root", [1, 2, 3]) != node_key("root", [1, 2, 4])
    assert node_key("root", [12, 3]) != node_key("root", [1, 23])  # token boundaries matter
    first = path_keys("root", [[1], [2]])
    assert first[0] == node_key("root", [1])
    assert first[1] == node_key(first[0], [2])
    assert path_keys("other-fingerprint", [[1], [2]])[1] != first[1]


def test_match_returns_deepest_first_and_partial_paths():
    tree, keys = build([10, 20, 30])
    query = path_keys("root", [[0], [1], [99]])  # shares two segments, then differs
    assert [n.depth for n in tree.match(query)] == [2, 1]
    assert tree.match(path_keys("root", [[5]])) == []


def stored_path(store: StateStore, sizes: list[int], budget: int = 10**9) -> list[StateNode]:
    nodes, parent = [], "root"
    for depth, key in enumerate(path_keys("root", [[i] for i in range(len(sizes))]), 1):
        node = StateNode(key, parent, depth, depth * 10, f"s{depth}", sizes[depth - 1])
        store.put(node, b"x" * node.size, budget_bytes=budget, protected=set())
        nodes.append(node)
        parent = key
    return nodes


def test_store_evicts_leaves_before_inner_nodes_least_used_first(tmp_path):
    store = StateStore(tmp_path, "root")
    path = stored_path(store, [10, 20, 30])
    branch = StateNode(node_key(path[0].key, [7]), path[0].key, 2, 15, "b", 25)
    store.put(branch, b"y" * 25, budget_bytes=10**9, protected=set())
    store.record_use(path[2])  # the deep leaf is used once, the branch never
    assert store.trim(85 - 1, set()) == [branch.key]
    tree = ChunkStateTree("root")
    store.apply(tree, store.changes(0))
    assert len(tree) == 3 and tree.get(path[0].key).children == 1
    assert store.trim(0, set())[0] == path[2].key  # the last leaf, then the inner nodes
    assert store.changes(0).written == [] and store.blob_path(path[0].key) is None
    store.close()


def test_pinned_nodes_are_never_evicted(tmp_path):
    store = StateStore(tmp_path, "root")
    path = stored_path(store, [10, 20])
    assert store.trim(0, {node.key for node in path}) == []
    assert len(store.trim(0, set())) == 2
    store.close()


def test_budget_holds_over_every_store_on_the_folder(tmp_path):
    first, second = StateStore(tmp_path, "root"), StateStore(tmp_path, "root")
    stored_path(first, [40, 40])
    evicted = second.put(StateNode(node_key("root", [9]), "root", 1, 5, "c", 40), b"z" * 40,
                         budget_bytes=100, protected=set())
    assert len(evicted) == 1 and second.trim(100, set()) == []
    tree = ChunkStateTree("root")
    first.apply(tree, first.changes(0))
    assert tree.bytes == 80 and len(tree) == 2
    first.close()
    second.close()


def test_remove_keeps_children_reachable_by_key():
    tree, keys = build([10, 20, 30])
    tree.remove(keys[1])
    assert [n.depth for n in tree.match(keys)] == [3, 1]
    assert tree.bytes == 40


def test_the_eviction_policy_is_one_object_the_store_orders_by(tmp_path):
    from percache_core.eviction import LRU
    from percache_core.storage import Bookkeeping, Budget, Store

    lfu, lru = Store(tmp_path / "lfu"), Store(tmp_path / "lru", policy=LRU)
    for store in (lfu, lru):
        store.put("r:often", 1, bookkeeping=Bookkeeping(size=10))
        store.put("r:once", 2, bookkeeping=Bookkeeping(size=10))
        for _ in range(3):
            store.note_use("r:often", when=100.0)
        store.note_use("r:once", when=200.0)  # used last, but once
        evicted = store.put("r:new", 3, bookkeeping=Bookkeeping(size=10), budget=Budget("r:", 20))
        assert evicted == (["r:once"] if store is lfu else ["r:often"])
        store.close()
