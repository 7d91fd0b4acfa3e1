"""Rank functions for test_ring_attention.py: ring attention over the world's ranks
(the cp group), every case in one launch per world size, with each block kernel (the
fused op where torch has one, and the math fallback)."""

import functools
import itertools

import torch

BATCH, HEADS, HEAD_DIM = 2, 2, 8
SEQ_PER_RANK = 12  # seq 24 at cp 2, 36 at cp 3: divisible into 2*cp zigzag chunks

# Three documents per row, of uneven lengths that cross the shards' boundaries.
DOC_LENGTHS = {24: ([5, 11, 8], [13, 2, 9]), 36: ([7, 17, 12], [4, 20, 12])}


def packed_position_ids(seq: int) -> torch.Tensor:
    """int64 (BATCH, seq): positions restarting at 0 at each document's start."""
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in DOC_LENGTHS[seq]]
    return torch.stack(rows)


def full_inputs(seq: int, seed: int):
    """q, k, v and an upstream gradient, (BATCH, HEADS, seq, HEAD_DIM) float32, the same
    on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=g) for _ in range(4)]


def ring_cases(seed: int):
    """Every case at this world size: {(causal, packed, layout, kernel): result}, with each
    result's gathered output and q/k/v gradients, the full inputs, and the P2P bytes this
    rank sent in the forward and in the backward; plus shard/gather round trips, each
    rank's global positions, and the events of one forward and backward."""
    import torch.distributed as dist

    from nbtrain.comm import collectives as C
    from nbtrain.context_parallel import (
        Ring,
        document_ids,
        gather_sequence,
        ring_attention,
        shard_sequence,
    )

    world = dist.get_world_size()
    seq = SEQ_PER_RANK * world
    q, k, v, dout = full_inputs(seq, seed)
    position_ids = packed_position_ids(seq)
    cases = {}
    for causal, packed, layout, kernel in itertools.product(
        (True, False), (False, True), ("zigzag", "contiguous"), ("auto", "math")
    ):
        shards = [shard_sequence(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
        docs = shard_sequence(document_ids(position_ids), 1, layout=layout) if packed else None
        C.COUNTERS.reset()
        out = ring_attention(
            *shards,
            causal=causal,
            doc_ids=docs,
            layout=layout,
            ring=functools.partial(Ring, kernel=kernel),
        )
        fwd_bytes = C.COUNTERS.snapshot()["bytes"].get("p2p", 0)
        C.COUNTERS.reset()
        out.backward(shard_sequence(dout, 2, layout=layout))
        bwd_bytes = C.COUNTERS.snapshot()["bytes"].get("p2p", 0)
        cases[(causal, packed, layout, kernel)] = dict(
            out=gather_sequence(out, 2, layout=layout),
            grads=[gather_sequence(t.grad, 2, layout=layout) for t in shards],
            fwd_bytes=fwd_bytes,
            bwd_bytes=bwd_bytes,
        )
    return dict(
        cases=cases,
        inputs=(q, k, v, dout),
        position_ids=position_ids,
        round_trips=_round_trips(seed),
        positions=_positions(seq),
        events=_events(q, k, v),
        subgroup=_subgroup(seed) if world == 3 else None,
    )


def _subgroup(seed: int):
    """At world 3, ring attention over the group of global ranks 0 and 2 (causal,
    packed, zigzag on a 24-token sequence): the gathered output and q/k/v gradients
    on those ranks, None on rank 1."""
    import torch.distributed as dist

    from nbtrain.context_parallel import (
        document_ids,
        gather_sequence,
        ring_attention,
        shard_sequence,
    )

    group = dist.new_group([0, 2])  # every rank creates it
    if dist.get_rank() == 1:
        return None
    q, k, v, dout = full_inputs(24, seed)
    shards = [shard_sequence(t, 2, group).requires_grad_() for t in (q, k, v)]
    docs = shard_sequence(document_ids(packed_position_ids(24)), 1, group)
    out = ring_attention(*shards, group=group, doc_ids=docs)
    out.backward(shard_sequence(dout, 2, group))
    return [gather_sequence(t, 2, group) for t in [out] + [s.grad for s in shards]]


def _round_trips(seed: int) -> dict:
    """Does gather(shard(x)) give x back exactly, for each layout and a few dims?"""
    import torch.distributed as dist

    from nbtrain.context_parallel import gather_sequence, shard_sequence

    n = 2 * dist.get_world_size() * 3
    x = torch.randn(3, n, 5, n, generator=torch.Generator().manual_seed(seed + 1))
    ids = torch.arange(2 * n).view(2, n)
    out = {}
    for layout in ("zigzag", "contiguous"):
        for name, t, dim in (("x dim 1", x, 1), ("x dim 3", x, 3), ("ids dim 1", ids, 1)):
            shard = shard_sequence(t, dim, layout=layout)
            out[(layout, name)] = torch.equal(gather_sequence(shard, dim, layout=layout), t)
    return out


def _positions(seq: int) -> dict:
    """This rank's global token positions per layout (the shard of arange(seq)), and what
    `global_positions` says they are."""
    import torch.distributed as dist

    from nbtrain.context_parallel import global_positions, shard_sequence

    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        layout: (
            shard_sequence(torch.arange(seq), 0, layout=layout),
            global_positions(rank, world, seq // world, layout),
        )
        for layout in ("zigzag", "contiguous")
    }


def _events(q, k, v):
    """(type, label, phase) of the events of one causal zigzag forward and backward, in order."""
    from nbtrain.comm import events
    from nbtrain.context_parallel import ring_attention, shard_sequence

    seen = []

    def record(event):
        if event["type"] in ("comm_issue", "comm_wait", "compute_begin"):
            seen.append((event["type"], event["label"], event.get("phase")))

    shards = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    events.subscribe(record)
    try:
        ring_attention(*shards).sum().backward()
    finally:
        events.unsubscribe(record)
    return seen
