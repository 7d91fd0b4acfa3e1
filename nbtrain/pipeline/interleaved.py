"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages): V model chunks on every rank.

    stages = nbtrain.pipeline.stages_of(layers, virtual=2)     # this rank's 2 chunks
    losses = nbtrain.pipeline.run(stages, inputs, targets, loss_fn, schedule="interleaved")

The layers are cut into P * V contiguous parts (P pipeline ranks); rank p holds parts
p, p + P, p + 2P, ... (its chunk v is part v * P + p). A micro-batch passes every rank
V times: the last rank hands chunk v's output to the first rank's chunk v + 1. A rank
runs M * V chunk forwards and as many backwards around P - 1 idle chunk-steps, so the
bubble is (P - 1) / (V * M + P - 1), about V times smaller than 1F1B's, for V times as
many transfers.

The order is Megatron-LM's (`forward_backward_pipelining_with_interleaving`): the
micro-batches go in groups of P, each group through chunk 0, then chunk 1, ... (so M
must be a multiple of P); rank p first runs 2 (P - p - 1) + (V - 1) P forwards (all
M * V of them when M == P), then alternates one forward and one backward (backwards take
the chunks in reverse), then finishes the backwards. Rank p thus holds at most that
warmup plus one chunk's activations of a micro-batch; GPipe would hold M * V.

Transfers (p2p.Mailbox): one pair of ranks carries activations and gradients of several
chunks in each direction, matched by their order, not by tags. Each chunk's output
keeps one dtype and shape over the micro-batches (announced once, with its first).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import events
from ..comm.context import get_context
from ..comm.topology import ALONE
from .p2p import Mailbox
from .split import Stage, _tie_groups, balanced_split, param_keys


class VirtualStages(nn.ModuleList):
    """This rank's V model chunks, each a `Stage`: chunk v is part v * P + pipe_rank.

    `ties` lists, like `Stage.ties`, the parameters that several chunks share (a tied
    embedding; chunks on several ranks, or of this rank only: group `ALONE`), each copy
    once: `run` sums their gradients over those chunks after the schedule. Each chunk keeps
    its own share of them (`chunk.ties`), so a plain list of the chunks, wrapped one by one,
    passed to `run` keeps them too.
    """

    @property
    def ties(self) -> list:
        return _unique_ties(self)


def _unique_ties(chunks) -> list[tuple[nn.Parameter, object]]:
    """The chunks' ties, a parameter held by two chunks (unwrapped, one object) once."""
    seen, out = set(), []
    for chunk in chunks:
        for key, param, group in chunk.tie_keys:
            if (key, id(param)) not in seen:
                seen.add((key, id(param)))
                out.append((param, group))
    return out


def stages_of(layers, virtual: int, split: list[range] | None = None) -> VirtualStages:
    """This rank's chunks for `run(..., schedule="interleaved")`.

    Args:
        layers: the whole model as consecutive modules (the same on every rank).
        virtual: V, the chunks per rank; the layers are cut into pipe_size * V parts.
        split: one range of layer indices per part (pipe_size * V of them, in order);
            by default balanced by parameter count (`balanced_split`).

    Returns V `Stage`s: chunk v holds the layers of part v * pipe_size + pipe_rank,
    each named by its index in the whole model, as in `stage_of`.
    A parameter shared by chunks of several ranks (a tied embedding) is summed over
    them by `run`, and one shared by chunks of one rank by autograd. With data
    parallelism, wrap each chunk (`[nbtrain.wrap(chunk) for chunk in stages]`) and pass
    that list to `run`: each chunk's copy of a shared parameter is then a
    DistributedParameter of its own, averaged over the chunk's data-parallel ranks, and
    `run` adds the copies up on each rank and over the ranks sharing them.

    Collective over the world: every rank calls it (the ties' process groups).
    """
    layers = list(layers)
    topo = get_context().topology
    stages = topo.pipe_size
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual={virtual!r}: the number of chunks per rank, an int >= 1")
    parts = stages * virtual
    if split is None:
        if parts > len(layers):
            raise ValueError(
                f"{len(layers)} layers cannot fill pipe_size {stages} x "
                f"virtual {virtual} = {parts} chunks: use virtual <= "
                f"{max(1, len(layers) // stages)}"
            )
        split = balanced_split(
            [max(1, sum(p.numel() for p in m.parameters())) for m in layers], parts
        )
    if len(split) != parts:
        raise ValueError(
            f"split has {len(split)} ranges for pipe_size {stages} x virtual "
            f"{virtual} = {parts} parts: give one range per part, in order"
        )
    per_rank = [[i for v in range(virtual) for i in split[v * stages + p]] for p in range(stages)]
    chunks = []
    for v in range(virtual):
        part = split[v * stages + topo.pipe_rank]
        chunks.append(Stage([layers[i] for i in part], positions=part))
    ties = _tie_groups(layers, per_rank)
    ties += _ties_within_rank(chunks, param_keys(layers), {id(p) for _, p, _ in ties})
    ties.sort(key=lambda tie: tie[0])
    for chunk in chunks:
        mine = {id(p) for p in chunk.parameters()}
        chunk.set_ties([tie for tie in ties if id(tie[1]) in mine])
    return VirtualStages(chunks)


