"""Slot files of llama-server (llama.cpp's sequence-state files) cut to a prefix: pure logic
on files built here in the same layout."""

from __future__ import annotations

import struct

from percache_core.engines.llama_server.slot_files import slot_file_join, slot_file_prefix, slot_file_slice

MAGIC, VERSION = 0x67677371, 2


def section(
    positions: list[int], *, layers: int = 2, k_row: int = 3, v_row: int = 2, v_trans: bool = False, zero_below: int = 0
) -> bytes:
    """One KV cache's state of one sequence: each cell's K row is bytes of its position
    (zeros for positions below *zero_below*)."""

    def row(pos: int, data: list[int], size: int) -> bytes:
        return bytes(size) if pos < zero_below else bytes(data)[:size]

    out = [struct.pack("<II", 1, len(positions))]
    out += [struct.pack("<iIi", pos, 1, 0) for pos in positions]
    out.append(struct.pack("<II", int(v_trans), layers))
    for layer in range(layers):
        out.append(struct.pack("<iQ", 1, k_row))
        out += [row(pos, [pos % 256, layer, 0], k_row) for pos in positions]
    for layer in range(layers):
        if not v_trans:
            out.append(struct.pack("<iQ", 1, v_row))
            out += [row(pos, [pos % 256, 100 + layer], v_row) for pos in positions]
        else:
            out.append(struct.pack("<iII", 1, 1, 2))  # 1-byte elements, 2 of them per cell
            out += [row(pos, [pos % 256], 1) for _ in range(2) for pos in positions]
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


def test_slices_joined_make_the_prefix_file_again() -> None:
    tokens = [10, 11, 12, 13, 14, 15, 16]
    full = slot_file(tokens, section(list(range(7))), section(list(range(7)), v_trans=True))
    first, second, third = (slot_file_slice(full, tokens[:end], start) for start, end in ((0, 3), (3, 5), (5, 7)))
    assert first == slot_file_prefix(full, tokens[:3])
    assert second == slot_file(tokens[3:5], section([3, 4]), section([3, 4], v_trans=True))  # its own cells only
    assert slot_file_join([first, second, third]) == slot_file_prefix(full, tokens)
    assert slot_file_join([first, second]) == slot_file_prefix(full, tokens[:5])


def test_slices_that_do_not_fit_together_are_refused() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    full = slot_file(tokens, section(list(range(6))))
    head, tail = slot_file_slice(full, tokens[:2], 0), slot_file_slice(full, tokens, 4)
    assert head is not None and tail is not None
    assert slot_file_join([head, tail]) is None  # positions 2 and 3 missing
    assert slot_file_join([tail]) is None  # not from position 0
    other_layout = slot_file(tokens, section(list(range(6)), k_row=2))
    assert slot_file_join([head, slot_file_slice(other_layout, tokens, 2)]) is None
    assert slot_file_join([head, b"\0" * 8]) is None and slot_file_join([]) is None
    assert slot_file_slice(full, [9, 9], 0) is None  # the slot holds other tokens


def test_cells_a_sliding_window_passed_come_back_as_zero_cells() -> None:
    tokens, window = list(range(100, 110)), 4
    # saved after 10 tokens: the sliding-window cache (the second) kept only its last 4 cells
    for v_trans in (False, True):
        saved = slot_file(tokens, section(list(range(10))), section([6, 7, 8, 9], v_trans=v_trans))
        assert slot_file_prefix(saved, tokens) is None  # without the window: cells missing
        expected = slot_file(tokens, section(list(range(10))), section(list(range(10)), v_trans=v_trans, zero_below=6))
        assert slot_file_prefix(saved, tokens, window) == expected  # laid out as a fresh prefill's
        assert slot_file_prefix(saved, tokens[:8], window) is None  # the state at 8 needs cells 4 and 5
        # slices from saves at their own points: [0, 6) saved at 6, [6, 10) saved at 10
        first = slot_file(tokens[:6], section(list(range(6))), section([2, 3, 4, 5], v_trans=v_trans))
        head, tail = slot_file_slice(first, tokens[:6], 0, window), slot_file_slice(saved, tokens, 6, window)
        assert head is not None and tail is not None
        joined = slot_file(tokens, section(list(range(10))), section(list(range(10)), v_trans=v_trans, zero_below=2))
        assert slot_file_join([head, tail], window) == joined
        assert slot_file_join([head, tail]) is None  # no window: the missing cells are refused


def test_an_in_process_state_gets_zero_cells_where_the_window_left_none() -> None:
    from percache_core.kv.state_cells import laid_out_as_prefill

    header = struct.pack("<Ii", 0xAF143CD8, 0)  # an in-process state's magic and sequence id
    whole = header + section(list(range(6)), v_trans=True) + section([3, 4, 5], v_trans=True)
    laid_out = laid_out_as_prefill(whole, 8, 0, 6, window=3)
    expected = header + section(list(range(6)), v_trans=True) + section(list(range(6)), v_trans=True, zero_below=3)
    assert laid_out == (expected, 3)
    # a slice of positions 2..5: zero cells from its start
    piece = header + section([2, 3, 4, 5]) + section([3, 4, 5])
    assert laid_out_as_prefill(piece, 8, 2, 6, window=3) == (header + section([2, 3, 4, 5]) + section([2, 3, 4, 5], zero_below=3), 3)
    # every cell there: the state itself; a model without a window: never read
    assert laid_out_as_prefill(expected, 8, 0, 6, window=3) == (expected, 0)
    assert laid_out_as_prefill(b"not a state", 8, 0, 6, window=0) == (b"not a state", 0)
    # a cell within the window missing, or bytes that do not read: refused
    assert laid_out_as_prefill(header + section(list(range(6))) + section([4, 5]), 8, 0, 6, window=3) is None
    assert laid_out_as_prefill(whole[:-1], 8, 0, 6, window=3) is None
