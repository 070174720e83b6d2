"""llama.cpp's slot files (a sequence's state as ``llama-server`` saves it): the tokens a
file holds (:func:`slot_file_tokens`), a file cut to its first tokens
(:func:`slot_file_prefix`) or to the positions after a parent's (:func:`slot_file_slice`),
and slices joined back into one file (:func:`slot_file_join`), as a server's chunk states
are taken from one saved slot and restored from their path's slices.

The file is llama.cpp's sequence-state file: magic, version, token count, tokens, then each
KV cache's cells (``state_write``: per cache, per stream, the cells' positions and sequence
ids, then per layer the K rows and the V rows, or V element by element when transposed).

On a sliding-window model (Gemma 3: a *window* of 512) the sliding-window cache does not
write the cells its window has passed: a slot saved after N tokens holds only the last
*window* of them there. No later token attends to those cells, but where they are missing a
restored slot lays its cells out otherwise than a fresh prefill does, and the attention then
sums in another order: measured on Gemma 3 270M through the server, 4 of 6 restores of
600-896 tokens gave the fresh text and top log-probabilities without them, 6 of 6 with them
put back as zero cells. :func:`slot_file_join` puts them back so.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class _Rows:
    """One layer's K or V rows: its *header* as written, then *groups* runs of one row of
    *size* bytes per cell (1 run; V transposed: one per embedding element)."""

    header: bytes
    size: int
    groups: int
    data: memoryview  # groups x cells x size

    def rows(self, count: int, keep: list[int]) -> list[bytes | memoryview]:
        """The rows of the cells *keep* (of *count*), run by run."""
        out: list[bytes | memoryview] = []
        contiguous = bool(keep) and keep == list(range(keep[0], keep[0] + len(keep)))
        for group in range(self.groups):
            base = group * count * self.size
            if contiguous:  # one copy
                out.append(self.data[base + keep[0] * self.size : base + (keep[-1] + 1) * self.size])
            else:
                out += [self.data[base + i * self.size : base + (i + 1) * self.size] for i in keep]
        return out


@dataclass(frozen=True)
class _Cache:
    """One KV cache's cells: (position, sequence id) per cell in file order, and per layer
    its K rows, then per layer its V rows."""

    cells: list[tuple[int, int]]
    v_trans: int
    layers: list[_Rows]  # K of every layer, then V of every layer


def slot_file_tokens(saved: bytes) -> tuple[int, ...]:
    """The tokens the slot file *saved* holds. The server writes its token list packed: -1,
    the packing's version, the count, the tokens, then its media (none here); a plain list
    (as this module writes, and older servers wrote) is read as it is."""
    (count,) = struct.unpack_from("<I", saved, 8)
    listed = struct.unpack_from(f"<{count}i", saved, 12)
    if count >= 3 and listed[0] == -1:
        return listed[3 : 3 + listed[2]]
    return listed


def slot_file_cells(saved: bytes) -> bytes:
    """The KV caches' part of the slot file *saved* (what follows its token list)."""
    (count,) = struct.unpack_from("<I", saved, 8)
    return saved[12 + 4 * count :]


def slot_file_prefix(saved: bytes, tokens: Sequence[int], window: int = 0) -> bytes | None:
    """The slot file of the first ``len(tokens)`` tokens of the slot file *saved*, or None
    where *saved* does not hold every cell those positions need (see
    :func:`slot_file_slice`) or cannot be read; as a restore loads it (see
    :func:`slot_file_join`)."""
    cut = _cut(saved, tokens, 0, window)
    if cut is None:
        return None
    magic, version, caches = cut
    joined = [_join([cache], len(tokens), window) for cache in caches]
    return None if None in joined else _write(magic, version, tokens, joined)  # type: ignore[arg-type]


def slot_file_slice(saved: bytes, tokens: Sequence[int], start: int, window: int = 0) -> bytes | None:
    """The cells of positions ``start .. len(tokens)-1`` of the slot file *saved* (which
    holds *tokens* first), as a slot file of those tokens: with its parent's slices before
    it, :func:`slot_file_join` makes the prefix's file again. None where *saved* lacks a
    cell of them (on a sliding-window model, *window* > 0: a cell of the last *window*
    positions; older ones a sliding-window cache may lack) or cannot be read."""
    cut = _cut(saved, tokens, start, window)
    return None if cut is None else _write(cut[0], cut[1], tokens[start:], cut[2])


def _cut(saved: bytes, tokens: Sequence[int], start: int, window: int) -> tuple[int, int, list[_Cache]] | None:
    """Magic, version and the caches of *saved* with the cells of positions ``start ..
    len(tokens)-1`` only (see :func:`slot_file_slice`), or None."""
    try:
        if slot_file_tokens(saved)[: len(tokens)] != tuple(tokens):
            return None  # the slot holds other tokens
        magic, version, caches = _read(saved)
        kept = [_select(cache, start, len(tokens), window) for cache in caches]
    except (struct.error, ValueError):
        return None
    return None if None in kept else (magic, version, kept)  # type: ignore[return-value]


