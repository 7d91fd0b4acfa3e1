"""Pipeline schedules: GPipe, 1F1B and interleaved 1F1B, driven by one call.

    losses = run(stage, inputs, targets, loss_fn, schedule="1f1b")
    losses = run(stages_of(layers, virtual=2), inputs, targets, loss_fn,
                 schedule="interleaved")

Every rank of a pipeline calls `run` with the same micro-batches: `inputs[i]` (used by
the first stage) and `targets[i]` (used by the last, which computes
`loss_fn(output, targets[i])`). Backward runs inside the schedule, on the mean of the
micro-batch losses, so the gradients are those of one step on the whole batch; the
optimizer step is the caller's. Returns the M losses on every stage.

GPipe runs all forwards, then all backwards: a stage holds the activations of all M
micro-batches. 1F1B starts with P - s - 1 forwards on stage s (of P), then alternates
one forward and one backward, then finishes the backwards: a stage holds at most
P - s micro-batches' activations. Both leave (P - 1) / (M + P - 1) of the time idle.

Interleaved 1F1B (interleaved.py, Megatron-LM's order) gives each rank V chunks of the
model instead of one stage, and M (a multiple of P) micro-batches visit every rank V
times: the idle time shrinks to (P - 1) / (V * M + P - 1) for V times the transfers.

Telemetry: each micro-batch's forward and backward is a compute span
("stage{s}.mb{i}"; interleaved: "stage{s}.v{v}.mb{i}" for chunk v) and each send a p2p
transfer with its bytes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..comm import events
from ..comm.context import get_context
from ..comm.topology import ALONE
from ..zero import has_grad_owner, micro_batches, place
from .interleaved import Interleaved
from .p2p import Link

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _order(schedule: str, stages: int, stage: int, micro: int) -> list[tuple[str, int]]:
    """This stage's steps: ("f", i) forward of micro-batch i, ("b", i) its backward."""
    if schedule == "gpipe":
        return [("f", i) for i in range(micro)] + [("b", i) for i in range(micro)]
    warmup = min(stages - stage - 1, micro)
    steps = [("f", i) for i in range(warmup)]
    for k in range(micro - warmup):
        steps += [("f", warmup + k), ("b", k)]
    return steps + [("b", k) for k in range(micro - warmup, micro)]


