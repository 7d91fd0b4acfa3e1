"""`nbtrain.store`: BMTrain's module of the same name (`bmtrain.store`).

- `save(model, path)` and `load(model, path, strict=True)` are nbtrain.save and
  nbtrain.load (nbtrain/checkpoint/consolidated.py): BMTrain's torch.save format for any
  path but a `.safetensors` one, and either format read back.
- `_save_to_rank0(model, destination=None, prefix="")` builds the model's full state
  dict (the plain model's keys, full tensors, on the CPU) on rank 0, gathered unit by
  unit: a Block's parameters one at a time, every other module's own tensors, a
  pipeline's layers from the stages that hold them. Other ranks get `destination` as
  they passed it (an empty dict when they passed none). BMTrain-based model libraries
  define `state_dict()` with it:

      def state_dict(self, destination=None, prefix="", keep_vars=False):
          return bmt.store._save_to_rank0(self, destination, prefix)

  It never calls `model.state_dict()` itself, so that override does not recurse.
  Collective: every rank calls it, in step.
- `allgather_objects(obj)`, `broadcast_object(obj, comm, src=0)`: a picklable object
  from every rank, or from rank `src` of `comm` (None: every rank), through
  nbtrain.comm.collectives. `async_save_to_file(state_dict, path)` is `torch.save`.

Deliberately absent: BMTrain's `DistributedStateDictWrapper` and
`DistributedTensorWrapper`, with which its `load` broadcasts rank 0's file tensor by
tensor; nbtrain.load has every rank read its own rows of the file instead.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .checkpoint import load, save
from .checkpoint.stream import units
from .comm import collectives as C
from .comm.context import get_context
from .distributed.ops import DTYPES
from .pipeline import PipelineTransformerBlockList
from .zero import Block

DTYPE_LIST = list(DTYPES)  # BMTrain's order of dtype codes, then nbtrain's additions

__all__ = [
    "DTYPE_LIST",
    "allgather_objects",
    "async_save_to_file",
    "broadcast_object",
    "load",
    "save",
]


def _save_to_rank0(model: nn.Module, destination=None, prefix: str = ""):
    """The full state dict of `model` on rank 0, under `prefix` (see the module's
    notes); `destination` as given on other ranks. Collective."""
    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()
    keep = get_context().rank == 0
    for key, tensor in _full_items(model, prefix, destination):
        if keep:
            destination[key] = tensor.detach().cpu()
    return destination


def _full_items(module: nn.Module, prefix: str, destination):
    """(key, full tensor) of `module`'s state dict, one unit at a time; every rank
    iterates in step."""
    if hasattr(destination, "_metadata"):
        destination._metadata[prefix[:-1]] = {"version": module._version}
    if isinstance(module, PipelineTransformerBlockList):
        # its state_dict brings every stage's layers, on every rank
        yield from module.state_dict(prefix=prefix).items()
        return
    if isinstance(module, Block):
        yield from ((prefix + k, v) for k, v in units(module))
        return
    own = OrderedDict()
    module._save_to_state_dict(own, prefix, False)
    for hook in module._state_dict_hooks.values():  # tp layers gather their slices here
        result = hook(module, own, prefix, {})
        if result is not None:
            own = result
    yield from own.items()
    for name, child in module._modules.items():
        if child is not None:
            yield from _full_items(child, prefix + name + ".", destination)


def async_save_to_file(state_dict, file_path: str) -> None:
    """`torch.save(state_dict, file_path)` (BMTrain runs it on a thread of its own;
    nbtrain.checkpoint has an asynchronous saver). Local."""
    torch.save(state_dict, file_path)


def allgather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order. Collective."""
    if get_context().world_size == 1:
        return [obj]
    return C.all_gather_object(obj)


def broadcast_object(obj, comm=None, src: int = 0):
    """Rank `src` of `comm`'s picklable `obj`, on every rank of `comm` (None: every
    rank; `src` counts within it). Collective over `comm`."""
    from .comm.topology import ALONE

    if comm is ALONE:
        return obj
    return C.all_gather_object(obj, group=comm)[src]
