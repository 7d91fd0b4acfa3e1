"""Collectives on flat buffers, with work handles and byte counters.

Everything in nbtrain that talks to other ranks goes through this file, so the
byte counters (read by benchmarks and telemetry) see all traffic, and the choice
between torch's collective names is made once. Making and destroying process groups
(comm/context.py, comm/topology.py, comm/recovery.py) is not communication and stays
there. The benchmarks under nbtrain/bench combine their own timings with torch's calls,
outside the counters they measure.

Bytes are counted per rank as a ring moves them: an all-gather or reduce-scatter
over a flat buffer of B bytes moves B x (N-1)/N, an all-reduce twice that. These
are the numbers the ZeRO paper's arithmetic uses (Rajbhandari et al., 2020, section 7).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist

from . import events
from .hang_report import WATCH, Wait
from .topology import ALONE

# torch 2.13 deprecates *_into_tensor / *_tensor in favour of *_single; older
# torch has only the former. Pick once here.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommKind(str, enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    P2P = "p2p"  # point-to-point sends: pipeline stages, the cp ring
    ALL_TO_ALL = "all_to_all"  # expert-parallel token exchange (nbtrain.moe)
    BARRIER = "barrier"  # numbered and watched (hang_report), never counted in bytes
    ALL_GATHER_OBJECT = "all_gather_object"  # likewise: pickles, not tensors


class CommCounters:
    """Bytes and calls per collective kind, as seen by this rank (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, kind: CommKind, nbytes: int) -> None:
        with self._lock:
            self.bytes[kind.value] += int(nbytes)
            self.calls[kind.value] += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict:
        """{"bytes": {kind: n}, "calls": {kind: n}, "total_bytes": n}."""
        with self._lock:
            return {
                "bytes": dict(self.bytes),
                "calls": dict(self.calls),
                "total_bytes": sum(self.bytes.values()),
            }


COUNTERS = CommCounters()


class InFlight:
    """Async collectives issued and not yet waited on: what teardown must let finish.

    `CommHandle` adds itself when issued and leaves on `wait()`. A handle dropped
    without a wait stays until it is seen completed (pruned as new ones come), so
    the set stays small. Thread-safe.
    """

    _PRUNE_AT = 64

    def __init__(self):
        self._lock = threading.Lock()
        self._handles: set = set()

    def add(self, handle: "CommHandle") -> None:
        with self._lock:
            if len(self._handles) >= self._PRUNE_AT:
                self._handles = {h for h in self._handles if not h._work.is_completed()}
            self._handles.add(handle)

    def discard(self, handle: "CommHandle") -> None:
        with self._lock:
            self._handles.discard(handle)

    def discard_works(self, works) -> None:
        """Drops the entries of these works (point-to-point works, waited on)."""
        ids = {id(w) for w in works}
        with self._lock:
            self._handles = {h for h in self._handles if id(h._work) not in ids}

    def handles(self) -> list:
        with self._lock:
            return list(self._handles)

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)


IN_FLIGHT = InFlight()


class _Posted:
    """One work of a point-to-point batch (`send_recv`, `post_p2p`) in the in-flight
    registry, so that teardown waits for a ring's or a pipeline's transfers as it does for
    the collectives' handles; it leaves once seen completed (or on `wait_send_recv`)."""

    __slots__ = ("_work",)

    def __init__(self, work):
        self._work = work


def _posted(works: list) -> list:
    """Registers a point-to-point batch's works in flight; returns them."""
    for work in works:
        IN_FLIGHT.add(_Posted(work))
    return works


# The generation of the process groups: one more each time they are made again after
# a failure (nbtrain.comm.recovery.rebuild). A handle issued in an older generation
# belongs to an aborted group: its owner drops it (`CommHandle.stale`), never waits on
# it, and issues the collective again; a prefetch kept from a failed step otherwise
# left one rank a collective behind the others (gloo then aborts the process).
_GENERATION = [0]


def generation() -> int:
    return _GENERATION[0]


def new_generation() -> None:
    """The process groups were made again: every handle issued before is stale."""
    _GENERATION[0] += 1
    IN_FLIGHT.clear()


