"""Tensor-parallel slices read back at another tp size.

A saved tp slot t holds, for each sliced parameter, rows [t * P, (t + 1) * P) of
each of its parts along the split dimension (P rows per part per rank; a fused q,k,v
weight has three parts, a plain weight one; padding rows of a vocabulary count as
rows). A loader at tp rank t' of T' needs rows [t' * P', (t' + 1) * P') of each
part: it reads the whole saved slice of every slot that overlaps them (never the
full tensor, unless its own slice is the full tensor) and copies the overlap.
Rows that exist only in one layout's padding stay zero.
"""

from __future__ import annotations

import math

import torch

from ..comm.context import get_context


def _offsets(shapes: list) -> list[int]:
    out, offset = [], 0
    for _, shape, *_ in shapes:
        out.append(offset)
        offset += math.prod(shape)
    return out


def _assemble(
    reader, key: str, saved: dict, offset: int, saved_shape, shape, info, dtype
) -> torch.Tensor:
    """This rank's slice (shape `shape`) of one parameter from the saved slices."""
    dim, groups = info["dim"], info["groups"]
    mine_rows, saved_rows = shape[dim] // groups, saved_shape[dim] // groups
    me = get_context().topology.tp_rank
    out = torch.zeros(shape, dtype=dtype)
    numel = math.prod(saved_shape)
    for slot in range(reader.tp):
        lo = max(slot * saved_rows, me * mine_rows)
        hi = min((slot + 1) * saved_rows, (me + 1) * mine_rows)
        if lo >= hi:
            continue
        piece = torch.zeros(numel, dtype=dtype)
        reader.read(key, saved, offset, offset + numel, piece, tp_rank=slot)
        piece = piece.view(saved_shape)
        for part in range(groups):
            out.narrow(dim, part * mine_rows + lo - me * mine_rows, hi - lo).copy_(
                piece.narrow(dim, part * saved_rows + lo - slot * saved_rows, hi - lo)
            )
    return out


def read_tp_entry(
    reader, key: str, entry, saved: dict, begin: int, end: int, out: torch.Tensor
) -> None:
    """Fills `out[: end - begin]` with elements [begin, end) of this rank's vector of
    `entry` (its tp slices back to back), assembled from the saved slices."""
    offset = 0
    for (_, shape, *info), (_, saved_shape, *_), saved_offset in zip(
        entry.layout_info, saved["shapes"], _offsets(saved["shapes"])
    ):
        numel = math.prod(shape)
        lo, hi = max(begin, offset), min(end, offset + numel)
        if lo < hi:
            mine = _assemble(
                reader, key, saved, saved_offset, saved_shape, shape, info[0], out.dtype
            )
            out[lo - begin : hi - begin].copy_(mine.reshape(-1)[lo - offset : hi - offset])
        offset += numel
