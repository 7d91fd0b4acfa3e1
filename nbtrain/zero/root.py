"""ModelRoot: the state one sharded model owns, kept per model (by weak reference).

    root = ModelRoot.of(model)   # made by wrap() or a DistributedModule's first forward

A root holds the model's gradient-reduction queue (every Block of the model joins
it, and takes its path in the model as its telemetry label), the coalesced gather
of its DistributedParameters outside blocks (`LooseParams`, from wrap), and the
data-parallel reduction of its plain parameters (`DataParallelGrads`, for a
DistributedModule). Two models in one process have two roots and share nothing.
"""

from __future__ import annotations

from torch import nn

from ..comm.topology import ALONE
from .block import Block
from .data_parallel import BUCKET_NUMEL, DataParallelGrads, check_replicas_equal
from .loose import LooseParams
from .parameter import DistributedParameter
from .placement import is_stage, placement_of, slice_kind
from .reducer import GradReducer
from .root_map import ROOTS


class ModelRoot:
    """Reduction queue, loose parameters and data-parallel parameters of one model."""

    def __init__(self):
        self.reducer = GradReducer()
        self.loose: LooseParams | None = None
        self.data_parallel: DataParallelGrads | None = None
        self.tp_data_parallel: DataParallelGrads | None = None  # tp slices, over dp

    @staticmethod
    def of(model: nn.Module) -> "ModelRoot":
        """The model's root, made on first request."""
        root = ROOTS.get(model)
        if root is None:
            root = ROOTS[model] = ModelRoot()
        return root

    @staticmethod
    def take(model: nn.Module) -> None:
        """Another owner takes `model`'s parameters: its root, if it has one, is
        dropped and releases its plain parameters. Local."""
        root = ROOTS.pop(model, None)
        if root is not None:
            root.release()

    def release(self) -> None:
        """Gives up the model's plain parameters (another owner takes them)."""
        for name in ("data_parallel", "tp_data_parallel"):
            owner = getattr(self, name, None)
            if owner is not None:
                owner.remove()
                setattr(self, name, None)

    def adopt_blocks(self, model: nn.Module) -> None:
        """Every Block in `model` reduces through this root and is named by its path."""
        for name, module in model.named_modules():
            if isinstance(module, Block):
                module.join(self.reducer, label=name or None)

    def adopt_replicated(self, model: nn.Module) -> None:
        """Gives the plain parameters of `model` (outside Blocks, not Distributed-
        Parameters) data-parallel gradients, after checking every rank holds the
        same values. Collective: every rank calls this on the same model."""
        self.release()
        named = [
            (n, p)
            for n, p in model.named_parameters()
            if not isinstance(p, DistributedParameter) and placement_of(p).owner != "flat"
        ]
        # Tensor-parallel slices differ between tp ranks: their copies are held by the
        # data-parallel group of their tp slot, and reduced there (none when alone).
        slices = [p for _, p in named if slice_kind(p) is not None and p.requires_grad]
        experts = [n for n, p in named if slice_kind(p) == "ep"]
        if experts and _topology().dp_size > 1:
            raise ValueError(
                f"{experts[0]!r}: expert parameters outside a Block have no "
                "gradient reduction here; shard the model with nbtrain.wrap "
                "(its experts shard and reduce over the ranks holding them)"
            )
        named = [(n, p) for n, p in named if slice_kind(p) is None]
        # The ranks holding copies: a pipeline stage's, or (outside a stage) the world's.
        stage = _stage_group() if is_stage(model) else None
        check_replicas_equal(named, group=stage)
        # The buckets look their groups up at each use (made again after a failure).
        kind = "zero" if is_stage(model) else None
        trainable = [p for _, p in named if p.requires_grad]
        bucket_numel = getattr(model, "dp_bucket_numel", BUCKET_NUMEL)
        self.data_parallel = None
        if trainable and stage is not ALONE and _holders(stage) > 1:
            self.data_parallel = DataParallelGrads(
                trainable, self.reducer, bucket_numel, group=kind
            )
        self.tp_data_parallel = None
        dp_group = _tp_slice_group() if slices else ALONE
        if dp_group is not ALONE:
            self.tp_data_parallel = DataParallelGrads(
                slices, self.reducer, bucket_numel, group="dp", replicated=False
            )


def _holders(group) -> int:
    """How many ranks hold copies (the world's for group None): at one, nothing to
    average, so no buckets, hooks or copies."""
    import torch.distributed as dist

    from ..comm.context import get_context

    return get_context().world_size if group is None else dist.get_world_size(group)


def _topology():
    from ..comm.context import get_context

    return get_context().topology


def _stage_group():
    """The ranks holding copies of this rank's replicated parameters: its stage."""
    return _topology().group("zero")


def _tp_slice_group():
    """The group holding copies of this rank's tensor-parallel slices (ALONE: none)."""
    return _topology().group("dp")
