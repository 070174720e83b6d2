"""llama.cpp's slot files (a sequence's state as ``llama-server`` saves it): the tokens a
file holds (:func:`slot_file_tokens`) and a file cut to its first tokens
(:func:`slot_file_prefix`), as a server's chunk states are taken from one saved slot.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence


def slot_file_prefix(saved: bytes, tokens: Sequence[int]) -> bytes | None:
    """The slot file of the first ``len(tokens)`` tokens of the slot file *saved*, or None
    where *saved* does not hold every cell of those positions (a sliding-window cache drops
    the cells its window has passed when a slot is saved; an unknown cache layout cannot
    be read). The file is llama.cpp's sequence-state file: magic, version, token count,
    tokens (*tokens* here, as a plain list), then each KV cache's cells (see
    :func:`_prefix_cells`), kept only for positions before ``len(tokens)``."""
    try:
        magic, version, count = struct.unpack_from("<III", saved)
        if slot_file_tokens(saved)[: len(tokens)] != tuple(tokens):
            return None  # the slot holds other tokens
        cells = _prefix_cells(memoryview(saved)[12 + 4 * count :], len(tokens))
    except (struct.error, ValueError):
        return None
    if cells is None:
        return None
    return struct.pack("<III", magic, version, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + cells


def slot_file_tokens(saved: bytes) -> tuple[int, ...]:
    """The tokens the slot file *saved* holds. The server writes its token list packed: -1,
    the packing's version, the count, the tokens, then its media (none here); a plain list
    (as :func:`slot_file_prefix` writes, and older servers wrote) is read as it is."""
    (count,) = struct.unpack_from("<I", saved, 8)
    listed = struct.unpack_from(f"<{count}i", saved, 12)
    if count >= 3 and listed[0] == -1:
        return listed[3 : 3 + listed[2]]
    return listed


def _prefix_cells(data: memoryview, n_tokens: int) -> bytes | None:
    """The KV caches' state of one sequence (llama.cpp's ``state_write``: per cache, per
    stream, the cells' positions and sequence ids, then per layer the K rows and the V rows,
    or V by element when transposed) with only the cells of positions ``0 .. n_tokens-1``;
    None when a cache lacks one of them. Raises ValueError on what it cannot read."""
    out: list[bytes] = []
    offset = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    while offset < len(data):
        (n_stream,) = take("<I")
        if n_stream != 1:
            raise ValueError(f"{n_stream} streams")
        (cell_count,) = take("<I")
        cells = []
        for _ in range(cell_count):
            pos, n_seq = take("<iI")
            if n_seq != 1:
                raise ValueError("a cell of several sequences")
            cells.append((pos, *take("<i")))
        keep = [i for i, (pos, _) in enumerate(cells) if pos < n_tokens]
        if sorted(cells[i][0] for i in keep) != list(range(n_tokens)):
            return None  # a cell of the prefix is missing (or doubled)
        section = [struct.pack("<II", 1, len(keep))]
        section += [struct.pack("<iIi", cells[i][0], 1, cells[i][1]) for i in keep]
        v_trans, n_layer = take("<II")
        section.append(struct.pack("<II", v_trans, n_layer))
        for _ in range(n_layer):
            k_type, k_row = take("<iQ")
            section += [struct.pack("<iQ", k_type, k_row), _rows(data, offset, k_row, cell_count, keep)]
            offset += k_row * cell_count
        for _ in range(n_layer):
            if not v_trans:
                v_type, v_row = take("<iQ")
                section += [struct.pack("<iQ", v_type, v_row), _rows(data, offset, v_row, cell_count, keep)]
                offset += v_row * cell_count
                continue
            v_type, v_el, n_embd = take("<iII")
            section.append(struct.pack("<iII", v_type, v_el, n_embd))
            for _ in range(n_embd):
                section.append(_rows(data, offset, v_el, cell_count, keep))
                offset += v_el * cell_count
        out.append(b"".join(section))
    if offset != len(data) or not out:
        raise ValueError("unread bytes")
    return b"".join(out)


def _rows(data: memoryview, offset: int, size: int, count: int, keep: list[int]) -> bytes:
    """Of the *count* rows of *size* bytes at *offset*, those of the cells *keep*."""
    if offset + size * count > len(data):
        raise ValueError("truncated rows")
    if keep and keep[-1] == len(keep) - 1:  # the leading cells (*keep* ascends): one copy
        return bytes(data[offset : offset + size * len(keep)])
    return b"".join(data[offset + i * size : offset + (i + 1) * size] for i in keep)
