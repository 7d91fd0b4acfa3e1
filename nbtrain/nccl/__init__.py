"""`nbtrain.nccl`: BMTrain's communicator module on nbtrain's collectives.

BMTrain's `bmtrain.nccl` calls NCCL through its C++ binding on raw CUDA storages.
Here every function runs through nbtrain.comm.collectives (torch.distributed: gloo on
the CPU, NCCL on CUDA), with BMTrain's names and argument order:

    nccl.allReduce(src, dst, "sum", config["comm"])
    nccl.allGather(src, dst, config["tp_comm"])
    nccl.reduceScatter(src, dst, "avg", config["zero_comm"])
    nccl.broadcast(src, dst, root, comm); nccl.reduce(src, dst, op, root, comm)
    nccl.groupStart(); nccl.send(src, peer, comm); nccl.recv(dst, peer, comm); nccl.groupEnd()
    nccl.commCount(comm), nccl.commRank(comm)

A communicator is what `nbtrain.config` holds under BMTrain's keys ("comm",
"tp_comm", "pipe_comm", ...): a torch process group, None for every rank, or
`nbtrain.comm.topology.ALONE`; a group's name ("tp", "dp", "pipe", ...) or an
`NCCLCommunicator` wrapping one of these works too. Ranks (`root`, `peer`) count
within the communicator, as in BMTrain. Buffers are tensors or their storages
(`t.storage()`, as BMTrain's callers pass), on any device: one on another device
than the context's goes there for the call and its result comes back (BMTrain takes
CUDA storages only). Everything is collective over the communicator's ranks but
send/recv (a pair), and ends before the call returns: the results are in `dst`.

Deliberately different: `getUniqueId`, `commInitRank` and `commDestroy` make and end
NCCL communicators by hand, which torch.distributed does for nbtrain (groups come
from `init_distributed`'s layout, or `torch.distributed.new_group`): they raise a
NotImplementedError that says so.
"""

from __future__ import annotations

import threading

import torch

from ..comm import collectives as C
from ..comm.context import get_context
from ..comm.topology import ALONE
from ..distributed.ops import global_rank_of, resolve_comm
from .enums import *  # noqa: F403 (BMTrain's module re-exports every code)
from .enums import (
    ncclAvg,
    ncclBFloat16,
    ncclBool,
    ncclFloat16,
    ncclFloat32,
    ncclFloat64,
    ncclInt8,
    ncclInt32,
    ncclInt64,
    ncclMax,
    ncclMin,
    ncclProd,
    ncclSum,
    ncclUint8,
)

_DTYPES = {
    torch.int8: ncclInt8,
    torch.uint8: ncclUint8,
    torch.int32: ncclInt32,
    torch.int64: ncclInt64,
    torch.float16: ncclFloat16,
    torch.bfloat16: ncclBFloat16,
    torch.float32: ncclFloat32,
    torch.float64: ncclFloat64,
    torch.bool: ncclBool,
}
_OPS = {"sum": ncclSum, "prod": ncclProd, "max": ncclMax, "min": ncclMin, "avg": ncclAvg}


class NCCLCommunicator:
    """A communicator: the torch process group it stands for (`group`: None for every
    rank, ALONE for this rank only). nbtrain's config holds the groups themselves;
    this class is for code that names BMTrain's type."""

    def __init__(self, group=None) -> None:
        self.group = group

    @property
    def ptr(self):
        """BMTrain's handle; here the process group."""
        return self.group

    def __repr__(self) -> str:
        return f"NCCLCommunicator({self.group!r})"


def dtype2nccl(dtype: torch.dtype) -> int:
    """NCCL's code for `dtype` (enums.py); a TypeError names the supported ones. Local."""
    if dtype not in _DTYPES:
        raise TypeError(
            f"dtype {dtype} has no NCCL code; supported: {', '.join(map(str, _DTYPES))}"
        )
    return _DTYPES[dtype]


def op2nccl(op: str) -> int:
    """NCCL's code for the reduction `op` ("sum", "prod", "max", "min", "avg"). Local."""
    if op not in _OPS:
        raise ValueError(f"op={op!r}: use one of {', '.join(map(repr, _OPS))}")
    return _OPS[op]


