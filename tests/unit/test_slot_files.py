"""Slot files of llama-server (llama.cpp's sequence-state files) cut to a prefix: pure logic
on files built here in the same layout."""

from __future__ import annotations

import struct

from percache_core.serving.slot_files import slot_file_prefix

MAGIC, VERSION = 0x67677371, 2


def section(positions: list[int], *, layers: int = 2, k_row: int = 3, v_row: int = 2, v_trans: bool = False) -> bytes:
    """One KV cache's state of one sequence: each cell's K row is bytes of its position."""
    out = [struct.pack("<II", 1, len(positions))]
    out += [struct.pack("<iIi", pos, 1, 0) for pos in positions]
    out.append(struct.pack("<II", int(v_trans), layers))
    for layer in range(layers):
        out.append(struct.pack("<iQ", 1, k_row))
        out += [bytes([pos % 256, layer, 0])[:k_row] for pos in positions]
    for layer in range(layers):
        if not v_trans:
            out.append(struct.pack("<iQ", 1, v_row))
            out += [bytes([pos % 256, 100 + layer])[:v_row] for pos in positions]
        else:
            out.append(struct.pack("<iII", 1, 1, 2))  # 1-byte elements, 2 of them per cell
            out += [bytes([pos % 256]) for _ in range(2) for pos in positions]
    return b"".join(out)


def slot_file(tokens: list[int], *sections: bytes) -> bytes:
    return struct.pack("<III", MAGIC, VERSION, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + b"".join(sections)


def test_a_prefix_keeps_only_its_cells_and_tokens() -> None:
    tokens = [10, 11, 12, 13, 14, 15]
    full = slot_file(tokens, section(list(range(6))), section(list(range(6)), v_trans=True))
    cut = slot_file_prefix(full, tokens[:4])
    assert cut is not None
    assert cut == slot_file(tokens[:4], section(list(range(4))), section(list(range(4)), v_trans=True))


def test_a_file_that_lacks_a_cell_of_the_prefix_is_refused() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    window_passed = section([3, 4, 5])  # a sliding-window cache saved after it moved on
    assert slot_file_prefix(slot_file(tokens, section(list(range(6))), window_passed), tokens[:4]) is None
    assert slot_file_prefix(slot_file(tokens, section(list(range(6))), window_passed), tokens[:2]) is None


def test_an_unreadable_file_is_refused() -> None:
    tokens = [1, 2, 3]
    good = slot_file(tokens, section([0, 1, 2]))
    assert slot_file_prefix(good[:-1], tokens[:2]) is None  # truncated
    assert slot_file_prefix(good + b"x", tokens[:2]) is None  # bytes after the caches
    assert slot_file_prefix(b"\0" * 8, tokens[:2]) is None