def slot_file_join(slices: Sequence[bytes], window: int = 0) -> bytes | None:
    """One slot file from the slot files of consecutive positions *slices* (root first, as
    :func:`slot_file_slice` cut them), with zero cells where a sliding-window cache lacks
    one its window has passed (*window* > 0), so that it is laid out as a fresh prefill's;
    None where they do not fit together."""
    try:
        parsed = [_read(data) for data in slices]
    except (struct.error, ValueError):
        return None
    if not parsed or len({(magic, version, len(caches)) for magic, version, caches in parsed}) != 1:
        return None
    tokens: list[int] = []
    for data in slices:
        tokens += slot_file_tokens(data)
    caches = [_join([p[2][index] for p in parsed], len(tokens), window) for index in range(len(parsed[0][2]))]
    joined = [cache for cache in caches if cache is not None]
    if len(joined) != len(caches):
        return None
    return _write(parsed[0][0], parsed[0][1], tokens, joined)


def _read(saved: bytes) -> tuple[int, int, list[_Cache]]:
    """Magic, version and KV caches of a slot file. Raises ValueError or struct.error on
    what it cannot read (several streams, a cell of several sequences, bytes left over)."""
    magic, _, count = struct.unpack_from("<III", saved)
    data = memoryview(saved)
    offset = 12 + 4 * count
    caches = []

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    def rows(header_fmt: str, size: int, groups: int, cell_count: int, header: tuple[int, ...]) -> _Rows:
        nonlocal offset
        length = groups * cell_count * size
        if offset + length > len(data):
            raise ValueError("truncated rows")
        block = _Rows(struct.pack(header_fmt, *header), size, groups, data[offset : offset + length])
        offset += length
        return block

    while offset < len(data):
        n_stream, cell_count = take("<II")
        if n_stream != 1:
            raise ValueError(f"{n_stream} streams")
        cells = []
        for _ in range(cell_count):
            pos, n_seq = take("<iI")
            if n_seq != 1:
                raise ValueError("a cell of several sequences")
            cells.append((pos, take("<i")[0]))
        v_trans, n_layer = take("<II")
        layers = []
        for _ in range(n_layer):
            header = take("<iQ")
            layers.append(rows("<iQ", header[1], 1, cell_count, header))
        for _ in range(n_layer):
            if v_trans:
                header = take("<iII")
                layers.append(rows("<iII", header[1], header[2], cell_count, header))
            else:
                header = take("<iQ")
                layers.append(rows("<iQ", header[1], 1, cell_count, header))
        caches.append(_Cache(cells, v_trans, layers))
    if offset != len(data) or not caches:
        raise ValueError("unread bytes")
    return magic, struct.unpack_from("<I", saved, 4)[0], caches


def _select(cache: _Cache, start: int, end: int, window: int) -> _Cache | None:
    """*cache* with only the cells of positions ``start .. end-1``; None where one is
    missing or doubled (with a *window*, cells before ``end - window`` may be missing)."""
    keep = [i for i, (pos, _) in enumerate(cache.cells) if start <= pos < end]
    held = sorted(cache.cells[i][0] for i in keep)
    needed = list(range(max(start, end - window) if window else start, end))
    if len(set(held)) != len(held) or held[len(held) - len(needed) :] != needed:
        return None
    count = len(cache.cells)
    layers = [
        _Rows(block.header, block.size, block.groups, memoryview(b"".join(block.rows(count, keep))))
        for block in cache.layers
    ]
    return _Cache([cache.cells[i] for i in keep], cache.v_trans, layers)


def _join(parts: list[_Cache], n_tokens: int, window: int) -> _Cache | None:
    """The cells of *parts* one after another, as the cells of positions ``0 ..
    n_tokens-1`` in order: positions a part lacks before ``n_tokens - window`` (with a
    *window*) get zero cells; None where the layouts differ or another cell is missing."""
    first = parts[0]
    if any(p.v_trans != first.v_trans or [b.header for b in p.layers] != [b.header for b in first.layers] for p in parts):
        return None
    cells: list[tuple[int, int]] = []
    pieces: list[tuple[int, _Cache | None]] = []  # (zero cells, None) or (0, a part), in position order
    for part in parts:
        positions = [pos for pos, _ in part.cells]
        if not positions:
            continue
        if positions != list(range(positions[0], positions[0] + len(positions))) or positions[0] < len(cells):
            return None  # not one run of positions after the ones before
        gap = positions[0] - len(cells)
        if gap:
            if not window or positions[0] > n_tokens - window:
                return None  # a cell a later token attends to is missing
            pieces.append((gap, None))
            cells += [(pos, 0) for pos in range(len(cells), positions[0])]
        pieces.append((0, part))
        cells += part.cells
    if len(cells) != n_tokens:
        return None
    layers = []
    for index, block in enumerate(first.layers):
        runs: list[bytes | memoryview] = []
        for group in range(block.groups):
            for zeros, part in pieces:
                if part is None:
                    runs.append(bytes(zeros * block.size))
                    continue
                size = len(part.cells) * block.size
                runs.append(part.layers[index].data[group * size : (group + 1) * size])
        layers.append(_Rows(block.header, block.size, block.groups, memoryview(b"".join(runs))))
    return _Cache(cells, first.v_trans, layers)


def _write(magic: int, version: int, tokens: Sequence[int], caches: list[_Cache]) -> bytes:
    """A slot file of *tokens* (a plain list) and *caches*."""
    out: list[bytes | memoryview] = [struct.pack("<III", magic, version, len(tokens)), struct.pack(f"<{len(tokens)}i", *tokens)]
    for cache in caches:
        out.append(struct.pack("<II", 1, len(cache.cells)))
        out += [struct.pack("<iIi", pos, 1, seq) for pos, seq in cache.cells]
        out.append(struct.pack("<II", cache.v_trans, len(cache.layers) // 2))
        for block in cache.layers:
            out += [block.header, block.data]
    return b"".join(out)