def _ties_within_rank(chunks: list[Stage], keys: dict[int, int], across: set[int]) -> list:
    """Parameters that several of this rank's chunks hold and no other rank does (not in
    `across`, the ids of those tied over ranks): a
    group of this rank alone, so that once the chunks are wrapped one by one (each its
    own copy) `run` still adds the copies' gradients up."""
    holders: dict[int, tuple] = {}
    for v, chunk in enumerate(chunks):
        for p in chunk.parameters():
            holders.setdefault(id(p), (p, set()))[1].add(v)
    return [
        (keys[id(p)], p, ALONE) for p, vs in holders.values() if len(vs) > 1 and id(p) not in across
    ]


def interleaved_order(
    stages: int, stage: int, virtual: int, micro: int
) -> list[tuple[str, int, int]]:
    """Rank `stage`'s steps (of `stages` ranks, `virtual` chunks each, `micro`
    micro-batches, a multiple of `stages`): ("f", i, v) is the forward of micro-batch i
    through chunk v, ("b", i, v) its backward. Megatron-LM's order."""
    total = micro * virtual
    if micro == stages:  # as Megatron-LM: one group of micro-batches, every forward first
        warmup = total
    else:
        warmup = min(2 * (stages - stage - 1) + (virtual - 1) * stages, total)

    def step(kind: str, k: int) -> tuple[str, int, int]:
        group, rest = divmod(k, stages * virtual)
        chunk = rest // stages
        return (kind, group * stages + rest % stages, chunk if kind == "f" else virtual - 1 - chunk)

    steps = [step("f", k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [step("f", warmup + k), step("b", k)]
    return steps + [step("b", k) for k in range(total - warmup, total)]


def sends_of(stages: int, stage: int, virtual: int, micro: int) -> list[tuple[int, tuple]]:
    """Rank `stage`'s messages in the order it sends them: (destination pipe rank, key),
    key = ("act" or "grad", the sender's part, micro-batch). A receiver filters its
    peer's list to learn the order in which the peer's messages reach it."""
    last = stages * virtual - 1
    out = []
    for kind, i, v in interleaved_order(stages, stage, virtual, micro):
        part = v * stages + stage
        if kind == "f" and part < last:
            out.append(((stage + 1) % stages, ("act", part, i)))
        elif kind == "b" and part > 0:
            out.append(((stage - 1) % stages, ("grad", part, i)))
    return out


class Interleaved:
    """One rank's state during the interleaved schedule: its chunks, its mailboxes with
    the previous and next rank, and each chunk's input and output kept for backward."""

    def __init__(self, chunks, inputs, targets, loss_fn):
        ctx = get_context()
        topo = ctx.topology
        self.chunks, self.inputs, self.targets, self.loss_fn = chunks, inputs, targets, loss_fn
        self.stages, self.index = topo.pipe_size, topo.pipe_rank
        self.virtual, self.micro = len(chunks), len(inputs)
        if not self.virtual:
            raise ValueError(
                "schedule='interleaved' needs this rank's chunks, at least one: "
                "pass stages_of(layers, virtual=V)"
            )
        self.parts = self.stages * self.virtual
        if self.micro % self.stages:
            raise ValueError(
                f"schedule='interleaved' runs micro-batches in groups of pipe_size: "
                f"M={self.micro} micro-batches is not a multiple of P={self.stages}; split "
                f"the batch into a multiple of {self.stages} micro-batches (e.g. "
                f"{-(-self.micro // self.stages) * self.stages}) or use schedule='1f1b'"
            )
        self.first, self.last = self.index == 0, self.index == self.stages - 1
        self.prev, self.next = (self.index - 1) % self.stages, (self.index + 1) % self.stages
        ranks = topo.ranks("pipe")
        self.boxes = {}  # pipe rank -> Mailbox (one when prev == next)
        for peer in (self.prev, self.next):
            incoming = [
                key
                for dst, key in sends_of(self.stages, peer, self.virtual, self.micro)
                if dst == self.index
            ]
            self.boxes[peer] = Mailbox(
                ranks[peer], ranks[self.index], ctx.device, f"pp {self.index}->{peer}", incoming
            )
        self.saved: dict[tuple, tuple] = {}  # (chunk, micro-batch) -> (input, output)
        self.losses = torch.zeros(self.micro, dtype=torch.float32, device=ctx.device)
        self.live_peak = 0  # most chunk activations of micro-batches held at once

    def order(self) -> list[tuple[str, int, int]]:
        return interleaved_order(self.stages, self.index, self.virtual, self.micro)

    def forward(self, i: int, v: int) -> None:
        part = v * self.stages + self.index
        if part == 0:
            x = self.inputs[i]
            x = x.to(get_context().device) if torch.is_tensor(x) else x
        else:
            x = self.boxes[self.prev].recv(("act", part - 1, i)).requires_grad_()
        with events.compute_span(f"stage{self.index}.v{v}.mb{i}", "forward"):
            y = self.chunks[v](x)
            if part == self.parts - 1:
                loss = self.loss_fn(y, self.targets[i])
                self.losses[i] = loss.detach().float()
                y = loss / self.micro  # backward of the mean over micro-batches
        if part < self.parts - 1:
            self.boxes[self.next].send(y, ("act", part, i))
        self.saved[(v, i)] = (x, y)
        self.live_peak = max(self.live_peak, len(self.saved))

    def backward(self, i: int, v: int) -> None:
        x, y = self.saved.pop((v, i))
        part = v * self.stages + self.index
        grad = None
        if part < self.parts - 1:
            grad = self.boxes[self.next].recv(("grad", part + 1, i))
        with events.compute_span(f"stage{self.index}.v{v}.mb{i}", "backward"):
            y.backward(grad)
        if part > 0:
            self.boxes[self.prev].send(x.grad, ("grad", part, i))

    def finish(self) -> None:
        for box in self.boxes.values():
            box.finish()