def _not_here(name: str):
    raise NotImplementedError(
        f"nbtrain.nccl.{name}: torch.distributed makes nbtrain's communicators; use the "
        "groups in nbtrain.config (config['comm'], config['tp_comm'], ...) or "
        "torch.distributed.new_group(ranks)"
    )


def getUniqueId() -> bytes:  # BMTrain's name
    """Not available: see the module's notes."""
    _not_here("getUniqueId")


def commInitRank(unique_id: bytes, world_size: int, rank: int):
    """Not available: see the module's notes."""
    _not_here("commInitRank")


def commDestroy(comm) -> None:
    """Not available: nbtrain's groups end with its context (nbtrain.comm.shutdown)."""
    _not_here("commDestroy")


# -- communicators and buffers --------------------------------------------------------


def _group(comm):
    """(group, size, this rank's place) of a communicator: nbtrain.distributed's rule,
    with BMTrain's communicator objects unwrapped first."""
    if isinstance(comm, NCCLCommunicator):
        comm = comm.group
    return resolve_comm(comm)


def _peer(group, size: int, rank: int) -> int:
    """The global rank of `group`'s rank `rank`."""
    return global_rank_of(group, size, rank)


def _flat(buffer) -> torch.Tensor:
    """A 1-D tensor over `buffer` (a tensor, or a typed storage as `t.storage()` gives)."""
    if isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise ValueError(
                f"nccl: a buffer of shape {tuple(buffer.shape)} is not contiguous; pass "
                "t.contiguous() (the result is written into the buffer itself)"
            )
        return buffer.view(-1)
    if isinstance(buffer, torch.TypedStorage):
        return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(buffer)
    if isinstance(buffer, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8, device=buffer.device).set_(buffer)
    raise TypeError(f"nccl: expected a tensor or a storage, got {type(buffer).__name__}")


class _OnDevice:
    """The context's-device copies of some buffers; `done()` writes results back."""

    def __init__(self, *buffers):
        self.device = get_context().device
        self.given = [_flat(b) for b in buffers]
        self.here = [t if t.device == self.device else t.to(self.device) for t in self.given]

    def done(self, *indices) -> None:
        for i in indices:
            if self.here[i] is not self.given[i]:
                self.given[i].copy_(self.here[i])


def _check(src: torch.Tensor, dst: torch.Tensor, name: str, dst_numel: int) -> None:
    if src.dtype != dst.dtype:
        raise TypeError(f"nccl.{name}: src is {src.dtype} but dst is {dst.dtype}; use one dtype")
    if dst.numel() != dst_numel:
        raise ValueError(
            f"nccl.{name}: dst has {dst.numel()} elements, expected {dst_numel} "
            f"(src has {src.numel()})"
        )


def _reduce_into(out: torch.Tensor, op: str, group, size: int, label: str) -> None:
    """`out` reduced in place over the group (avg and prod made from sum and gather)."""
    op2nccl(op)
    if group is ALONE or size == 1:
        return
    if op == "prod":
        parts = torch.empty(size * out.numel(), dtype=out.dtype, device=out.device)
        C.all_gather(parts, out, group=group, label=label)
        torch.prod(parts.view(size, -1), dim=0, out=out)
        return
    C.all_reduce(out, op="sum" if op == "avg" else op, group=group, label=label)
    if op == "avg":
        if out.is_floating_point():
            out.div_(size)
        else:
            out.div_(size, rounding_mode="trunc")


# -- collectives ----------------------------------------------------------------------


def commCount(comm) -> int:
    """How many ranks `comm` has. Local."""
    return _group(comm)[1]


def commRank(comm) -> int:
    """This rank's place in `comm`. Local."""
    return _group(comm)[2]


def allReduce(src, dst, op: str, comm) -> None:
    """`src` reduced over `comm` (op "sum", "prod", "max", "min" or "avg") into `dst`
    (same size and dtype; `src` may be `dst`). Collective."""
    group, size, _ = _group(comm)
    bufs = _OnDevice(src, dst)
    s, d = bufs.here
    _check(s, d, "allReduce", s.numel())
    if d.data_ptr() != s.data_ptr():
        d.copy_(s)
    _reduce_into(d, op, group, size, "nccl allReduce")
    bufs.done(1)


