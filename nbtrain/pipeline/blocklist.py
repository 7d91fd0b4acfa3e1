"""BMTrain's `PipelineTransformerBlockList`: a pipelined stack of blocks inside an
ordinary data-parallel model.

    blocks = PipelineTransformerBlockList([Block(Layer(), mode="PIPE") for _ in range(8)])
    h = blocks(embed(ids))          # ids: this rank's slice of the batch, as without it

Every rank builds the whole list (Blocks built as BMTrain's `Block(layer, mode="PIPE")`,
or plain modules, each made a `Block(module, mode="PIPE")` here); each pipeline stage
keeps its contiguous share of the blocks (balanced by parameter count) under their own
indices. Calling it: the ranks of one pipeline gather their batch
slices, the gathered batch runs through the stages as `num_micro_batches`
micro-batches (GPipe order; `init_distributed(num_micro_batches=...)`, default the
number of stages), the last stage's output is sent to every stage, and each rank gets
its own slice back. Backward runs through autograd: the output gradients are
gathered the same way, run back through the stages, and each rank gets the gradient
of its own input slice. The code around the list (embedding, head, loss) stays
ordinary data-parallel code, its parameters held and reduced by every rank.

Gradient scale: the blocks see the batches of P ranks at once, so their gradient is
the sum of P ranks' contributions where data parallelism averages. The gathered
output gradient is divided by P before it runs back through the stages (the blocks'
reduction over the stage's ranks then completes the average over every rank), and
the input gradients handed back are multiplied by P again (each rank's own).

State dicts hold every layer, as BMTrain's do (there on rank 0, here on every rank):
`state_dict()` gives the plain model's keys ("layers.0.…" to "layers.7.…"). Each stage
gathers its own layers over its ranks and broadcasts them along its pipeline, so the
call is collective over every rank and each rank ends up holding the whole list's
tensors (on its device); `stage_state_dict()` gives this stage's layers alone.
`load_state_dict(full)` keeps this stage's layers' tensors and takes the other stages'
keys as known, not unexpected. Every stage knows every layer's keys, so a missing key
of any layer is missing, and a key that names no layer's tensor unexpected, on every
rank alike: a strict load fails on every rank or on none (a wrong shape is found by
the stage holding the layer). nbtrain's own checkpoints (`nbtrain.save`, stream.py)
walk each stage's modules instead: each stage writes its own layers, nothing is sent
between stages.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.context import get_context
from ..zero import Block, HeldElsewhere, flat_buffers, micro_batches, place, state_keys
from .p2p import Link
from .split import balanced_split


def _numel(module: nn.Module) -> int:
    if isinstance(module, Block):  # its flat buffers' real sizes
        return sum(b.numel for b in flat_buffers(module))
    return sum(p.numel() for p in module.parameters())


def _check_blocks(modules) -> None:
    """BMTrain's checks on a pipeline's list; raises before any block is built."""
    seen = set()
    for i, m in enumerate(modules):
        if isinstance(m, Block) and m.mode != "PIPE":
            raise AssertionError(
                f"PipelineTransformerBlockList: block {i} ({m.label}) was built with "
                f'mode={m.mode!r}; build it as Block(layer, mode="PIPE"), or pass the '
                "plain layer"
            )
        inner = m.inner_module if isinstance(m, Block) else m
        if id(inner) in seen:
            if isinstance(m, Block):
                raise AssertionError(
                    f"PipelineTransformerBlockList: block {i} ({m.label}) is listed "
                    "twice; build one Block per layer"
                )
            raise ValueError(
                f"PipelineTransformerBlockList: module {i} ({type(m).__name__}) is listed "
                "twice; give each use its own copy (copy.deepcopy)"
            )
        seen.add(id(inner))


class PipelineTransformerBlockList(nn.Module):
    """A stack of blocks split into pipeline stages (BMTrain's signature).

    Args:
        modules: the blocks, in order (every rank passes the same list): Blocks built
            with mode="PIPE", or plain modules, made `Block(module, mode="PIPE")` here.
            A Block of mode "BLOCK", or one listed twice, is an AssertionError (as in
            BMTrain); a plain module listed twice is a ValueError (one layer on two
            stages cannot share its shards).
        num_hidden: hidden states passed between blocks; 1 (one tensor) is supported.

    Construction is collective when a plain module holds DistributedParameters (every
    rank wraps every module, in order). `state_dict()` is collective over every rank.
    """

    def __init__(self, modules, num_hidden: int = 1):
        super().__init__()
        if num_hidden != 1:
            raise NotImplementedError(
                f"num_hidden={num_hidden}: PipelineTransformerBlockList "
                "passes one hidden state between blocks"
            )
        modules = list(modules)
        topo = get_context().topology
        self.split = balanced_split([max(1, _numel(m)) for m in modules], topo.pipe_size)
        self.local = self.split[topo.pipe_rank]
        self._other_keys = []  # the other stages' state-dict keys, for load_state_dict
        self._elsewhere = {}  # the other stages' layers' initialiser draws
        _check_blocks(modules)
        for i, m in enumerate(modules):
            if not isinstance(m, Block):  # every rank wraps every one, in the same order
                m = Block(m, mode="PIPE")  # its stage's ranks shard and reduce it
            if i in self.local:  # the plain model's indices: its state_dict keys
                self.add_module(str(i), m)
            else:
                self._other_keys += [f"{i}.{k}" for k in state_keys(m)]
                self._elsewhere[i] = HeldElsewhere.of_block(m)  # for init_parameters
        place(self, stage=True)  # its parameters shard over the stage's ranks
        self.num_layers = len(modules)

    # -- BMTrain's list interface (len, index, iterate) ---------------------------------
    def __len__(self) -> int:
        """Every layer of the pipeline, as BMTrain counts them."""
        return self.num_layers

    def __getitem__(self, index: int) -> Block:
        """The Block of layer `index` (negative counts from the end), when this stage
        holds it. Another stage's layer is an IndexError naming the stage: in BMTrain
        every rank holds a shard of every layer, here only its stage's ranks do."""
        if not isinstance(index, int):
            raise TypeError(f"layer index {index!r}: give an int")
        i = index + self.num_layers if index < 0 else index
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {index} of a pipeline of {self.num_layers} layers")
        if str(i) not in self._modules:
            stage = next(s for s, layers in enumerate(self.split) if i in layers)
            raise IndexError(
                f"layer {i} is held by pipeline stage {stage}, and this rank is on stage "
                f"{get_context().topology.pipe_rank}: index this stage's layers "
                f"({list(self.local)}), or read the layer on a rank of stage {stage}"
            )
        return self._modules[str(i)]

    def __iter__(self):
        """This stage's Blocks, in order (all of them without a pipeline)."""
        return iter([self._modules[str(i)] for i in self.local])

    def _init_children(self):
        """Every layer in order for init_parameters (zero/views.py): this stage's
        Blocks, and the other stages' layers as draws to make and drop."""
        return [(str(i), self._modules.get(str(i)) or self._elsewhere[i]) for i in range(len(self))]

    def run_stage(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.local:
            x = self._modules[str(i)](x)
        return x

    def forward(self, hidden: torch.Tensor, *args):
        if args:
            raise NotImplementedError(
                "PipelineTransformerBlockList takes the hidden state "
                "only; extra block arguments are not passed yet"
            )
        if get_context().topology.pipe_size == 1:
            return self.run_stage(hidden)
        if torch.is_grad_enabled() and hidden.is_floating_point() and not hidden.requires_grad:
            # The blocks' parameters reach autograd through the input only: without a
            # gradient to carry, backward would never run through the stages.
            hidden = hidden.detach().requires_grad_()
        return _Pipelined.apply(self, hidden)

    # -- state dicts -----------------------------------------------------------------
    def stage_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """This stage's layers alone, under their plain keys: collective over this
        stage's ranks only (nothing crosses the pipeline)."""
        return super().state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Every layer's tensors under the plain model's keys, on every rank: each stage
        gathers its own layers over its ranks, then each stage in turn broadcasts them
        along the pipeline. Collective over every rank."""
        if args:  # torch's older positional form: state_dict(destination, prefix, keep_vars)
            given = dict(zip(("destination", "prefix", "keep_vars"), args))
            destination = given.get("destination", destination)
            prefix = given.get("prefix", prefix)
            keep_vars = given.get("keep_vars", keep_vars)
        if get_context().topology.pipe_size == 1:
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        own = self.stage_state_dict(prefix=prefix, keep_vars=keep_vars)
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        for part, metadata in _exchange(own):
            destination.update(part)
            if hasattr(destination, "_metadata"):
                destination._metadata.update(metadata)
        return destination

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # The other stages' layers: their keys are known, their tensors not kept here.
        # Reported alike on every rank, so a strict load fails on all of them or none.
        others = [prefix + k for k in self._other_keys]
        known = set(others)
        unexpected_keys[:] = [k for k in unexpected_keys if k not in known]
        missing_keys.extend(k for k in others if k not in state_dict)


def _exchange(own: dict):
    """(tensors, state-dict metadata) of every stage in order: this stage's `own`, the
    others' received along this rank's pipeline (one object all-gather for the names,
    shapes and dtypes, then one broadcast a tensor, each from its stage). Collective
    over every rank of the pipeline."""
    topo, group, ranks = _pipe()
    device = get_context().device
    described = (
        [(k, tuple(v.shape), v.dtype) for k, v in own.items()],
        dict(getattr(own, "_metadata", {})),
    )
    everyone = C.all_gather_object(described, group=group)
    for stage, (entries, metadata) in enumerate(everyone):
        mine = stage == topo.pipe_rank
        part = own if mine else OrderedDict()
        for key, shape, dtype in entries:
            if mine:
                out = own[key].detach().to(device).contiguous()
            else:
                out = part[key] = torch.empty(shape, dtype=dtype, device=device)
            if out.numel():
                C.broadcast(out, src=ranks[stage], group=group, label="pp state_dict")
        yield part, metadata


def _pipe():
    topo = get_context().topology
    return topo, topo.group("pipe"), topo.ranks("pipe")


def _gather(x: torch.Tensor, label: str) -> torch.Tensor:
    """Every pipeline rank's `x` (same shape), stacked along the first dimension."""
    topo, group, _ = _pipe()
    x = x.contiguous()
    out = torch.empty((topo.pipe_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out.view(-1), x.view(-1), group=group, label=label)
    return out


def _share(x: torch.Tensor | None, like: torch.Tensor, src_stage: int, label: str):
    """Stage `src_stage`'s tensor `x` (shaped like `like`) on every stage."""
    topo, group, ranks = _pipe()
    out = x.contiguous() if topo.pipe_rank == src_stage else torch.empty_like(like)
    C.broadcast(out, src=ranks[src_stage], group=group, label=label)
    return out


class _Pipelined(torch.autograd.Function):
    """This rank's slice -> the gathered batch through every stage -> this rank's slice."""

    @staticmethod
    def forward(ctx, blocks: PipelineTransformerBlockList, hidden: torch.Tensor):
        topo, _, ranks = _pipe()
        stages, me = topo.pipe_size, topo.pipe_rank
        device = hidden.device
        micro = get_context().num_micro_batches or stages
        full = _gather(hidden, "pp gather batch")
        if full.shape[0] % micro:
            raise ValueError(
                f"PipelineTransformerBlockList: the gathered batch of "
                f"{full.shape[0]} rows does not split into num_micro_batches="
                f"{micro}: choose a number that divides it"
            )
        prev = None if me == 0 else Link(ranks[me - 1], device, f"pp {me - 1}<-{me}")
        nxt = None if me == stages - 1 else Link(ranks[me + 1], device, f"pp {me}->{me + 1}")
        saved, outputs = [], []
        with torch.enable_grad(), micro_batches(blocks):  # ZeRO-3: one gather per step
            for chunk in full.chunk(micro):
                x = (chunk if prev is None else prev.recv_act()).detach().requires_grad_()
                y = blocks.run_stage(x)
                if nxt is not None:
                    nxt.send(y, "act")
                else:
                    outputs.append(y.detach())
                saved.append((x, y))
        for link in (prev, nxt):
            if link is not None:
                link.finish()
        last = torch.cat(outputs) if nxt is None else None
        like = (
            torch.empty(
                (full.shape[0], *saved[0][1].shape[1:]), dtype=saved[0][1].dtype, device=device
            )
            if last is None
            else last
        )
        out = _share(last, like, stages - 1, "pp share output")
        ctx.blocks, ctx.saved, ctx.rows, ctx.like_input = blocks, saved, hidden.shape[0], full
        return out.chunk(stages)[me].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        topo, _, ranks = _pipe()
        stages, me = topo.pipe_size, topo.pipe_rank
        device = grad.device
        full_grad = _gather(grad, "pp gather grad") / stages  # see the module docstring
        prev = None if me == 0 else Link(ranks[me - 1], device, f"pp {me - 1}<-{me}")
        nxt = None if me == stages - 1 else Link(ranks[me + 1], device, f"pp {me}->{me + 1}")
        grads = full_grad.chunk(len(ctx.saved)) if nxt is None else None
        input_grads = []
        with micro_batches(ctx.blocks):  # the Blocks' gradients reduced once, after the last
            for i, (x, y) in enumerate(ctx.saved):
                g = grads[i] if nxt is None else nxt.recv_grad(y)
                with torch.enable_grad():
                    y.backward(g)
                if prev is not None:
                    prev.send(x.grad, "grad")
                else:
                    input_grads.append(x.grad)
        for link in (prev, nxt):
            if link is not None:
                link.finish()
        first = torch.cat(input_grads) * stages if prev is None else None
        full_input_grad = _share(first, ctx.like_input, 0, "pp share input grad")
        ctx.saved = None
        return None, full_input_grad.chunk(stages)[me].clone()
