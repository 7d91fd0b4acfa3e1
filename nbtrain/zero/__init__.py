"""ZeRO sharding: partition maths, DistributedParameter, Block, TransformerBlockList, wrap.

The public API is this package's `__all__`, imported from `nbtrain.zero`, and two
modules of pure maths: `nbtrain.zero.partition` (the one partition rule: which
elements each rank holds) and `nbtrain.tensor_parallel.slices` (cutting and assembling
tensor-parallel slices). Code outside this package reads a model's shards through
`shards(model)` and `flat_buffers(model)`, never through a Block's flat groups or a
parameter's private fields (tests/unit/test_zero_boundary.py holds it to that).
"""

from .accumulate import micro_batches
from .block import Block, ZeroLevel
from .blocklist import TransformerBlockList
from .freeze import frozen_spans, partly_frozen, segment_spans
from .init import HeldElsewhere
from .meta import assign_inits, empty_parameters, normal_inits, torch_default_inits
from .module import DistributedModule
from .parameter import DistributedParameter, ParameterInitializer
from .placement import (
    Placement,
    full_numel,
    is_slice,
    is_stage,
    place,
    placement_of,
    slice_kind,
)
from .root import ModelRoot
from .shards import (
    FlatBuffer,
    FlatMember,
    Shard,
    ShardKind,
    flat_buffers,
    has_grad_owner,
    is_sharded,
    shards,
)
from .views import (
    full_items_by_parameter,
    full_named_grads,
    init_distributed_parameter,
    init_parameters,
    state_keys,
)
from .wrap import wrap

__all__ = [
    "Block",
    "ZeroLevel",
    "TransformerBlockList",
    "DistributedModule",
    "DistributedParameter",
    "ParameterInitializer",
    "init_parameters",
    "HeldElsewhere",
    "init_distributed_parameter",
    "wrap",
    "full_named_grads",
    "ModelRoot",
    "empty_parameters",
    "assign_inits",
    "normal_inits",
    "torch_default_inits",
    # what this rank holds, for readers outside nbtrain.zero (shards.py)
    "shards",
    "Shard",
    "ShardKind",
    "flat_buffers",
    "FlatBuffer",
    "FlatMember",
    "is_sharded",
    "has_grad_owner",
    "full_items_by_parameter",
    "state_keys",
    # tensor-parallel slice metadata, and pipeline micro-batches
    "is_slice",
    "is_stage",
    "Placement",
    "place",
    "placement_of",
    "full_numel",
    "slice_kind",
    "micro_batches",
    # which elements of a flat shard belong to which parameter, and which are frozen
    # now (per-parameter optimizer state: nbtrain.optim.segment_steps)
    "segment_spans",
    "frozen_spans",
    "partly_frozen",
]

PUBLIC_MODULES = ("partition",)  # importable by path from outside the package