class _Stage:
    """One stage's state during a schedule: inputs and outputs kept for backward."""

    def __init__(self, module, inputs, targets, loss_fn):
        ctx = get_context()
        topo = ctx.topology
        self.module, self.inputs, self.targets, self.loss_fn = module, inputs, targets, loss_fn
        self.stages, self.index = topo.pipe_size, topo.pipe_rank
        ranks = topo.ranks("pipe")
        self.first, self.last = self.index == 0, self.index == self.stages - 1
        self.prev = (
            None
            if self.first
            else Link(ranks[self.index - 1], ctx.device, f"pp {self.index - 1}<-{self.index}")
        )
        self.next = (
            None
            if self.last
            else Link(ranks[self.index + 1], ctx.device, f"pp {self.index}->{self.index + 1}")
        )
        self.micro = len(inputs)
        self.saved: dict[int, tuple] = {}  # micro-batch -> (input, output)
        self.losses = torch.zeros(self.micro, dtype=torch.float32, device=ctx.device)
        self.live_peak = 0  # most micro-batches whose activations were held at once

    def forward(self, i: int) -> None:
        if self.first:
            x = self.inputs[i]
            x = x.to(get_context().device) if torch.is_tensor(x) else x
        else:
            x = self.prev.recv_act().requires_grad_()
        with events.compute_span(f"stage{self.index}.mb{i}", "forward"):
            y = self.module(x)
            if self.last:
                loss = self.loss_fn(y, self.targets[i])
                self.losses[i] = loss.detach().float()
                y = loss / self.micro  # backward of the mean over micro-batches
        if not self.last:
            self.next.send(y, "act")
        self.saved[i] = (x, y)
        self.live_peak = max(self.live_peak, len(self.saved))

    def backward(self, i: int) -> None:
        x, y = self.saved.pop(i)
        grad = None if self.last else self.next.recv_grad(y)
        with events.compute_span(f"stage{self.index}.mb{i}", "backward"):
            y.backward(grad)
        if not self.first:
            self.prev.send(x.grad, "grad")

    def finish(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.finish()


def _check_owned(stage: torch.nn.Module) -> None:
    """With data-parallel replicas of a stage, every trainable parameter needs an owner
    that reduces its gradient over them (or the replicas drift apart silently).
    Tensor-parallel peers need none: their copies of a replicated parameter get the
    same gradient (or, sequence parallel, the layer sums it)."""
    if get_context().topology.dp_size == 1:
        return
    for name, p in stage.named_parameters():
        if p.requires_grad and not has_grad_owner(p):
            raise ValueError(
                f"pipeline.run: stage parameter {name!r} has no owner that reduces its "
                "gradient over the stage's data-parallel ranks, so they would drift apart: "
                "wrap the stage (nbtrain.wrap(stage) for ZeRO, or make it a "
                "nbtrain.DistributedModule)"
            )


def _ties_of(chunks) -> list[tuple[object, list]]:
    """(process group, this rank's copies of the parameter) per parameter shared with
    other stages or chunks, in key order (the same on every rank): one copy when
    unwrapped, one per chunk once chunks are wrapped one by one."""
    copies: dict[int, tuple] = {}
    for chunk in chunks:
        keyed = getattr(chunk, "tie_keys", None)
        if keyed is None:  # a module of its own with a `ties` list: in its order
            keyed = [(k, p, group) for k, (p, group) in enumerate(getattr(chunk, "ties", ()))]
        for key, param, group in keyed:
            held = copies.setdefault(key, (group, []))[1]
            if all(p is not param for p in held):
                held.append(param)
    return [copies[key] for key in sorted(copies)]


def _check_ties(ties) -> None:
    """With data-parallel replicas, a tied parameter's copies must be reduced over the
    stage's replicas by their owner before `run` sums them over the stages: a
    DistributedParameter (`nbtrain.wrap`, whose shards line up on every stage: the same
    shape sharded over groups of one size) or a data-parallel replicated copy."""
    if get_context().topology.dp_size == 1:
        return
    for _, params in ties:
        for p in params:
            if not has_grad_owner(p):
                raise NotImplementedError(
                    f"pipeline.run: a parameter of shape {tuple(p.shape)} shared with another "
                    f"stage (a tied embedding) is a {type(p).__name__} that no owner reduces "
                    "over the stage's data-parallel ranks before the stages sum it: wrap the "
                    "stage with nbtrain.wrap(stage), which shards it as a DistributedParameter "
                    "(interleaved: wrap each chunk)"
                )


def _sum_tied_grads(ties) -> None:
    """One logical parameter: its gradients on every stage (and every chunk of this
    rank) add up. Runs after the schedule, when each copy's gradient is already averaged
    over the stage's data-parallel ranks (a DistributedParameter reduces in backward;
    Blocks, deferred by micro_batches, never hold a tied parameter), so sum then
    average equals average then sum. Collective over each tie group."""
    for group, params in ties:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p.detach())
        total = params[0].grad
        if len(params) > 1:  # chunks wrapped one by one: a copy each
            total = torch.stack([p.grad for p in params]).sum(0)
        C.all_reduce(total, op="sum", group=group, label="pp tied grad")
        for p in params[1:]:
            p.grad.copy_(total)
        if total is not params[0].grad:
            params[0].grad.copy_(total)


def _mark_for_norms(chunks, ties) -> None:
    """Marks what a global gradient norm (`OptimManager.clip_grad_norm`) must count
    once: a stage's replicated parameters are held by that stage's ranks only (not by
    every rank of the world), and the copies of a tied parameter after the first repeat
    it (once summed, every stage holds the same gradient)."""
    for chunk in chunks:
        for p in chunk.parameters():
            place(p, stage=True)
    for group, params in ties:
        first = group is None or group is ALONE or dist.get_rank(group) == 0
        for i, p in enumerate(params):
            place(p, tied_copy=not first or i > 0)


