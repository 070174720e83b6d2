"""The cells of a llama.cpp sequence state, as both llama.cpp engines keep them: read,
cut to a range of positions and laid out again as a fresh prefill lays them out.

A sequence's state (``llama_state_seq_get_data`` in the process, the part of a slot file
after its token list on a server) is, per KV cache (one; a sliding-window model has two:
the full-attention cache, then the sliding-window one): the stream count (1; a server
whose slots have caches of their own, ``--no-kv-unified``, writes one per slot, each with
its cell count, and only the sequence's own stream has cells: they are read into the
restoring sequence's stream whichever it is), the cell count, each cell's position and
sequence id, then per layer the K rows and per layer the V rows (V element by element when
transposed, as with flash attention off).

**Why the layout matters.** A sliding-window cache does not write the cells its window has
passed: a state saved after N tokens holds only the last *window* of them there. No later
token attends to those cells, but a restore that lacks them puts the others in other cells
than a fresh prefill does (llama.cpp places restored cells from the cache's head), and the
attention then sums in another order: measured on Gemma 3 270M, in the process (a
1,064-token state restored, 1,096 tokens prefilled: other logits, 0.74 apart, and another
answer) and through the server. With the missing cells put back as zero cells before the
state is loaded (:func:`laid_out_as_prefill`), every cell sits where a fresh prefill puts
it and the logits are bit-identical (the engines' start-up round trips check this on each
build).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rows:
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

    def pieces(self) -> list[bytes | memoryview]:
        """Its row bytes as written after the header."""
        return [self.data]


@dataclass(frozen=True)
class JoinedRows:
    """One layer's K or V rows joined from several caches' (:func:`join_cells`), kept as
    the *runs* to write one after another: a restore copies them once, into the file or
    state it writes, not once per layer first."""

    header: bytes
    runs: tuple[bytes | memoryview, ...]

    def pieces(self) -> list[bytes | memoryview]:
        """Its row bytes as written after the header."""
        return list(self.runs)


@dataclass(frozen=True)
class CacheCells:
    """One KV cache's cells: (position, sequence id) per cell in file order, and per layer
    its K rows, then per layer its V rows."""

    cells: list[tuple[int, int]]
    v_trans: int
    layers: Sequence[Rows | JoinedRows]  # K of every layer, then V of every layer (read: Rows)
    streams: int = 1  # the cache's stream count (written back with the cells in the first)


def read_caches(saved: bytes | memoryview, offset: int) -> list[CacheCells]:
    """The KV caches of a sequence state whose cells start at *offset* of *saved*. Raises
    ValueError or struct.error on what it cannot read (cells in several streams, a cell of
    several sequences, cells with extra fields, bytes left over)."""
    data = memoryview(saved)
    caches = []

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    def rows(header_fmt: str, size: int, groups: int, cell_count: int, header: tuple[int, ...]) -> Rows:
        nonlocal offset
        length = groups * cell_count * size
        if offset + length > len(data):
            raise ValueError("truncated rows")
        block = Rows(struct.pack(header_fmt, *header), size, groups, data[offset : offset + length])
        offset += length
        return block

    def cache(cell_count: int, streams: int) -> CacheCells:
        cells = []
        for _ in range(cell_count):
            pos, n_seq = take("<iI")
            if n_seq != 1:
                raise ValueError("a cell of several sequences")
            cells.append((pos, take("<i")[0]))
        v_trans, n_layer = take("<II")
        if v_trans > 1:
            raise ValueError("not a cell layout this module reads")
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
        return CacheCells(cells, v_trans, layers, streams)

    while offset < len(data):
        n_stream = take("<I")[0]
        found = None
        for _ in range(n_stream):
            cell_count = take("<I")[0]
            if cell_count and found is not None:
                raise ValueError("cells in several streams")
            if cell_count:
                found = cache(cell_count, n_stream)
        if found is None:
            raise ValueError("a cache without cells")
        caches.append(found)
    if offset != len(data) or not caches:
        raise ValueError("unread bytes")
    return caches


def write_caches(caches: Sequence[CacheCells]) -> list[bytes | memoryview]:
    """The bytes of *caches* (to join after a header)."""
    out: list[bytes | memoryview] = []
    for cache in caches:
        out.append(struct.pack("<II", cache.streams, len(cache.cells)))
        out += [struct.pack("<iIi", pos, 1, seq) for pos, seq in cache.cells]
        out.append(struct.pack("<II", cache.v_trans, len(cache.layers) // 2))
        for block in cache.layers:
            out.append(block.header)
            out += block.pieces()
        out += [struct.pack("<I", 0)] * (cache.streams - 1)  # the other streams: empty
    return out


def select_cells(cache: CacheCells, start: int, end: int, window: int) -> CacheCells | None:
    """*cache* with only the cells of positions ``start .. end-1``; None where one is
    missing or doubled (with a *window*, cells before ``end - window`` may be missing)."""
    keep = [i for i, (pos, _) in enumerate(cache.cells) if start <= pos < end]
    held = sorted(cache.cells[i][0] for i in keep)
    needed = list(range(max(start, end - window) if window else start, end))
    if len(set(held)) != len(held) or held[len(held) - len(needed) :] != needed:
        return None
    count = len(cache.cells)
    layers = [
        Rows(block.header, block.size, block.groups, memoryview(b"".join(block.rows(count, keep))))
        for block in map(_as_read, cache.layers)
    ]
    return CacheCells([cache.cells[i] for i in keep], cache.v_trans, layers, cache.streams)


def join_cells(parts: list[CacheCells], end: int, window: int, start: int = 0) -> CacheCells | None:
    """The cells of *parts* one after another, as the cells of positions ``start ..
    end-1`` in order: positions a part lacks before ``end - window`` (with a *window*) get
    zero cells; None where the layouts differ or another cell is missing."""
    first = parts[0]
    if any(p.v_trans != first.v_trans or [b.header for b in p.layers] != [b.header for b in first.layers] for p in parts):
        return None
    cells: list[tuple[int, int]] = []
    pieces: list[tuple[int, CacheCells | None]] = []  # (zero cells, None) or (0, a part), in position order
    for part in parts:
        positions = [pos for pos, _ in part.cells]
        if not positions:
            continue
        following = start + len(cells)  # the position the next cell must have
        if positions != list(range(positions[0], positions[0] + len(positions))) or positions[0] < following:
            return None  # not one run of positions after the ones before
        gap = positions[0] - following
        if gap:
            if not window or positions[0] > end - window:
                return None  # a cell a later token attends to is missing
            pieces.append((gap, None))
            cells += [(pos, part.cells[0][1]) for pos in range(following, positions[0])]
        pieces.append((0, part))
        cells += part.cells
    if len(cells) != end - start:
        return None
    layers: list[Rows | JoinedRows] = []
    for index, block in enumerate(map(_as_read, first.layers)):
        runs: list[bytes | memoryview] = []
        for group in range(block.groups):
            for zeros, part in pieces:
                if part is None:
                    runs.append(bytes(zeros * block.size))
                    continue
                size = len(part.cells) * block.size
                runs.append(_as_read(part.layers[index]).data[group * size : (group + 1) * size])
        layers.append(JoinedRows(block.header, tuple(runs)))
    return CacheCells(cells, first.v_trans, layers, first.streams)


def _as_read(block: Rows | JoinedRows) -> Rows:
    """*block* as read from a state (cut and joined only so; a joined one is only written)."""
    if not isinstance(block, Rows):
        raise TypeError("joined rows are written, not cut or joined again")
    return block


def laid_out_as_prefill(state: bytes, header: int, start: int, end: int, window: int) -> tuple[bytes, int] | None:
    """The sequence state *state* (cells after *header* bytes) of positions ``start ..
    end-1``, with zero cells where a sliding-window cache lacks cells its *window* has
    passed, so that loaded into a sequence of *start* tokens its cells lie as a fresh
    prefill's do; and the position after the last zero cell (*start*: none). *state* itself
    where no cell is missing (or the model has no window); None where it cannot be read or
    lacks a cell that a later token attends to. The zero cells stand in for cells no later
    token attends to: a sequence cut back to fewer tokens must not attend to them either.

    >>> laid_out_as_prefill(b"abc", 0, 0, 3, 0)
    (b'abc', 0)
    """
    if not window:
        return state, start
    try:
        caches = read_caches(state, header)
    except (struct.error, ValueError):
        return None
    firsts = [cache.cells[0][0] if cache.cells else end for cache in caches]
    if all([pos for pos, _ in cache.cells] == list(range(start, end)) for cache in caches):
        return state, start
    padded = [join_cells([cache], end, window, start) for cache in caches]
    if any(cache is None for cache in padded):
        return None
    return b"".join([bytes(state[:header]), *write_caches(padded)]), max(firsts)  # type: ignore[arg-type]
