"""The distributed context: one object per process, made by `init_distributed`.

Every other module reads rank, world size, device and process group from the
context rather than from globals scattered across files. The BMTrain-style free
functions (`rank()`, `world_size()`, ...) are thin readers of it.
"""

from __future__ import annotations

import atexit
import difflib
import os
import random
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from . import collectives, links, teardown
from . import topology as _topology
from .renamed import renamed_kwargs
from .store import rendezvous_store, use_interface_toward
from .topology import Topology

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """Topology of this process, validated once.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        world_size: number of ranks in the default group.
        local_rank: rank on this host (picks the GPU).
        backend: "nccl" or "gloo".
        device: where parameters and collectives live (cuda:local_rank or cpu).
        seed: the seed every rank was given.
        group: the process group collectives use (None means the default group).
        topology: tensor/data/pipeline coordinates and their process groups.
        num_micro_batches: BMTrain's pipeline setting, kept for the pipeline.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    seed: int
    group: object = None
    topology: Topology = Topology()
    num_micro_batches: int | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world of size {self.world_size}")


_CONTEXT: DistContext | None = None
_EXIT_HOOK_REGISTERED = False
# How long the exit hook lets nbtrain collectives still in flight finish before it
# gives up on a clean teardown (a peer that never comes would otherwise hold the
# process for the whole process-group timeout).
EXIT_DRAIN_S = 5.0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def pick_backend(backend: str | None) -> str:
    """The process-group backend to use: `backend` checked, or for None nccl when a GPU
    is visible, else gloo. Raises ValueError naming the fix for any other. Local."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}: use 'nccl' (CUDA) or 'gloo' (CPU), or None to pick")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and no GPU is visible; use backend='gloo'")
    return backend


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for the library itself
        pass


# Called first by every `init_distributed`, whichever name it is reached by
# (`nbtrain.init_distributed` is this function). The telemetry layer adds its
# recorder's subscription here, so the recorder starts with the run; this layer
# imports nothing above it, and importing nbtrain subscribes nothing.
INIT_HOOKS: list = []


