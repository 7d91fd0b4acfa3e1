"""Deferred initialisation: each rank initialises only its own shard.

A parameter's initial value depends only on the seed given to `init_distributed`
and the parameter's name, never on the world size. For the element-wise
initialisers of `torch.nn.init` (normal, uniform, constants, truncated normal,
and Kaiming/Xavier, whose scale comes from the full shape) the flattened
parameter is cut into fixed chunks of CHUNK_NUMEL elements, each drawn from its
own generator seeded by (seed, name, chunk index): a rank draws only the chunks
that overlap its shard, and any world size reassembles the same tensor. Any
other initialiser runs on one full-shape tensor at a time, of which the rank
keeps its slice.
"""

from __future__ import annotations

import inspect
import math
import zlib

import torch
from torch import nn

from ..comm.context import get_context

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
