"""The chunk-state tree's pure logic: keys, matching, LFU eviction of unpinned leaves."""

from percache_core.kv.tree import ChunkStateTree, node_key, path_keys


def build(sizes: list[int]) -> tuple[ChunkStateTree, list[str]]:
    tree = ChunkStateTree("root")
    keys = path_keys("root", [[i] for i in range(len(sizes))])
    parent = "root"
    for depth, (key, size) in enumerate(zip(keys, sizes), 1):
        tree.insert(key, parent, depth=depth, n_tokens=depth * 10, label=f"s{depth}", size=size)
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


def test_evict_only_leaves_least_frequently_used_first():
    tree, keys = build([10, 20, 30])
    branch = node_key(keys[0], [7])
    tree.insert(branch, keys[0], depth=2, n_tokens=15, label="b", size=25)
    tree.touch(tree.get(keys[2]))  # the deep leaf is used once, the branch never
    removed = tree.evict(budget_bytes=tree.bytes - 1)
    assert [n.key for n in removed] == [branch]
    assert tree.get(keys[0]).children == 1
    removed = tree.evict(budget_bytes=0)
    assert [n.depth for n in removed] == [3, 2, 1]  # leaves first, up the path
    assert tree.bytes == 0 and len(tree) == 0


def test_pinned_nodes_are_never_evicted():
    tree, keys = build([10, 20])
    with tree.pinned(keys):
        assert tree.evict(budget_bytes=0) == []
    assert len(tree.evict(budget_bytes=0)) == 2


def test_remove_keeps_children_reachable_by_key():
    tree, keys = build([10, 20, 30])
    tree.remove(keys[1])
    assert [n.depth for n in tree.match(keys)] == [3, 1]
    assert tree.bytes == 40


def test_eviction_order_is_the_least_used_leaf_at_each_step():
    """The heap-based eviction picks what a full rescan of the unpinned leaves would pick."""
    import random

    rng = random.Random(7)
    for _ in range(20):
        tree = ChunkStateTree("root")
        keys = ["root"]
        for i in range(40):
            parent = rng.choice(keys)
            depth = 1 if parent == "root" else tree.get(parent).depth + 1
            node = tree.insert(f"n{i}", parent, depth=depth, n_tokens=depth, label=str(i), size=rng.randint(1, 9))
            node.hits, node.last_used_at = rng.randint(0, 3), float(rng.randint(0, 5))
            keys.append(node.key)
        pinned = rng.sample(keys[1:], 5)
        budget = tree.bytes // 3
        expected, bytes_left = [], tree.bytes
        shadow = {n.key: [n.parent_key, n.size, n.hits, n.last_used_at] for n in tree.nodes}
        while bytes_left > budget:
            leaves = [k for k in shadow if k not in pinned and not any(v[0] == k for v in shadow.values())]
            if not leaves:
                break
            victim = min(leaves, key=lambda k: (shadow[k][2], shadow[k][3], k))
            expected.append(victim)
            bytes_left -= shadow.pop(victim)[1]
        with tree.pinned(pinned):
            evicted = [n.key for n in tree.evict(budget)]
        assert evicted == expected and tree.bytes == bytes_left