@renamed_kwargs(timeout="pg_timeout_s")
def init_distributed(
    seed: int = 0,
    backend: str | None = None,
    pg_timeout_s: float | timedelta = 600.0,
    tp_size: int = 1,
    pipe_size: int = 1,
    num_micro_batches: int | None = None,
    ep_size: int = 1,
    cp_size: int = 1,
    **bmtrain_options,
) -> DistContext:
    """Initialise torch.distributed for this process and return the context.

    Reads the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT). With none set it makes a world of one (an in-memory store, no
    listener). If torch.distributed is already initialised (by the user, by a test
    harness, or by an earlier call) the existing default group is adopted.
    Safe to call twice: the second call returns the same context.

    Args:
        seed: seeds python, numpy and torch identically on every rank.
        backend: "nccl", "gloo" or None (nccl when CUDA is present, else gloo).
        pg_timeout_s: process-group timeout, seconds (or a timedelta); `timeout=`
            is its deprecated old name.
        tp_size: ranks that split each tensor-parallel layer (BMTrain's keyword); the
            world size must be a multiple of tp_size x pipe_size. Tensor-parallel peers
            are neighbouring ranks: tp_rank = rank % tp_size.
        pipe_size: pipeline stages (outermost: a stage's ranks are neighbours).
        ep_size: expert-parallel ranks (nbtrain.moe), carved from the data-parallel
            ranks: it must divide world / (tp_size x pipe_size).
        cp_size: context-parallel ranks (ring attention) splitting each sequence,
            carved from the data-parallel ranks likewise.
        num_micro_batches: BMTrain's pipeline keyword, kept in the context.
        **bmtrain_options: the other keywords of BMTrain's `init_distributed`, so its
            scripts run unchanged: `init_method` ("env://", the only rendezvous BMTrain
            scripts use; nbtrain reads the same variables), `zero_level` (2 or 3; in
            nbtrain each Block chooses), `loss_scale_factor` and `loss_scale_steps`
            (OptimManager's own arguments here). BMTrain's `pipe_size=-1` means no
            pipeline. Any other keyword is a TypeError naming it and the accepted ones
            (a misspelt `pipe_sise=2` must not run without a pipeline).

    Called again on an initialised process (a notebook cell on every rank, a script
    on a notebook engine) it seeds again, and with other sizes makes the
    new topology's groups; the process group stays.

    Starts telemetry's event recorder (`nbtrain.telemetry.record`) first.

    Collective: every rank calls this.
    """
    global _CONTEXT
    for hook in INIT_HOOKS:
        hook()
    if isinstance(seed, str):  # BMTrain's first positional argument is init_method
        raise TypeError(
            f"init_distributed({seed!r}, ...): nbtrain's first argument is the "
            "seed. Pass BMTrain's arguments by keyword: "
            f"init_distributed(init_method={seed!r}, seed=...)"
        )
    _check_bmtrain_options(bmtrain_options)
    if pipe_size == -1:  # BMTrain's default: no pipeline
        pipe_size = 1
    if _CONTEXT is not None and dist.is_initialized():
        topo = _CONTEXT.topology
        sizes = (tp_size, pipe_size, ep_size, cp_size)
        if (topo.tp_size, topo.pipe_size, topo.ep_size, topo.cp_size) != sizes:
            _topology.check_sizes(_CONTEXT.world_size, *sizes)
            topo = _topology.build(_CONTEXT.rank, _CONTEXT.world_size, *sizes)
        _seed_everything(seed)  # a script's init_distributed(seed=...) still seeds
        changed = dict(topology=topo, seed=seed, num_micro_batches=num_micro_batches)
        if any(
            getattr(_CONTEXT, k) is not v and getattr(_CONTEXT, k) != v for k, v in changed.items()
        ):
            _CONTEXT = replace(_CONTEXT, **changed)
        return _CONTEXT
    timeout = pg_timeout_s
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))

    if dist.is_initialized():
        backend = dist.get_backend()
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int(
            "LOCAL_RANK", rank if world <= max(torch.cuda.device_count(), 1) else 0
        )
    else:
        backend = pick_backend(backend)
        have_env = any(v in os.environ for v in ("RANK", "WORLD_SIZE"))
        rank = _env_int("RANK", 0)
        world = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", rank)
        # before any rank waits for others
        _topology.check_sizes(world, tp_size, pipe_size, ep_size, cp_size)
        # Before the group exists, so that its default arguments are None, not the group.
        teardown.import_group_functional()
        if have_env and world > 1:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
            if missing:
                raise ValueError(
                    f"WORLD_SIZE={world} but {', '.join(missing)} is not set; "
                    "launch with torchrun or set the rendezvous address"
                )
            if backend == "gloo":  # gloo's connections on the interface toward MASTER_ADDR
                use_interface_toward(os.environ["MASTER_ADDR"])
            with links.recording():  # the group's connections, closed on a failure
                # The store listens on MASTER_ADDR only, not on every interface (store.py).
                store = rendezvous_store(rank, world, timeout)
                dist.init_process_group(
                    backend, store=store, rank=rank, world_size=world, timeout=timeout
                )
        else:
            # A world of one: an in-memory store, so nothing listens on a port.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
            rank, world, local_rank = 0, 1, 0

    teardown.import_group_functional()
    teardown.unpin_group_defaults()
    _register_exit_hook()
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _seed_everything(seed)
    with links.recording():
        topo = _topology.build(rank, world, tp_size, pipe_size, ep_size, cp_size)
    _CONTEXT = DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        backend=backend,
        device=device,
        seed=seed,
        topology=topo,
        num_micro_batches=num_micro_batches,
    )
    return _CONTEXT


_OWN_KEYWORDS = (
    "seed",
    "backend",
    "pg_timeout_s",
    "tp_size",
    "pipe_size",
    "num_micro_batches",
    "ep_size",
    "cp_size",
)
# BMTrain 1.x keywords that have no effect here, with what they must be (None: any).
_BMTRAIN_KEYWORDS = {
    "init_method": ("env://",),
    "zero_level": (2, 3),
    "loss_scale_factor": None,
    "loss_scale_steps": None,
}


def _check_bmtrain_options(options: dict) -> None:
    """BMTrain's extra keywords pass; anything else is a misspelling, named."""
    for key, value in options.items():
        if key not in _BMTRAIN_KEYWORDS:
            close = difflib.get_close_matches(key, _OWN_KEYWORDS + tuple(_BMTRAIN_KEYWORDS), 1)
            hint = f" Did you mean {close[0]}=?" if close else ""
            raise TypeError(
                f"init_distributed() got an unknown keyword {key}={value!r}.{hint} "
                f"It takes {', '.join(_OWN_KEYWORDS)}, and BMTrain's "
                f"{', '.join(_BMTRAIN_KEYWORDS)}."
            )
        allowed = _BMTRAIN_KEYWORDS[key]
        if allowed is not None and value not in allowed:
            raise ValueError(
                f"init_distributed({key}={value!r}): nbtrain accepts "
                f"{' or '.join(map(repr, allowed))} here"
                + (
                    " (set MASTER_ADDR and MASTER_PORT, as torchrun does)"
                    if key == "init_method"
                    else " (each Block takes its own zero_level)"
                )
            )


