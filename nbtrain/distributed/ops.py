"""Whole-tensor collectives with BMTrain's shapes and gradients (`bmt.distributed`).

Every function takes `comm`, the ranks it runs over:

- None (the default): every rank (torch's default group);
- a torch process group, or the name of one of the topology's groups ("tp", "dp",
  "zero", "pipe", ...; see nbtrain.comm.topology) for BMTrain's `config["tp_comm"]`
  and the like;
- `nbtrain.comm.topology.ALONE`: this rank alone (nothing travels).

Ranks given to `broadcast`, `send_activations` and `recv_activations` count within
`comm`, as BMTrain's do. A tensor on another device than the context's (a CPU tensor
in a CUDA run) is moved there for the collective and the result moved back; BMTrain
accepts CUDA tensors only. Everything travels through nbtrain's counted collectives
(nbtrain.comm.collectives), labelled "distributed ...".

Gradients are BMTrain's, given by the autograd Functions of nbtrain.distributed.autograd
(the one home of nbtrain's differentiable collectives). Two conventions meet here, as
in BMTrain:

- `all_gather` and `all_reduce` give every rank the same result and expect every
  rank to compute the same loss from it, counted once: the gradient of this rank's
  input is its part of the output's gradient (`grad[rank]` for all_gather, `grad`
  for a sum, `grad / world` for an average, `grad` where this rank held the max/min
  and 0 elsewhere, `grad * result / input` for a product).
- `reduce_scatter` and `broadcast` give each rank its own result, and each rank's
  loss counts: the gradient of the input is the all-gather of the output gradients
  (divided by the world for "avg"; max/min/prod have none, as in BMTrain), and a
  broadcast's gradient is the sum of every rank's output gradient, on every rank
  (the root's is the true one; BMTrain gives the others the same sum).

Collective: every rank of `comm` calls each function (but the point-to-point pair)
in the same order. Before `init_distributed` they raise a RuntimeError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..comm.context import get_context
from ..comm.topology import ALONE
from . import autograd as A

OPS = ("sum", "avg", "max", "min", "prod")
# dtype codes of the header `send_activations` sends first: BMTrain's order, then more.
DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.bfloat16,
    torch.bool,
    torch.uint8,
)
DTYPE_LIST = list(DTYPES)  # BMTrain's name
HEADER_LEN = 50  # ndim, dtype code, then up to 48 sizes


def resolve_comm(comm):
    """(group, size, rank within it) for `comm`."""
    ctx = get_context()  # a clear error before init_distributed
    if isinstance(comm, str):
        comm = ctx.topology.group(comm)
    if comm is ALONE:
        return ALONE, 1, 0
    if comm is None:
        return None, ctx.world_size, ctx.rank
    return comm, dist.get_world_size(comm), dist.get_rank(comm)


def global_rank_of(group, size: int, group_rank: int) -> int:
    if not 0 <= group_rank < size:
        raise ValueError(f"rank {group_rank} is outside the group of {size} ranks")
    if group is ALONE:
        return get_context().rank
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _ranks(comm) -> A.Ranks:
    """`comm`'s ranks, their traffic labelled "distributed ..." (BMTrain's kinds)."""
    return A.Ranks(*resolve_comm(comm), prefix="distributed")


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op={op!r}: use one of {', '.join(map(repr, OPS))}")
    return op


def _on_context_device(x: torch.Tensor, fn):
    """fn(x) computed on the context's device, returned on x's device."""
    device = get_context().device
    if x.device == device:
        return fn(x)
    return fn(x.to(device)).to(x.device)


# -- BMTrain's functions ----------------------------------------------------------------


def all_gather(x: torch.Tensor, comm=None) -> torch.Tensor:
    """Every rank's `x`, stacked: shape `(ranks of comm, *x.shape)`, in rank order.

    Gradient: this rank's slice of the output's gradient (see the module's notes).
    Collective.
    """
    ranks = _ranks(comm)
    return _on_context_device(x, lambda t: A.Gather.apply(t, ranks, None, A.Grad.SAME, None, None))


def all_reduce(x: torch.Tensor, op: str = "sum", comm=None) -> torch.Tensor:
    """`x` reduced over the ranks of `comm` (a new tensor; `x` is left as it is).

    Args:
        op: "sum", "avg", "max", "min" or "prod" (an integer average truncates).

    Gradient: see the module's notes. Collective.
    """
    ranks = _ranks(comm)
    _check_op(op)
    return _on_context_device(x, lambda t: A.AllReduce.apply(t, op, ranks, None))


def reduce_scatter(x: torch.Tensor, op: str = "sum", comm=None) -> torch.Tensor:
    """`x` reduced over the ranks of `comm`, of which this rank keeps its rows: shape
    `(x.shape[0] // ranks, *x.shape[1:])`, rank r holding rows `r*n:(r+1)*n`.

    Args:
        op: as for `all_reduce`; only "sum" and "avg" have a gradient.

    Gradient: the all-gather of the output gradients. Collective.
    """
    ranks = _ranks(comm)
    _check_op(op)

    def scatter(t):
        if t.dim() == 0 or t.shape[0] % ranks.size:
            raise ValueError(
                f"reduce_scatter: the first dimension of shape {tuple(t.shape)} "
                f"must divide by the {ranks.size} ranks"
            )
        return A.ReduceScatter.apply(t, op, ranks, None, None)

    return _on_context_device(x, scatter)


def broadcast(src: torch.Tensor, root: int, comm=None) -> torch.Tensor:
    """A copy of rank `root`'s `src` on every rank (every rank passes a tensor of that
    shape and dtype). `root` counts within `comm`.

    Gradient: the sum over the ranks of the output's gradient, on every rank.
    Collective.
    """
    ranks = _ranks(comm)
    source = global_rank_of(ranks.group, ranks.size, root)
    return _on_context_device(src, lambda t: A.Broadcast.apply(t, source, ranks, None, None))


def send_activations(hidden_state: torch.Tensor, next_rank: int, comm=None) -> None:
    """Sends `hidden_state` (any shape and dtype of DTYPES) to `next_rank` of `comm`,
    which receives it with `recv_activations`. Not differentiable.

    The tensor's shape and dtype travel first, in a header of HEADER_LEN int64s. The
    send does not wait for the receiver (a copy is sent: `hidden_state` may change at
    once). BMTrain's `comm` is required; here None means every rank.
    """
    group, size, _ = resolve_comm(comm)
    dst = global_rank_of(group, size, next_rank)
    device = get_context().device
    if hidden_state.dim() > HEADER_LEN - 2:
        raise ValueError(
            f"send_activations: {hidden_state.dim()} dimensions; at most "
            f"{HEADER_LEN - 2} fit in the header"
        )
    if hidden_state.dtype not in DTYPES:
        raise ValueError(
            f"send_activations: dtype {hidden_state.dtype} is not one of "
            f"{', '.join(map(str, DTYPES))}"
        )
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = hidden_state.dim()
    header[1] = DTYPES.index(hidden_state.dtype)
    header[2 : 2 + hidden_state.dim()] = torch.tensor(hidden_state.shape, dtype=torch.int64)
    payload = hidden_state.detach().to(
        device=device, memory_format=torch.contiguous_format, copy=True
    )
    C.send(header.to(device), dst, label="distributed send_activations header")
    C.send(payload, dst, label="distributed send_activations")


def recv_activations(prev_rank: int, comm=None) -> torch.Tensor:
    """Receives the tensor that `prev_rank` of `comm` sent with `send_activations`, on
    the context's device (blocks until it arrives). Not differentiable."""
    group, size, _ = resolve_comm(comm)
    src = global_rank_of(group, size, prev_rank)
    device = get_context().device
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    C.recv(header, src, label="distributed recv_activations header")
    ndim, code = int(header[0]), int(header[1])
    shape = header[2 : 2 + ndim].tolist()
    out = torch.empty(shape, dtype=DTYPES[code], device=device)
    C.recv(out, src, label="distributed recv_activations")
    return out