def wait_in_flight(timeout_s: float | None = None) -> bool:
    """Blocks until every async collective issued through this module has completed.

    Only waits for the backend: results are not applied (no `on_done`), the
    handles' owners still do that with `wait()`. With a timeout it polls,
    giving up the GIL between polls (a backend thread may need it to finish),
    and returns False if something is still in flight when the timeout passes.

    Raises what a failed collective raises (timeout None only).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for handle in IN_FLIGHT.handles():
        work = handle._work
        if deadline is None:
            work.wait()
            continue
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
    return True


class CommHandle:
    """A collective in flight. `wait()` blocks until its result may be read.

    On CUDA the wait makes the current stream wait for the collective (no host
    sync); on gloo it blocks the calling thread, and a collective that fails or
    times out raises `hang_report.CollectiveError` naming the ranks that arrived.
    """

    def __init__(
        self,
        work,
        kind: CommKind,
        nbytes: int,
        label: str,
        on_done: Callable[[], None] | None = None,
        watch: Wait | None = None,
    ):
        self._work = work
        self._watch = watch
        self._on_done = on_done
        self._done = work is None
        self.kind, self.nbytes, self.label = kind, nbytes, label
        self.event_kind = event_kind(kind, label)
        self.issued_at = time.perf_counter()
        self.finished_at: float | None = None
        self.generation = _GENERATION[0]
        self._stamp_at_wait = False
        if work is not None and events.active():
            self._record_completion()
        if self._done:
            self._finish()
        else:
            IN_FLIGHT.add(self)

    def _record_completion(self):
        # The future's callback fires when the backend finishes, on its own
        # thread; it timestamps the end of the span without blocking anyone.
        try:
            fut = self._work.get_future()
        except (RuntimeError, AttributeError):
            # gloo's reduce_scatter has no future: wait() stamps the end instead,
            # an upper bound on the completion time.
            self._stamp_at_wait = True
            return

        step = events.HUB.step  # the callback may run after the step ended

        def _stamp(_):
            self.finished_at = time.perf_counter()
            events.comm_span(
                self.event_kind,
                self.label,
                self.issued_at,
                self.finished_at,
                self.nbytes,
                step=step,
            )

        fut.then(_stamp)

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    @property
    def stale(self) -> bool:
        """Issued on a process group that a failure has since replaced: drop it."""
        return self.generation != _GENERATION[0]

    def wait(self) -> None:
        if self._done:
            return
        if self._watch is None:
            self._work.wait()
        else:
            _watched(self._watch, self._work.wait)
        IN_FLIGHT.discard(self)
        if self._stamp_at_wait:
            self.finished_at = time.perf_counter()
            events.comm_span(
                self.event_kind,
                self.label,
                self.issued_at,
                self.finished_at,
                self.nbytes,
                end_at_wait=True,
            )
        events.instant("comm_wait", self.label, kind=self.event_kind)
        self._done = True
        self._finish()

    def _finish(self):
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb()


def event_kind(kind: CommKind, label: str) -> str:
    """The kind telemetry shows: tensor-parallel collectives (labels "tp ...") are
    their own kinds ("tp_all_gather", ...), apart from ZeRO's and data parallelism's."""
    return f"tp_{kind.value}" if label.startswith("tp ") else kind.value


def _alone(kind: CommKind, label: str, async_op: bool, on_done=None) -> CommHandle | None:
    """A collective over this rank alone (`topology.ALONE`): the caller did the local
    copy; nothing travels and nothing is counted."""
    handle = CommHandle(None, kind, 0, label, on_done)  # done: runs on_done now
    return handle if async_op else None


def _watched(watch: Wait, call: Callable):
    """`call()`, a blocking wait on a collective, with this rank's wait on record: a
    failure (a timeout, a peer gone) raises `CollectiveError` naming who arrived."""
    WATCH.enter(watch)
    try:
        out = call()
    except RuntimeError as err:  # gloo's timeouts and closed connections
        # The report quotes the backend's line; its traceback would come first and
        # bury the report (`backend_error` keeps it).
        raise WATCH.failed(watch, err) from None
    WATCH.leave(watch)
    return out


def _start(kind: CommKind, label: str, group, async_op: bool, call: Callable):
    """Issues a collective through `call()`: (its work, its Wait). A blocking one
    blocks here, under the watch; an async one's handle waits under it later."""
    watch = WATCH.issued(kind.value, label, group)
    return (call() if async_op else _watched(watch, call)), watch


def _ring_bytes(t: torch.Tensor, world: int) -> int:
    return t.numel() * t.element_size() * (world - 1) // max(world, 1)


