"""`nbtrain.param_init`: BMTrain's module of the same name.

`init_parameters(model)` (nbtrain.zero.views: BMTrain's draw from the current torch
generator), `grouped_parameters(model)`, `iterate_parameters(module)` (a module's own
parameters, none for a Block, whose parameters are its flat shards) and
`init_distributed_parameter(params)` (the deferred initialisers of the
DistributedParameters among `params`, each rank keeping its shard). Local: nothing is
communicated, but every rank calls them with its generator in the same state.
"""

from __future__ import annotations

from . import grouped_parameters
from .zero import Block, init_distributed_parameter, init_parameters


def iterate_parameters(module):
    """The module's own parameters (not its children's); nothing for a Block."""
    if isinstance(module, Block):
        return
    yield from module._parameters.values()


__all__ = [
    "grouped_parameters",
    "init_distributed_parameter",
    "init_parameters",
    "iterate_parameters",
]
