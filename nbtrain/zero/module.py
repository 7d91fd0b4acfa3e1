"""DistributedModule: BMTrain's base class for sharded models.

    class GPT(nbtrain.DistributedModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, H)                    # plain: data parallel
            self.layers = nbtrain.TransformerBlockList([...])  # sharded Blocks
            self.head = nbtrain.DistributedParameter(...)      # sharded one by one

Every parameter has exactly one owner that reduces its gradient: a Block
(reduce-scatter of its flat buffer), a DistributedParameter (reduce-scatter of its
shard), or, for a plain parameter, this module's data-parallel all-reduce. On the
end of the outermost DistributedModule's `__init__` the model takes its
`ModelRoot`: its Blocks join the model's reduction queue, and its plain parameters
are checked equal on every rank and get DDP-style averaged gradients
(data_parallel.py). Construction is therefore collective: every rank builds the
model. (Taking the root at the end of construction, not at the first forward,
also covers models trained through a method such as `model.loss(x, y)` that never
goes through `model(...)` and its hooks.)
"""

from __future__ import annotations

import functools

from torch import nn

from .data_parallel import BUCKET_NUMEL
from .parameter import DistributedParameter, attach_state_dict_hooks
from .root import ModelRoot

# id(module) -> how many of its __init__s are running (a subclass's calls its parent's)
_INIT_DEPTH: dict[int, int] = {}


class DistributedModule(nn.Module):
    """nn.Module whose DistributedParameters read as full tensors inside forward.

    `self.weight` returns the gathered tensor (a collective), as in BMTrain. Plain
    parameters (outside Blocks) are replicated and their gradients averaged over
    ranks, as DDP does. `state_dict()` returns full tensors; `load_state_dict()`
    takes full tensors.

    Attributes:
        dp_bucket_numel: most elements per data-parallel all-reduce (a class
            attribute; smaller buckets start reducing earlier in backward).
    """

    dp_bucket_numel = BUCKET_NUMEL

    def __init__(self):
        super().__init__()
        attach_state_dict_hooks(self)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _taking_root_after(init)

    def __getattr__(self, name):
        params = self.__dict__.get("_parameters")
        if params is not None:
            param = params.get(name)
            if isinstance(param, DistributedParameter):
                return param.gather()
        return super().__getattr__(name)


def _taking_root_after(init):
    """Wraps a subclass's __init__: once the outermost __init__ of this object
    returns (a subclass's __init__ calls its parent's), the model takes its root."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        key = id(self)  # alive, so its id is its own, until the outermost __init__ ends
        depth = _INIT_DEPTH.get(key, 0)
        _INIT_DEPTH[key] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            if depth:
                _INIT_DEPTH[key] = depth
            else:
                del _INIT_DEPTH[key]
        if depth == 0:
            _take_root(self)

    return __init__


def _take_root(module: DistributedModule) -> None:
    """The model adopts its Blocks and plain parameters. Collective."""
    for inner in module.modules():
        if inner is not module and isinstance(inner, DistributedModule):
            ModelRoot.take(inner)  # this root owns it now
    root = ModelRoot.of(module)
    root.adopt_blocks(module)
    root.adopt_replicated(module)
