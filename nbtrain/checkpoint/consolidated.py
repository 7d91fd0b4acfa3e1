"""The consolidated checkpoint: one safetensors file with the plain model's names.

`save(model, path)` writes the plain model's state dict (full tensors, plain names)
from rank 0: a file `safetensors.torch.load_file` reads and a plain torch model
loads. `load(model, path)` reads it into a sharded model of any world size.

With pipeline stages (`nbtrain.pipeline.stage_of`, whose names are the plain
`nn.Sequential(*layers)`'s) rank 0 collects every stage's tensors, and `load` gives
each stage the tensors of its own layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ..comm.context import get_context
from ..zero.block import Block
from .layout import agreed, write_tensors


def save(model: torch.nn.Module, path: str) -> None:
    """Writes the full model as one `.safetensors` file with the plain model's names.

    Collective: every rank calls this (the shards are gathered); rank 0 writes.
    """
    ctx = get_context()
    # Clones: safetensors refuses tensors that share memory (tied weights).
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    if ctx.topology.pipe_size > 1:  # every stage's first rank sends its stage's tensors
        parts = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(state if ctx.topology.zero_rank == 0 else None, parts, dst=0)
        if ctx.rank == 0:
            state = {k: v for part in parts if part is not None for k, v in part.items()}
    agreed("nbtrain.save", lambda: write_tensors(path, state), run_here=ctx.rank == 0)


def load(model: torch.nn.Module, path: str, strict: bool = True):
    """Loads a file written by `save` (or any safetensors state dict of the plain model).

    Returns torch's (missing_keys, unexpected_keys). A shape mismatch raises a
    ValueError naming the key and both shapes. Every rank reads the file and keeps
    its own slices (with pipeline stages, of its own stage's tensors: the other
    stages' keys are not unexpected). Collective-free, but every rank must call it.
    """
    # strict=False, then our own check: a Block's submodules report the Block's keys
    # as unexpected after the Block has consumed them (torch loads children last).
    result = model.load_state_dict(load_file(path), strict=False)
    owned = {prefix + ("." if prefix else "") + name
             for prefix, m in model.named_modules() if isinstance(m, Block)
             for g in m.groups for e in g.entries for name in e.names}
    result.unexpected_keys[:] = [k for k in result.unexpected_keys if k not in owned]
    if get_context().topology.pipe_size > 1:  # the other stages' layers
        result.unexpected_keys.clear()
    if strict and (result.missing_keys or result.unexpected_keys):
        raise RuntimeError(f"nbtrain.load({path!r}): missing keys {result.missing_keys}, "
                           f"unexpected keys {result.unexpected_keys}")
    return result
