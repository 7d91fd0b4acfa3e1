"""Deferred initialisation: each rank keeps only its own shard.

`init_parameters(model)` draws as BMTrain does: every rank runs each parameter's
`init_method` on a fresh full-shape tensor from the current torch generator of the
parameter's device (what `torch.manual_seed` and `init_distributed(seed=...)` set),
in the model's parameter order, and keeps its part. Every rank draws every parameter,
those it holds no part of included (another stage's layers too), so every rank's
generator stays in step and the same seed gives the same weights as a plain model
initialised in that order, at any world size and in any container (DistributedModule,
Block, TransformerBlockList, PipelineTransformerBlockList). Its cost: one full
parameter at a time on each rank.

`init_parameters(model, by_name=True)` never holds a full parameter: a value depends
only on the seed given to `init_distributed` and the parameter's name. For the
element-wise initialisers of `torch.nn.init` (normal, uniform, constants, truncated
normal, and Kaiming/Xavier, whose scale comes from the full shape) the flattened
parameter is cut into fixed chunks of CHUNK_NUMEL elements, each drawn from its own
generator seeded by (seed, name, chunk index): a rank draws only the chunks that
overlap its shard, and any world size reassembles the same tensor. Any other
initialiser runs on one full-shape tensor at a time, of which the rank keeps its slice.
"""

from __future__ import annotations

import inspect
import math
import zlib

import torch
from torch import nn

from ..comm.context import get_context
from ..tensor_parallel.slices import slice_from_full

CHUNK_NUMEL = 1 << 16  # 256 KiB of fp32 per draw: a rank overshoots its shard by < 2 chunks
_INIT = nn.init


def _seed_for(name: str, chunk: int = -1) -> int:
    key = f"{name}#{chunk}".encode()
    return (get_context().seed * 1_000_003 + zlib.crc32(key)) % (2**63)