def _issue(
    kind: CommKind,
    work,
    nbytes: int,
    label: str,
    async_op: bool,
    on_done=None,
    started: float | None = None,
    watch: Wait | None = None,
) -> CommHandle | None:
    COUNTERS.add(kind, nbytes)
    events.instant("comm_issue", label, kind=event_kind(kind, label), bytes=nbytes)
    handle = CommHandle(work, kind, nbytes, label, on_done, watch)
    if async_op:
        return handle
    if started is not None and events.active():
        # A blocking collective is exposed comm: without its span the
        # hidden-comm share would count only the async (overlappable) ones.
        events.comm_span(event_kind(kind, label), label, started, time.perf_counter(), nbytes)
    handle.wait()
    return None


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group=None,
    async_op: bool = False,
    label: str = "",
) -> CommHandle | None:
    """Gather equal shards from every rank into one flat buffer.

    Args:
        output: 1-D, numel = world x shard.numel(), same dtype and device.
        shard: 1-D local shard.
        async_op: return a CommHandle instead of waiting.

    Collective: every rank in the group calls this, in the same order. A group of
    this rank alone (`topology.ALONE`) copies.
    """
    if group is ALONE:
        output.copy_(shard)
        return _alone(CommKind.ALL_GATHER, label, async_op)
    world = dist.get_world_size(group)
    if output.numel() != shard.numel() * world:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected "
            f"{shard.numel()} x {world} = {shard.numel() * world}"
        )
    started = time.perf_counter()
    work, watch = _start(
        CommKind.ALL_GATHER,
        label,
        group,
        async_op,
        lambda: _all_gather_flat(output, shard, group=group, async_op=async_op),
    )
    return _issue(
        CommKind.ALL_GATHER,
        work if async_op else None,
        _ring_bytes(output, world),
        label,
        async_op,
        started=started,
        watch=watch,
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
) -> CommHandle | None:
    """Reduce a flat buffer over ranks and keep this rank's contiguous shard.

    Args:
        output: 1-D shard, numel = full.numel() / world.
        full: 1-D buffer whose numel is a multiple of the world size.
        op: "avg" (DDP gradient semantics) or "sum".
        on_done: called once the result is ready (after wait()).

    Collective: every rank in the group calls this, in the same order. A group of
    this rank alone (`topology.ALONE`) copies.
    """
    if group is ALONE:
        output.copy_(full)
        return _alone(CommKind.REDUCE_SCATTER, label, async_op, on_done)
    world = dist.get_world_size(group)
    if full.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter: input has {full.numel()} elements, expected "
            f"{output.numel()} x {world} = {output.numel() * world}"
        )
    started = time.perf_counter()
    if op in ("avg", "sum") and world > 1 and dist.get_backend(group) == "gloo":
        (work, on_done), watch = _start(
            CommKind.REDUCE_SCATTER,
            label,
            group,
            async_op,
            lambda: _reduce_scatter_gloo(output, full, op, world, group, async_op, on_done),
        )
    else:
        work, watch = _start(
            CommKind.REDUCE_SCATTER,
            label,
            group,
            async_op,
            lambda: _reduce_scatter_flat(
                output, full, op=_reduce_op(op), group=group, async_op=async_op
            ),
        )
    return _issue(
        CommKind.REDUCE_SCATTER,
        work if async_op else None,
        _ring_bytes(full, world),
        label,
        async_op,
        on_done,
        started=started,
        watch=watch,
    )


def _reduce_scatter_gloo(output, full, op, world, group, async_op, on_done):
    """gloo's reduce_scatter runs a full all-reduce and keeps a slice: 2x the
    bytes. An all-to-all moves only the (N-1)/N of the buffer that the ring
    theory counts, and the local sum of N chunks is cheap: measured on 2 ranks,
    1.0 ms against 1.9 ms at 390 KiB and 33 ms against 63 ms at 23 MiB.
    The sum runs when the handle is waited on, before `on_done`."""
    received = torch.empty_like(full)
    work = dist.all_to_all_single(received, full, group=group, async_op=async_op)

    def reduce_locally():
        torch.sum(received.view(world, -1), dim=0, out=output)
        if op == "avg":
            output.div_(world)
        if on_done is not None:
            on_done()

    return work, reduce_locally


def all_reduce(
    tensor: torch.Tensor, *, op: str = "sum", group=None, async_op: bool = False, label: str = ""
) -> CommHandle | None:
    """In-place all-reduce. Collective: every rank in the group calls this (a group of
    this rank alone, `topology.ALONE`, leaves `tensor` as it is)."""
    if group is ALONE:
        return _alone(CommKind.ALL_REDUCE, label, async_op)
    world = dist.get_world_size(group)
    started = time.perf_counter()
    work, watch = _start(
        CommKind.ALL_REDUCE,
        label,
        group,
        async_op,
        lambda: dist.all_reduce(tensor, op=_reduce_op(op), group=group, async_op=async_op),
    )
    return _issue(
        CommKind.ALL_REDUCE,
        work if async_op else None,
        2 * _ring_bytes(tensor, world),
        label,
        async_op,
        started=started,
        watch=watch,
    )


def send(tensor: torch.Tensor, dst: int, *, tag: int = 0, label: str = "") -> CommHandle:
    """Sends `tensor` to global rank `dst` without waiting; `wait()` the handle before
    changing `tensor`. Counted as its size in bytes, on the sender."""
    tensor = tensor.contiguous()
    started = time.perf_counter()
    work = dist.isend(tensor, dst=dst, tag=tag)
    handle = _issue(
        CommKind.P2P,
        work,
        tensor.numel() * tensor.element_size(),
        label,
        async_op=True,
        started=started,
    )
    handle.keep = tensor  # alive until sent
    return handle