def rebuild_topology() -> None:
    """Make the topology's groups again (after the default group was rebuilt).

    Collective: every rank calls it (nbtrain.comm.recovery does)."""
    global _CONTEXT
    if _CONTEXT is None:
        return
    topo = _CONTEXT.topology
    with links.recording():
        _CONTEXT = replace(
            _CONTEXT,
            topology=_topology.build(
                _CONTEXT.rank,
                _CONTEXT.world_size,
                topo.tp_size,
                topo.pipe_size,
                topo.ep_size,
                topo.cp_size,
            ),
        )


def get_context() -> DistContext:
    """The context made by `init_distributed`; a clear error if there is none."""
    if _CONTEXT is None or not dist.is_initialized():
        raise RuntimeError("nbtrain is not initialised: call nbtrain.init_distributed() first")
    return _CONTEXT


def is_initialized() -> bool:
    return _CONTEXT is not None and dist.is_initialized()


def shutdown(barrier: bool = True) -> None:
    """End distributed work on this rank: drain, synchronise, destroy the group.

    Waits for nbtrain's collectives still in flight, then for every rank (a
    barrier, so no rank closes its connections while a peer still uses them),
    then destroys the process group and forgets the context (a fresh
    `init_distributed` may follow). Destroying the group joins the backend's
    worker threads, so when this returns none is left to touch Python objects
    while the interpreter shuts down (see teardown.py).

    Args:
        barrier: False skips the wait and the barrier: a local teardown for error
            paths, where peers may never arrive.

    Collective with barrier=True (every rank calls it); safe without a group and
    safe twice. `init_distributed` also registers a local teardown at interpreter
    exit for programs that never call this or `destroy_process_group`.
    """
    global _CONTEXT
    try:
        if barrier and dist.is_initialized() and dist.get_world_size() > 1:
            collectives.wait_in_flight()
            if _CONTEXT is not None and _CONTEXT.device.type == "cuda":
                torch.cuda.synchronize(_CONTEXT.device)
            collectives.barrier(label="shutdown")  # watched: a rank that never comes is named
    finally:
        if dist.is_initialized():
            teardown.destroy_group()
        collectives.IN_FLIGHT.clear()
        collectives.WATCH.reset()
        _CONTEXT = None


def _exit_cleanly() -> None:
    """At interpreter exit: destroy a group the program left alive.

    Runs from `atexit` (registered by `init_distributed`), before the interpreter
    starts shutting down, so the backend's threads end while they still may take
    the GIL. Local only, no barrier: ranks reach their exit at different times,
    some on an error. When an nbtrain collective is still in flight after
    `EXIT_DRAIN_S` (a peer is gone or stuck), the group is left alone: destroying
    it would wait for that collective until the process-group timeout.
    """
    if _CONTEXT is None or not dist.is_initialized():
        return
    try:
        if collectives.wait_in_flight(timeout_s=EXIT_DRAIN_S):
            shutdown(barrier=False)
    except Exception:  # the process is exiting; a broken group must not stop that
        pass


def _register_exit_hook() -> None:
    # atexit runs handlers last-registered first: those registered after
    # init_distributed (telemetry's JSONL writers) run before this one.
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED:
        atexit.register(_exit_cleanly)
        _EXIT_HOOK_REGISTERED = True


def rank() -> int:
    """This process's global rank."""
    return get_context().rank


def world_size() -> int:
    """Number of ranks."""
    return get_context().world_size


def synchronize() -> None:
    """Barrier over all ranks (waits for queued CUDA work first).

    Collective: every rank calls this. A rank that never comes makes the others
    raise `CollectiveError` naming it, after the process-group timeout.
    """
    ctx = get_context()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    collectives.barrier(label="synchronize")


def print_rank(*args, rank: int = 0, **kwargs) -> None:
    """`print` on one rank only (rank 0 by default)."""
    if get_context().rank == rank:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
