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

from ...kv.state_cells import CacheCells, join_cells, read_caches, select_cells, write_caches


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
    joined = [join_cells([cache], len(tokens), window) for cache in caches]
    return None if None in joined else _write(magic, version, tokens, joined)  # type: ignore[arg-type]


def slot_file_slice(saved: bytes, tokens: Sequence[int], start: int, window: int = 0) -> bytes | None:
    """The cells of positions ``start .. len(tokens)-1`` of the slot file *saved* (which
    holds *tokens* first), as a slot file of those tokens: with its parent's slices before
    it, :func:`slot_file_join` makes the prefix's file again. None where *saved* lacks a
    cell of them (on a sliding-window model, *window* > 0: a cell of the last *window*
    positions; older ones a sliding-window cache may lack) or cannot be read."""
    cut = _cut(saved, tokens, start, window)
    return None if cut is None else _write(cut[0], cut[1], tokens[start:], cut[2])


def _cut(saved: bytes, tokens: Sequence[int], start: int, window: int) -> tuple[int, int, list[CacheCells]] | None:
    """Magic, version and the caches of *saved* with the cells of positions ``start ..
    len(tokens)-1`` only (see :func:`slot_file_slice`), or None."""
    try:
        if slot_file_tokens(saved)[: len(tokens)] != tuple(tokens):
            return None  # the slot holds other tokens
        magic, version, caches = _read(saved)
        kept = [select_cells(cache, start, len(tokens), window) for cache in caches]
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
    caches = [join_cells([p[2][index] for p in parsed], len(tokens), window) for index in range(len(parsed[0][2]))]
    joined = [cache for cache in caches if cache is not None]
    if len(joined) != len(caches):
        return None
    return _write(parsed[0][0], parsed[0][1], tokens, joined)


def _read(saved: bytes) -> tuple[int, int, list[CacheCells]]:
    """Magic, version and KV caches of a slot file (see :func:`~percache_core.kv.state_cells.read_caches`)."""
    magic, version, count = struct.unpack_from("<III", saved)
    return magic, version, read_caches(saved, 12 + 4 * count)


def _write(magic: int, version: int, tokens: Sequence[int], caches: list[CacheCells]) -> bytes:
    """A slot file of *tokens* (a plain list) and *caches*."""
    header = [struct.pack("<III", magic, version, len(tokens)), struct.pack(f"<{len(tokens)}i", *tokens)]
    return b"".join(header + write_caches(caches))