def recv(tensor: torch.Tensor, src: int, *, tag: int = 0, label: str = "") -> None:
    """Receives into `tensor` from global rank `src` (blocks; matched by `tag`, in order)."""
    dist.recv(tensor, src=src, tag=tag)


def send_recv(
    sends: list, recvs: list, tags: list, *, dst: int, src: int, group=None, label: str = ""
) -> list:
    """Sends each of `sends` to global rank `dst` and receives each of `recvs` from global
    rank `src`, pair by pair with `tags` (extra tags are unused), as one batch without
    waiting. One batch because NCCL deadlocks on a send and a receive with the same peer
    posted apart (a ring of 2). Counted as the bytes sent, on the sender, like `send`.

    Returns the batch's works: `wait_send_recv` them before reading a receive buffer or
    changing a sent tensor.

    Collective over the pair: `dst` posts the matching receives and `src` the matching
    sends, with the same tags, in the same order (a ring's ranks all call this at once).
    """
    ops = []
    for send, recv, tag in zip(sends, recvs, tags):
        ops.append(dist.P2POp(dist.isend, send, dst, group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, src, group, tag))
    nbytes = sum(t.numel() * t.element_size() for t in sends)
    COUNTERS.add(CommKind.P2P, nbytes)
    events.instant("comm_issue", label, kind=CommKind.P2P.value, bytes=nbytes)
    return _posted(dist.batch_isend_irecv(ops))


def post_p2p(ops: list, *, label: str = "") -> list:
    """Posts point-to-point transfers as one batch without waiting: each of `ops` is
    ("send" or "recv", tensor, global peer rank). The batch may hold sends and
    receives with any peers, in any mix (BMTrain's nccl.groupStart/groupEnd); one batch,
    so a pair that sends each other does not deadlock on NCCL. Counted as the bytes
    sent, like `send`. Returns the works: `wait_send_recv` them.

    Collective over the peers: each posts the matching transfers, in the same order.
    """
    posted = []
    for kind, tensor, peer in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"post_p2p: {kind!r} is neither 'send' nor 'recv'")
        posted.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer))
    nbytes = sum(t.numel() * t.element_size() for kind, t, _ in ops if kind == "send")
    COUNTERS.add(CommKind.P2P, nbytes)
    events.instant("comm_issue", label, kind=CommKind.P2P.value, bytes=nbytes)
    return _posted(dist.batch_isend_irecv(posted)) if posted else []


def wait_send_recv(works: list, label: str = "") -> None:
    """Waits on the works of `send_recv` (anything with `wait()`), then records the wait."""
    for work in works:
        work.wait()
    IN_FLIGHT.discard_works(works)
    events.instant("comm_wait", label, kind=CommKind.P2P.value)


def broadcast(tensor: torch.Tensor, src: int = 0, *, group=None, label: str = "") -> None:
    """In-place broadcast from `src`. Collective: every rank in the group calls this."""
    _start(
        CommKind.BROADCAST, label, group, False, lambda: dist.broadcast(tensor, src, group=group)
    )
    COUNTERS.add(CommKind.BROADCAST, tensor.numel() * tensor.element_size())


def barrier(*, group=None, label: str = "") -> None:
    """Blocks until every rank of the group has called it; a rank that never comes
    makes it raise `CollectiveError` naming it (after the process-group timeout).
    Collective: every rank in the group calls this."""
    _start(CommKind.BARRIER, label, group, False, lambda: dist.barrier(group=group))


def all_gather_object(obj, *, group=None, label: str = "") -> list:
    """Every rank's picklable `obj`, in group-rank order (small metadata: checkpoint
    entries, pipeline layouts). Not counted in the byte counters: pickles, not tensors.
    Collective: every rank in the group calls this."""
    out = [None] * dist.get_world_size(group)
    _start(
        CommKind.ALL_GATHER_OBJECT,
        label,
        group,
        False,
        lambda: dist.all_gather_object(out, obj, group=group),
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
    input: torch.Tensor,  # torch's name
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
    if group is ALONE:
        output.copy_(input)
        return _alone(CommKind.ALL_TO_ALL, label, async_op)
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
    started = time.perf_counter()
    work, watch = _start(
        CommKind.ALL_TO_ALL,
        label,
        group,
        async_op,
        lambda: dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        ),
    )
    return _issue(
        CommKind.ALL_TO_ALL,
        work if async_op else None,
        nbytes,
        label,
        async_op,
        started=started,
        watch=watch,
    )