def init_full(name: str, shape, dtype, device, init_method) -> torch.Tensor:
    """Runs `init_method` on a fresh full-shape tensor with a name-derived seed."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(_seed_for(name))
        full = torch.empty(shape, dtype=dtype, device=device)
        with torch.no_grad():
            init_method(full)
    return full


def _unwrap(init_method):
    """(func, args, kwargs) of a ParameterInitializer, or of a bare function."""
    func = getattr(init_method, "func", init_method)
    return func, getattr(init_method, "args", ()), getattr(init_method, "kwargs", {})


def _elementwise(init_method, shape):
    """A function (chunk tensor, generator) -> None drawing i.i.d. values the way
    `init_method` would for a tensor of `shape`; None when not element-wise."""
    func, args, kwargs = _unwrap(init_method)
    try:
        bound = inspect.signature(func).bind(torch.empty(0), *args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    p = dict(bound.arguments)
    p.pop("tensor", None)
    p.pop("generator", None)
    meta = torch.empty(shape, device="meta")
    if func in (_INIT.normal_, _INIT.uniform_, _INIT.trunc_normal_):
        return lambda t, g: func(t, **p, generator=g)
    if func in (_INIT.zeros_, _INIT.ones_, _INIT.constant_):
        return lambda t, g: func(t, **p)
    if func in (_INIT.kaiming_uniform_, _INIT.kaiming_normal_):
        fan = _INIT._calculate_correct_fan(meta, p["mode"])
        std = _INIT.calculate_gain(p["nonlinearity"], p["a"]) / math.sqrt(fan)
        if func is _INIT.kaiming_uniform_:
            return lambda t, g: _INIT.uniform_(
                t, -math.sqrt(3) * std, math.sqrt(3) * std, generator=g
            )
        return lambda t, g: _INIT.normal_(t, 0.0, std, generator=g)
    if func in (_INIT.xavier_uniform_, _INIT.xavier_normal_):
        fan_in, fan_out = _INIT._calculate_fan_in_and_fan_out(meta)
        std = p["gain"] * math.sqrt(2.0 / (fan_in + fan_out))
        if func is _INIT.xavier_uniform_:
            return lambda t, g: _INIT.uniform_(
                t, -math.sqrt(3) * std, math.sqrt(3) * std, generator=g
            )
        return lambda t, g: _INIT.normal_(t, 0.0, std, generator=g)
    return None


def init_range(name: str, shape, dtype, device, init_method, start: int, stop: int) -> torch.Tensor:
    """Initial values of elements [start, stop) of the flattened parameter `name`."""
    draw = _elementwise(init_method, tuple(shape))
    if draw is None:
        full = init_full(name, shape, dtype, device, init_method)
        return full.reshape(-1)[start:stop]
    out = torch.empty(stop - start, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    with torch.no_grad():
        for chunk in range(start // CHUNK_NUMEL, (stop - 1) // CHUNK_NUMEL + 1):
            lo = chunk * CHUNK_NUMEL
            values = torch.empty(
                min(CHUNK_NUMEL, math.prod(shape) - lo), dtype=dtype, device=device
            )
            gen.manual_seed(_seed_for(name, chunk))
            draw(values, gen)
            a, b = max(start, lo), min(stop, lo + values.numel())
            out[a - start : b - start] = values[a - lo : b - lo]
    return out


# -- BMTrain's draw: the current generator, full tensors, every rank ------------------


def draw_full(shape, dtype, device, init_method, tp_meta=None) -> torch.Tensor:
    """`init_method` run on a fresh tensor of `shape` from the current generator of
    `device`, flattened. For a tensor-parallel slice (`tp_meta`: its Placement, with
    the full shape and split), the full logical tensor is drawn and this rank's slice
    kept, as BMTrain does, so every tp size draws the same weights. Local."""
    full_shape = tuple(tp_meta.full_shape) if tp_meta is not None else tuple(shape)
    value = torch.empty(full_shape, dtype=dtype, device=device)
    with torch.no_grad():
        init_method(value)
    if tp_meta is not None:
        value = slice_from_full(value, tp_meta, tuple(shape))
    return value.reshape(-1)


def _block_items(block):
    """(group, slot, entry, init) of each parameter a Block holds, in the module's
    parameter order (the order BMTrain's block draws them in)."""
    items = [
        (group, slot, entry, init)
        for group, inits in zip(block._groups, block._init_methods)
        for slot, entry, init in zip(group.layout.slots, group.entries, inits)
    ]
    order = {id(e): i for i, e in enumerate(getattr(block, "_init_order", ()))}
    return sorted(items, key=lambda item: order.get(id(item[2]), 0))


def init_block(block, prefix: str = "", by_name: bool = False) -> None:
    """Runs a Block's deferred initialisers into this rank's part of its shards (see
    the module's notes for the two ways of drawing). Local."""
    for group, slot, entry, init in _block_items(block):
        if init is None:
            continue
        begin, end = group.layout.shard_range(group.rank)
        part = slot.local_part(begin, end)
        if by_name and part is None:
            continue
        dtype, device = group.shard.dtype, group.shard.device
        if by_name:
            lo, hi = part
            values = init_range(
                prefix + entry.names[0],
                slot.shape,
                dtype,
                device,
                init,
                lo - slot.offset,
                hi - slot.offset,
            )
        else:
            full = draw_full(slot.shape, dtype, device, init, entry.tp)
            if part is None:
                continue  # drawn all the same: the generator stays in step with the others
            lo, hi = part
            values = full[lo - slot.offset : hi - slot.offset]
        with torch.no_grad():
            group.shard[lo - begin : hi - begin].copy_(values)


class HeldElsewhere:
    """The parameters of a layer another pipeline stage holds, for `init_parameters`:
    their values are drawn and dropped here, so this rank's generator stays in step
    with the stage that keeps them (in BMTrain every rank holds every layer and
    draws them all)."""

    def __init__(self, draws: list) -> None:
        self.draws = draws  # (shape, dtype, device, init_method, tp_meta), in order

    @classmethod
    def of_block(cls, block) -> "HeldElsewhere":
        draws = [
            (slot.shape, group.shard.dtype, group.shard.device, init, entry.tp)
            for group, slot, entry, init in _block_items(block)
            if init is not None
        ]
        return cls(draws)

    def draw(self) -> None:
        """Draws every value and keeps none. Local."""
        for shape, dtype, device, init, tp_meta in self.draws:
            draw_full(shape, dtype, device, init, tp_meta)
