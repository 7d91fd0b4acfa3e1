"""Which tokens of the full sequence each cp rank holds, and which blocks meet in the ring.

Layouts (which chunks of the full sequence a rank holds, `SequenceLayout`):
    contiguous  cp chunks, rank r holds chunk r. Causal work grows with r.
    zigzag      2*cp chunks, rank r holds chunks r and 2*cp-1-r: an early and a late
                chunk, so every rank has the same number of causal (query, key) pairs.

Causal masks follow global positions, exact for either layout: a rank's tokens ascend,
so its own block is causal by local index, and every other chunk pair is entirely
visible (a leading run of the held block's keys) or entirely in the future (skipped):
`_step_blocks` lists, for each ring step, the `RingBlock`s a rank computes.

Packed documents come as `doc_ids` (batch, local_seq), sharded like the tokens
(`document_ids` of the full position ids, then `shard_sequence`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..comm.topology import ALONE


class SequenceLayout(str, enum.Enum):
    """How the full sequence is cut into the cp ranks' shards (see the module docstring)."""

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


def _layout(layout) -> SequenceLayout:
    try:
        return SequenceLayout(layout)
    except ValueError:
        raise ValueError(
            f"layout={layout!r}: use one of {[m.value for m in SequenceLayout]}"
        ) from None


def _ring(group) -> tuple[int, int, list[int]]:
    """(this rank's index in the group, the group's size, the group's global ranks)."""
    if group is ALONE or not dist.is_initialized():
        return 0, 1, [dist.get_rank() if dist.is_initialized() else 0]
    index = dist.get_rank(group)
    if index < 0:
        raise ValueError(
            f"ring attention: global rank {dist.get_rank()} is not in the "
            f"given group: call it on the group's ranks only"
        )
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    return index, len(ranks), ranks


def chunk_ids(rank: int, size: int, layout="zigzag") -> list[int]:
    """The chunks of the full sequence that `rank` of `size` holds, in local order.
    The full sequence is cut into 2*size chunks (zigzag) or size chunks (contiguous)."""
    if _layout(layout) is SequenceLayout.ZIGZAG:
        return [rank, 2 * size - 1 - rank]
    return [rank]


def _n_chunks(size: int, layout) -> int:
    return 2 * size if _layout(layout) is SequenceLayout.ZIGZAG else size


def global_positions(
    rank: int, size: int, local_seq: int, layout="zigzag", device=None
) -> torch.Tensor:
    """int64 (local_seq,): the full-sequence position of each of `rank`'s tokens. Local."""
    ids = chunk_ids(rank, size, layout)
    chunk = local_seq // len(ids)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in ids])


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document ids of packed rows: int64 (rows, seq), the number of
    document starts (position 0) up to each token. Give it the FULL sequence, then
    `shard_sequence(ids, 1)` like the tokens. Local."""
    if position_ids.dim() != 2 or position_ids.dtype.is_floating_point:
        raise ValueError(
            f"document_ids: position_ids must be integers shaped (rows, seq); "
            f"got {position_ids.dtype} of shape {tuple(position_ids.shape)}"
        )
    return (position_ids == 0).cumsum(dim=1)


def check_position_ids(position_ids, idx):
    """Raises if position_ids (when given) is not an integer tensor shaped like idx."""
    if position_ids is None:
        return
    if position_ids.dtype.is_floating_point or tuple(position_ids.shape) != tuple(idx.shape):
        raise ValueError(
            f"position_ids must be integers shaped like the token ids "
            f"{tuple(idx.shape)}; got {position_ids.dtype} of shape "
            f"{tuple(position_ids.shape)}"
        )


def shard_sequence(x: torch.Tensor, dim: int, group=None, layout="zigzag") -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim` (a copy, contiguous); its length
    there must divide into cp chunks (contiguous) or 2*cp (zigzag). Local."""
    rank, size, _ = _ring(group)
    n = _n_chunks(size, layout)
    if x.shape[dim] % n:
        raise ValueError(
            f"shard_sequence: length {x.shape[dim]} along dim {dim} does not "
            f"divide into {n} chunks ({layout} layout over {size} ranks): pad "
            f"the sequence to a multiple of {n}"
        )
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, size, layout)], dim=dim).contiguous()


def gather_sequence(x: torch.Tensor, dim: int, group=None, layout="zigzag") -> torch.Tensor:
    """The full tensor from every rank's shard `x` along `dim`, in sequence order (no
    autograd). Collective: every rank of the group calls this with equal shapes."""
    rank, size, _ = _ring(group)
    if size == 1:
        return x.detach().clone()
    per_rank = len(chunk_ids(0, size, layout))
    if x.shape[dim] % per_rank:
        raise ValueError(
            f"gather_sequence: local length {x.shape[dim]} along dim {dim} is "
            f"odd; the zigzag layout holds two equal chunks per rank"
        )
    with torch.no_grad():
        shard = x.detach().contiguous()
        out = torch.empty(size * shard.numel(), dtype=shard.dtype, device=shard.device)
        C.all_gather(out, shard.view(-1), group=group, label="cp gather_sequence")
        parts = out.view(size, *shard.shape)
        chunks = [None] * _n_chunks(size, layout)
        for r in range(size):
            for c, piece in zip(chunk_ids(r, size, layout), parts[r].chunk(per_rank, dim=dim)):
                chunks[c] = piece
        return torch.cat(chunks, dim=dim)


class RingBlock(NamedTuple):
    """Local query rows that meet a leading run of the held K/V block at one step (a
    tile of ring attention; not `nbtrain.Block`, ZeRO's sharded module). Its old name
    `nbtrain.context_parallel.Block` is a deprecated alias."""

    rows: slice  # this rank's query rows
    keys: int  # how many leading keys of the held block they see
    causal: bool  # ends on the diagonal: row i sees keys up to i + keys - rows


def _step_blocks(
    rank: int,
    size: int,
    step: int,
    local_seq: int,
    layout,
    causal: bool,
    whole_diagonal: bool = True,
) -> list[RingBlock]:
    """The blocks `rank` computes at `step` (holding rank - step's). Its own block under a
    causal mask is one square causal block (`whole_diagonal`: a fused kernel skips the
    future half itself) or one per query chunk, ending on the diagonal (for the math
    kernel). Query chunks seeing the same keys are one block."""
    source = (rank - step) % size
    if causal and source == rank and whole_diagonal:
        return [RingBlock(slice(0, local_seq), local_seq, True)]
    q_ids, k_ids = chunk_ids(rank, size, layout), chunk_ids(source, size, layout)
    c = local_seq // len(q_ids)
    blocks: list[RingBlock] = []
    for i, qc in enumerate(q_ids):
        seen = [kc for kc in k_ids if not causal or kc <= qc]
        if not seen:
            continue  # every key of the block is in this chunk's future: no compute
        diagonal, keys = causal and seen[-1] == qc, c * len(seen)
        if blocks and not diagonal and blocks[-1][1:] == (keys, False):  # widen it
            blocks[-1] = RingBlock(slice(blocks[-1].rows.start, (i + 1) * c), keys, False)
        else:
            blocks.append(RingBlock(slice(i * c, (i + 1) * c), keys, diagonal))
    return blocks