def reduce(src, dst, op: str, root: int, comm) -> None:
    """`src` reduced over `comm` into `dst` on rank `root` of `comm` (other ranks' `dst`
    are left as they are). Collective."""
    group, size, rank = _group(comm)
    _peer(group, size, root)
    bufs = _OnDevice(src, dst)
    s, d = bufs.here
    _check(s, d, "reduce", s.numel())
    out = s.clone()
    _reduce_into(out, op, group, size, "nccl reduce")
    if rank == root:
        d.copy_(out)
        bufs.done(1)


def broadcast(src, dst, root: int, comm) -> None:
    """Rank `root`'s `src` into every rank's `dst` (same size; `root` counts within
    `comm`). Collective."""
    group, size, rank = _group(comm)
    source = _peer(group, size, root)
    bufs = _OnDevice(src, dst)
    s, d = bufs.here
    _check(s, d, "broadcast", s.numel())
    if rank == root and d.data_ptr() != s.data_ptr():
        d.copy_(s)
    if group is not ALONE and size > 1:
        C.broadcast(d, src=source, group=group, label="nccl broadcast")
    bufs.done(1)


def allGather(src, dst, comm) -> None:
    """Every rank's `src`, in rank order, into `dst` (`size` times as large). Collective."""
    group, size, _ = _group(comm)
    bufs = _OnDevice(src, dst)
    s, d = bufs.here
    _check(s, d, "allGather", s.numel() * size)
    C.all_gather(d, s, group=group, label="nccl allGather")
    bufs.done(1)


def reduceScatter(src, dst, op: str, comm) -> None:
    """`src` reduced over `comm`; rank r keeps the r-th of `size` equal parts in `dst`.
    Collective."""
    group, size, rank = _group(comm)
    bufs = _OnDevice(src, dst)
    s, d = bufs.here
    _check(s, d, "reduceScatter", s.numel() // size)
    if s.numel() % size:
        raise ValueError(f"nccl.reduceScatter: {s.numel()} elements do not split over {size}")
    if op in ("sum", "avg") and s.is_floating_point():
        C.reduce_scatter(d, s, op=op, group=group, label="nccl reduceScatter")
    else:  # max/min/prod, or integers: reduce whole, keep this rank's part
        full = s.clone()
        _reduce_into(full, op, group, size, "nccl reduceScatter")
        d.copy_(full.view(size, -1)[rank])
    bufs.done(1)


# -- point to point -------------------------------------------------------------------


class _Batch(threading.local):
    """The sends and receives posted between groupStart and groupEnd on this thread
    (NCCL's group calls are per thread too)."""

    def __init__(self):
        self.depth = 0
        self.ops: list = []
        self.after: list = []


_BATCH = _Batch()


def groupStart() -> None:
    """Starts a group: sends and receives until the matching groupEnd are posted as
    one batch (a pair may then send to each other without deadlock). Local."""
    _BATCH.depth += 1


def groupEnd() -> None:
    """Ends a group: posts its sends and receives together and waits for them."""
    if _BATCH.depth == 0:
        raise RuntimeError("nccl.groupEnd without a groupStart")
    _BATCH.depth -= 1
    if _BATCH.depth:
        return
    ops, after = _BATCH.ops, _BATCH.after
    _BATCH.ops, _BATCH.after = [], []
    C.wait_send_recv(C.post_p2p(ops, label="nccl group"), label="nccl group")
    for finish in after:
        finish()


def send(src, peer: int, comm) -> None:
    """Sends `src` to rank `peer` of `comm`, which calls `recv`. Outside a group it
    waits until sent."""
    group, size, _ = _group(comm)
    dst = _peer(group, size, peer)
    bufs = _OnDevice(src)
    if _BATCH.depth:
        _BATCH.ops.append(("send", bufs.here[0].clone(), dst))
        return
    C.send(bufs.here[0], dst, label="nccl send").wait()


def recv(dst, peer: int, comm) -> None:
    """Receives into `dst` what rank `peer` of `comm` sent (same size and dtype). Inside
    a group, `dst` holds it after groupEnd."""
    group, size, _ = _group(comm)
    source = _peer(group, size, peer)
    bufs = _OnDevice(dst)
    if _BATCH.depth:
        _BATCH.ops.append(("recv", bufs.here[0], source))
        _BATCH.after.append(lambda: bufs.done(0))
        return
    C.recv(bufs.here[0], source, label="nccl recv")
    bufs.done(0)