def _name_the_stage(
    exc: BaseException, state: "_Stage", kind: str, micro: int, chunk: int | None = None
) -> None:
    """Notes on the error which stage raised, and where in the schedule."""
    what = "forward" if kind == "f" else "backward"
    where = "" if chunk is None else f" through chunk {chunk}"
    exc.add_note(
        f"nbtrain.pipeline: raised on stage {state.index} of {state.stages} "
        f"(rank {get_context().rank}), in the {what} of micro-batch {micro}{where}"
    )


def run(
    stage: torch.nn.Module,
    inputs: list,
    targets: list | None = None,
    loss_fn=None,
    schedule: str = "1f1b",
    stats: dict | None = None,
) -> list[float]:
    """Runs forward and backward of every micro-batch through the pipeline.

    Args:
        stage: this rank's part of the model (`stage_of`); it takes the previous
            stage's output (the first stage: `inputs[i]`) and returns one tensor. With
            schedule="interleaved", this rank's list of V chunks (`stages_of`), the
            same V on every rank.
        inputs, targets: the M micro-batches, the same list on every stage
            (interleaved: M a multiple of the pipeline's size P).
        loss_fn: `loss_fn(last stage's output, targets[i])` -> a scalar.
        schedule: "gpipe", "1f1b" or "interleaved".
        stats: a dict to receive "live_peak", the most micro-batches whose activations
            this stage held at once (interleaved: summed over its chunks).

    Returns the M micro-batch losses, on every stage. Collective over the pipeline.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    if not inputs:
        raise ValueError("pipeline.run needs at least one micro-batch")
    chunked = isinstance(stage, (list, tuple, torch.nn.ModuleList))
    if chunked != (schedule == "interleaved"):
        raise ValueError(
            f"pipeline.run: schedule={schedule!r} with a {type(stage).__name__}: "
            "schedule='interleaved' takes this rank's chunks (stages_of(layers, virtual=V)) "
            "and the other schedules one stage (stage_of(layers))"
        )
    chunks = list(stage) if chunked else [stage]
    for chunk in chunks:
        _check_owned(chunk)
    ties = _ties_of(chunks)
    _check_ties(ties)
    _mark_for_norms(chunks, ties)
    if chunked:
        state = Interleaved(stage, inputs, targets, loss_fn)
        steps = state.order()
    else:
        state = _Stage(stage, inputs, targets, loss_fn)
        steps = _order(schedule, state.stages, state.index, state.micro)
    if state.last and (loss_fn is None or targets is None or len(targets) != state.micro):
        raise ValueError(
            f"pipeline.run: the last stage needs loss_fn and {state.micro} "
            f"targets (got {None if targets is None else len(targets)})"
        )
    # On an error the sends still in flight are not waited for: the peer they go to may
    # have failed too (and the notebook's recovery aborts the group under them).
    # Over several micro-batches the stage's Blocks gather once and reduce their
    # gradients once, after the last (zero/accumulate.py). One micro-batch has nothing
    # to share: held, ZeRO-3 would keep every Block gathered (and its gradients whole)
    # from forward to backward, the memory of ZeRO-2.
    hold = micro_batches(*chunks) if state.micro > 1 or chunked else contextlib.nullcontext()
    try:
        with hold:
            for kind, i, *chunk in steps:  # interleaved steps name the chunk too
                state.forward(i, *chunk) if kind == "f" else state.backward(i, *chunk)
    except BaseException as exc:
        _name_the_stage(exc, state, kind, i, *chunk)
        raise
    state.finish()
    _sum_tied_grads(ties)
    if stats is not None:
        stats["live_peak"] = state.live_peak
    topo = get_context().topology
    if state.stages > 1:  # the last stage's losses, to every stage
        C.broadcast(
            state.losses, src=topo.ranks("pipe")[-1], group=topo.group("pipe"), label="pp losses"
        )
    return state.losses.tolist()
