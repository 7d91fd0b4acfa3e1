"""ModelRoot: the state one sharded model owns, kept on the model, not in globals.

    root = ModelRoot.of(model)   # made by wrap() or a DistributedModule's first forward

A root holds the model's gradient-reduction queue (every Block of the model joins
it, and takes its path in the model as its telemetry label), the coalesced gather
of its DistributedParameters outside blocks (`LooseParams`, from wrap), and the
data-parallel reduction of its plain parameters (`DataParallelGrads`, for a
DistributedModule). Two models in one process have two roots and share nothing.
"""
from __future__ import annotations

from torch import nn

from .block import Block
from .data_parallel import BUCKET_NUMEL, DataParallelGrads, check_replicas_equal
from .loose import LooseParams
from .parameter import DistributedParameter
from .reducer import GradReducer


class ModelRoot:
    """Reduction queue, loose parameters and data-parallel parameters of one model."""

    def __init__(self):
        self.reducer = GradReducer()
        self.loose: LooseParams | None = None
        self.data_parallel: DataParallelGrads | None = None

    @staticmethod
    def of(model: nn.Module) -> "ModelRoot":
        """The model's root, made on first request."""
        root = model.__dict__.get("_nbtrain_root")
        if root is None:
            root = ModelRoot()
            model.__dict__["_nbtrain_root"] = root
        return root

    def release(self) -> None:
        """Gives up the model's plain parameters (another owner takes them)."""
        if self.data_parallel is not None:
            self.data_parallel.remove()
            self.data_parallel = None

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
        named = [(n, p) for n, p in model.named_parameters()
                 if not isinstance(p, DistributedParameter)
                 and not getattr(p, "_nbtrain_flat", False)]
        split = [n for n, p in named if getattr(p, "tp_split_dim", None) is not None]
        if split:
            _check_tp_slices_need_no_reduction(split)
            named = [(n, p) for n, p in named if getattr(p, "tp_split_dim", None) is None]
        check_replicas_equal(named)
        trainable = [p for _, p in named if p.requires_grad]
        bucket_numel = getattr(model, "dp_bucket_numel", BUCKET_NUMEL)
        self.data_parallel = (DataParallelGrads(trainable, self.reducer, bucket_numel)
                              if trainable else None)


def _check_tp_slices_need_no_reduction(names: list[str]) -> None:
    """A tensor-parallel slice has its whole gradient on its rank when nobody else
    holds it (data-parallel size 1). Reducing it over replicas is not done yet."""
    from ..comm.context import get_context

    dp = get_context().topology.dp_size
    if dp > 1:
        raise NotImplementedError(
            f"{names[0]} is a tensor-parallel slice held by {dp} data-parallel replicas; "
            "reducing tensor-parallel gradients over replicas is not available yet: use a "
            "world size equal to tp_size")
