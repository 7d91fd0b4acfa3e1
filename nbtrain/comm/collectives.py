"""Collectives on flat buffers, with work handles and byte counters.

Everything in nbtrain that talks to other ranks goes through this file, and every
collective here goes through one function, `_issue`, with the kind its caller names:
so the byte counters (read by benchmarks), the telemetry events and the in-flight
registry that teardown drains (comm/in_flight.py) see all traffic, and the choice
between torch's collective names is made once. Making and destroying process groups
(comm/context.py, comm/topology.py, comm/recovery.py) is not communication and stays
there. The benchmarks under nbtrain/bench combine their own timings with torch's calls,
outside the counters they measure (tests/unit/test_layers.py lists them).

Bytes are counted per rank as a ring moves them: an all-gather or reduce-scatter
over a flat buffer of B bytes moves B x (N-1)/N, an all-reduce twice that. These
are the numbers the ZeRO paper's arithmetic uses (Rajbhandari et al., 2020, section 7).
Point-to-point transfers count the bytes sent, on the sender; barriers and object
gathers count a call and no bytes.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from . import events
from .accounting import COUNTERS, CommKind
from .accounting import CommCounters as CommCounters  # re-exported: its home until it moved
from .hang_report import WATCH
from .in_flight import IN_FLIGHT, CommHandle, posted, watched
from .in_flight import InFlight as InFlight  # re-exported, likewise
from .in_flight import generation as generation
from .in_flight import new_generation as new_generation
from .in_flight import wait_in_flight as wait_in_flight
from .topology import ALONE

# torch 2.13 deprecates *_into_tensor / *_tensor in favour of *_single; older
# torch has only the former. Pick once here.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _issue(
    kind: CommKind,
    label: str,
    call: Callable,
    *,
    group=None,
    nbytes: int = 0,
    async_op: bool = False,
    on_done: Callable[[], None] | None = None,
    span: bool = True,
):
    """The one path of every collective: runs `call()`, counts `nbytes` under `kind`,
    publishes its `comm_issue` event and keeps what is still in flight registered.

    Args:
        kind: what the caller issues, named by the caller (telemetry shows its value,
            the counters and the hang reports its `collective`).
        call: issues the collective; returns its work (async), a point-to-point
            batch's list of works (async), or its result (blocking). Over `ALONE` it
            is the local copy, and nothing is numbered, counted or published.
        group: the process group (None: the world), or `ALONE`.
        async_op: False blocks here (watched: a failure names who arrived) and returns
            `call()`'s result; True returns a `CommHandle` registered in `IN_FLIGHT`
            until waited on, or a batch's works registered until `wait_send_recv`.
        on_done: runs once the result may be read (after the blocking call, or at the
            handle's `wait()`).
        span: a blocking call also publishes a `comm` span (exposed communication for
            the overlap share). False for the calls whose wait is mostly a peer's
            compute (a receive, a broadcast from the last stage, a barrier).

    Point-to-point transfers (`CommKind.P2P`) are not numbered in the hang reports: the
    numbers count a group's collectives, which every rank of the group calls, and a
    transfer between two ranks would put the others' numbers out of step.
    """
    if group is ALONE:
        call()
        handle = CommHandle(None, kind, 0, label, on_done)  # done: runs on_done now
        return handle if async_op else None
    watch = None if kind is CommKind.P2P else WATCH.issued(kind.collective.value, label, group)
    started = time.perf_counter()
    out = call() if async_op or watch is None else watched(watch, call)
    COUNTERS.add(kind, nbytes)
    events.instant("comm_issue", label, kind=kind.value, bytes=nbytes)
    if async_op:
        if isinstance(out, list):  # the owner waits on the works (`wait_send_recv`)
            return posted(out)
        return CommHandle(out, kind, nbytes, label, on_done, watch)
    # Blocking: done on return, so in flight for no time and never registered.
    if on_done is not None:
        on_done()
    if span and events.active():
        # A blocking collective is exposed comm: without its span the
        # hidden-comm share would count only the async (overlappable) ones.
        events.comm_span(kind.value, label, started, time.perf_counter(), nbytes)
    return out


def _kind(op: CommKind, kind: CommKind | None, label: str) -> CommKind:
    """The kind of a call of `op`: `kind` when the caller names it (one of `op`'s
    variants, e.g. its tensor-parallel one), otherwise `op`. Never read from `label`."""
    if kind is None:
        return op
    if kind not in op.variants():
        names = " or ".join(f"CommKind.{k.name}" for k in op.variants())
        raise ValueError(f"{op.value}: kind={kind!r} is another operation; pass {names}")
    return kind


def _ring_bytes(t: torch.Tensor, world: int) -> int:
    return t.numel() * t.element_size() * (world - 1) // max(world, 1)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group=None,
    async_op: bool = False,
    label: str = "",
    kind: CommKind | None = None,
) -> CommHandle | None:
    """Gather equal shards from every rank into one flat buffer.

    Args:
        output: 1-D, numel = world x shard.numel(), same dtype and device.
        shard: 1-D local shard.
        async_op: return a CommHandle instead of waiting.
        kind: CommKind.ALL_GATHER or CommKind.TP_ALL_GATHER (the tensor-parallel
            layers'); None: ALL_GATHER, or TP_ALL_GATHER for a label "tp ...".

    Collective: every rank in the group calls this, in the same order. A group of
    this rank alone (`topology.ALONE`) copies.
    """
    kind = _kind(CommKind.ALL_GATHER, kind, label)
    if group is ALONE:
        return _issue(kind, label, lambda: output.copy_(shard), group=ALONE, async_op=async_op)
    world = dist.get_world_size(group)
    if output.numel() != shard.numel() * world:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected "
            f"{shard.numel()} x {world} = {shard.numel() * world}"
        )
    return _issue(
        kind,
        label,
        lambda: _all_gather_flat(output, shard, group=group, async_op=async_op),
        group=group,
        nbytes=_ring_bytes(output, world),
        async_op=async_op,
    )


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    *,
    op: str = "avg",
    group=None,
    async_op: bool = False,
    label: str = "",
    on_done: Callable[[], None] | None = None,
    kind: CommKind | None = None,
) -> CommHandle | None:
    """Reduce a flat buffer over ranks and keep this rank's contiguous shard.

    Args:
        output: 1-D shard, numel = full.numel() / world.
        full: 1-D buffer whose numel is a multiple of the world size.
        op: "avg" (DDP gradient semantics) or "sum".
        on_done: called once the result is ready (after wait()).
        kind: CommKind.REDUCE_SCATTER or CommKind.TP_REDUCE_SCATTER; None: as
            `all_gather`'s.

    Collective: every rank in the group calls this, in the same order. A group of
    this rank alone (`topology.ALONE`) copies.
    """
    kind = _kind(CommKind.REDUCE_SCATTER, kind, label)
    if group is ALONE:
        return _issue(
            kind, label, lambda: output.copy_(full), group=ALONE, async_op=async_op, on_done=on_done
        )
    world = dist.get_world_size(group)
    if full.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter: input has {full.numel()} elements, expected "
            f"{output.numel()} x {world} = {output.numel() * world}"
        )
    if op in ("avg", "sum") and world > 1 and dist.get_backend(group) == "gloo":
        call, on_done = _reduce_scatter_gloo(output, full, op, world, group, async_op, on_done)
    else:
        reduce_op = _reduce_op(op)

        def call():
            return _reduce_scatter_flat(output, full, op=reduce_op, group=group, async_op=async_op)

    return _issue(
        kind,
        label,
        call,
        group=group,
        nbytes=_ring_bytes(full, world),
        async_op=async_op,
        on_done=on_done,
    )


def _reduce_scatter_gloo(output, full, op, world, group, async_op, on_done):
    """gloo's reduce_scatter runs a full all-reduce and keeps a slice: 2x the
    bytes. An all-to-all moves only the (N-1)/N of the buffer that the ring
    theory counts, and the local sum of N chunks is cheap: measured on 2 ranks,
    1.0 ms against 1.9 ms at 390 KiB and 33 ms against 63 ms at 23 MiB.
    Returns (the all-to-all's call, what runs once it is done): the sum runs when
    the handle is waited on, before `on_done`."""
    received = torch.empty_like(full)

    def call():
        return dist.all_to_all_single(received, full, group=group, async_op=async_op)

    def reduce_locally():
        torch.sum(received.view(world, -1), dim=0, out=output)
        if op == "avg":
            output.div_(world)
        if on_done is not None:
            on_done()

    return call, reduce_locally


def all_reduce(
    tensor: torch.Tensor,
    *,
    op: str = "sum",
    group=None,
    async_op: bool = False,
    label: str = "",
    kind: CommKind | None = None,
) -> CommHandle | None:
    """In-place all-reduce. Collective: every rank in the group calls this (a group of
    this rank alone, `topology.ALONE`, leaves `tensor` as it is).

    `kind`: CommKind.ALL_REDUCE or CommKind.TP_ALL_REDUCE; None: as `all_gather`'s."""
    kind = _kind(CommKind.ALL_REDUCE, kind, label)
    if group is ALONE:
        return _issue(kind, label, lambda: None, group=ALONE, async_op=async_op)
    world = dist.get_world_size(group)
    reduce_op = _reduce_op(op)
    return _issue(
        kind,
        label,
        lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op),
        group=group,
        nbytes=2 * _ring_bytes(tensor, world),
        async_op=async_op,
    )


def send(tensor: torch.Tensor, dst: int, *, tag: int = 0, label: str = "") -> CommHandle:
    """Sends `tensor` to global rank `dst` without waiting; `wait()` the handle before
    changing `tensor`. Counted as its size in bytes, on the sender."""
    tensor = tensor.contiguous()
    handle = _issue(
        CommKind.P2P,
        label,
        lambda: dist.isend(tensor, dst=dst, tag=tag),
        nbytes=_nbytes(tensor),
        async_op=True,
    )
    handle.keep = tensor  # alive until sent
    return handle


def recv(tensor: torch.Tensor, src: int, *, tag: int = 0, label: str = "") -> None:
    """Receives into `tensor` from global rank `src` (blocks; matched by `tag`, in order).
    Counted as a call of no bytes (the sender counts them); no span, since the wait is
    mostly the sender's compute."""
    _issue(CommKind.P2P, label, lambda: dist.recv(tensor, src=src, tag=tag), span=False)


def send_recv(
    sends: list, recvs: list, tags: list, *, dst: int, src: int, group=None, label: str = ""
) -> list:
    """Sends each of `sends` to global rank `dst` and receives each of `recvs` from global
    rank `src`, pair by pair with `tags` (extra tags are unused), as one batch without
    waiting. One batch because NCCL deadlocks on a send and a receive with the same peer
    posted apart (a ring of 2). Counted as the bytes sent, on the sender, like `send`.

    Returns the batch's works, in flight (`IN_FLIGHT`) until `wait_send_recv`: wait on
    them with it before reading a receive buffer or changing a sent tensor.

    Collective over the pair: `dst` posts the matching receives and `src` the matching
    sends, with the same tags, in the same order (a ring's ranks all call this at once).
    """
    ops = []
    for send, recv, tag in zip(sends, recvs, tags):
        ops.append(dist.P2POp(dist.isend, send, dst, group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, src, group, tag))
    return _issue(
        CommKind.P2P,
        label,
        lambda: dist.batch_isend_irecv(ops),
        nbytes=sum(_nbytes(t) for t in sends),
        async_op=True,
    )


def post_p2p(ops: list, *, label: str = "") -> list:
    """Posts point-to-point transfers as one batch without waiting: each of `ops` is
    ("send" or "recv", tensor, global peer rank). The batch may hold sends and
    receives with any peers, in any mix (BMTrain's nccl.groupStart/groupEnd); one batch,
    so a pair that sends each other does not deadlock on NCCL. Counted as the bytes
    sent, like `send`. Returns the works, in flight until `wait_send_recv` waits on them.

    Collective over the peers: each posts the matching transfers, in the same order.
    """
    batch = []
    for what, tensor, peer in ops:
        if what not in ("send", "recv"):
            raise ValueError(f"post_p2p: {what!r} is neither 'send' nor 'recv'")
        batch.append(dist.P2POp(dist.isend if what == "send" else dist.irecv, tensor, peer))
    return _issue(
        CommKind.P2P,
        label,
        lambda: dist.batch_isend_irecv(batch) if batch else [],
        nbytes=sum(_nbytes(t) for what, t, _ in ops if what == "send"),
        async_op=True,
    )


def wait_send_recv(works: list, label: str = "") -> None:
    """Waits on the works of `send_recv` or `post_p2p` (anything with `wait()`), drops
    them from the in-flight registry, then records the wait. Each work is waited on once
    (gloo's point-to-point works must not be waited on twice)."""
    for work in works:
        work.wait()
    IN_FLIGHT.discard_works(works)
    events.instant("comm_wait", label, kind=CommKind.P2P.value)


def broadcast(tensor: torch.Tensor, src: int = 0, *, group=None, label: str = "") -> None:
    """In-place broadcast from global rank `src`. Counted as the tensor's bytes on every
    rank; no span (a rank mostly waits for `src` to compute the tensor, a pipeline's
    loss or logits). Collective: every rank in the group calls this."""
    _issue(
        CommKind.BROADCAST,
        label,
        lambda: dist.broadcast(tensor, src, group=group),
        group=group,
        nbytes=_nbytes(tensor),
        span=False,
    )


def barrier(*, group=None, label: str = "") -> None:
    """Blocks until every rank of the group has called it; a rank that never comes
    makes it raise `CollectiveError` naming it (after the process-group timeout).
    Counted as a call of no bytes. Collective: every rank in the group calls this."""
    _issue(CommKind.BARRIER, label, lambda: dist.barrier(group=group), group=group, span=False)


def all_gather_object(obj, *, group=None, label: str = "") -> list:
    """Every rank's picklable `obj`, in group-rank order (small metadata: checkpoint
    entries, pipeline layouts). Counted as a call of no bytes: pickles, not tensors.
    Collective: every rank in the group calls this."""
    out = [None] * dist.get_world_size(group)
    _issue(
        CommKind.ALL_GATHER_OBJECT,
        label,
        lambda: dist.all_gather_object(out, obj, group=group),
        group=group,
        span=False,
    )
    return out


def global_rank(group, group_rank: int) -> int:
    """The world rank of `group`'s rank `group_rank` (None: the world, itself): what
    `broadcast`'s `src` takes. Local."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _reduce_op(op: str):
    ops = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    try:
        return ops[op]
    except KeyError:
        raise ValueError(f"op={op!r}: use one of {sorted(ops)}") from None


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 (torch's keyword name)
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    *,
    group=None,
    label: str = "",
    async_op: bool = False,
) -> CommHandle | None:
    """Each rank sends row blocks of `input` to every rank and receives into `output`.

    Rows `input[sum(input_split_sizes[:j]) : ...]` go to group rank j; `output` holds
    the blocks received, in group-rank order. Split sizes count rows along dim 0 and
    may differ per rank (None: equal blocks). Counted as the bytes this rank sends to
    other ranks (its own block stays local), like `send`; equal blocks of a B-byte
    buffer give B x (N-1)/N, the ring figure of the other wrappers. Blocking, or with
    `async_op` a CommHandle to `wait()` on before reading `output` or changing `input`.

    Args:
        output: (sum(output_split_sizes), ...) buffer, same dtype and device as input.
        input: (sum(input_split_sizes), ...) contiguous rows to send.
        output_split_sizes / input_split_sizes: one row count per group rank, or None.

    Collective: every rank in the group calls this, in the same order, with split
    sizes that agree (what rank i sends to j is what j expects from i). A group of
    this rank alone (`topology.ALONE`) copies.
    """
    kind = CommKind.ALL_TO_ALL
    if group is ALONE:
        return _issue(kind, label, lambda: output.copy_(input), group=ALONE, async_op=async_op)
    world = dist.get_world_size(group)
    for name, sizes in (
        ("output_split_sizes", output_split_sizes),
        ("input_split_sizes", input_split_sizes),
    ):
        if sizes is not None and len(sizes) != world:
            raise ValueError(
                f"all_to_all_single: {name} has {len(sizes)} entries, the "
                f"group has {world} ranks: give one row count per rank"
            )
    row_bytes = input[:1].numel() * input.element_size()  # 0 for 0 rows: nothing sent
    if input_split_sizes is None:
        nbytes = _ring_bytes(input, world)
    else:
        me = dist.get_rank(group)
        nbytes = (sum(input_split_sizes) - input_split_sizes[me]) * row_bytes
    return _issue(
        kind,
        label,
        lambda: dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        ),
        group=group,
        nbytes=nbytes,
        async_op=async_op,
    )
