"""nbtrain: train models that do not fit on one device, from Jupyter or torchrun.

BMTrain-compatible names: change `import bmtrain as bmt` to `import nbtrain as bmt`
(docs/bmtrain.md lists every BMTrain name and where nbtrain behaves differently).
Importing nbtrain imports neither triton, ipywidgets nor ipyparallel; the notebook
layer (`Cluster`, the magics, the dashboard) loads on first use.
"""

from . import telemetry  # adds its recorder to init_distributed's hooks (comm.context.INIT_HOOKS)
from .comm import (
    get_context,
    init_distributed,  # one function: it starts telemetry's recorder (comm.context.INIT_HOOKS)
    print_rank,
    rank,
    synchronize,
    world_size,
)
from .comm.config import config
from .zero import (
    Block,
    DistributedModule,
    DistributedParameter,
    ParameterInitializer,
    TransformerBlockList,
    assign_inits,
    empty_parameters,
    init_parameters,
    wrap,
)

CheckpointBlock = Block  # BMTrain's older name for Block

# BMTrain's modules whose names are also functions here: loaded now, so that a later
# `import nbtrain.synchronize` finds the module and leaves `nbtrain.synchronize` the
# function (BMTrain's layout: the module bmtrain.synchronize, the function bmt.synchronize).
from .synchronize import synchronize  # noqa: E402, F811 (after the module names above, as said)

__version__ = "0.1.0"

__all__ = [
    "BMTrainModelWrapper",
    "Block",
    "CheckpointBlock",
    "DistributedModule",
    "DistributedParameter",
    "ParameterInitializer",
    "PipelineTransformerBlockList",
    "TransformerBlockList",
    "assign_inits",
    "config",
    "debug",
    "declare_tp_gradients",
    "distributed",
    "empty_parameters",
    "from_pretrained",
    "gather_result",
    "get_context",
    "graceful_stop",
    "grouped_parameters",
    "init_distributed",
    "init_parameters",
    "inspect",
    "load",
    "load_checkpoint",
    "loss",
    "lr_scheduler",
    "optim",
    "parallelize",
    "pipeline",
    "print_block",
    "print_dict",
    "print_rank",
    "progress",
    "rank",
    "save",
    "save_checkpoint",
    "save_pretrained",
    "see_memory",
    "stop_requested",
    "sum_loss",
    "synchronize",
    "telemetry",
    "wait_loader",
    "world_size",
    "wrap",
]  # the notebook layer's names (Cluster, the errors) load lazily and stay out of `import *`

_LAZY = {
    "sum_loss": ("nbtrain.utils", "sum_loss"),
    "save": ("nbtrain.checkpoint", "save"),
    "from_pretrained": ("nbtrain.models.hf_auto", "from_pretrained"),
    "save_pretrained": ("nbtrain.models.hf_auto", "save_pretrained"),
    "load": ("nbtrain.checkpoint", "load"),
    "save_checkpoint": ("nbtrain.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("nbtrain.checkpoint", "load_checkpoint"),
    "optim": ("nbtrain.optim", None),
    "lr_scheduler": ("nbtrain.lr_scheduler", None),
    "loss": ("nbtrain.loss", None),
    "nn": ("nbtrain.nn", None),
    "nccl": ("nbtrain.nccl", None),
    "store": ("nbtrain.store", None),
    "moe": ("nbtrain.moe", None),
    "context_parallel": ("nbtrain.context_parallel", None),
    "inspect": ("nbtrain.inspect", None),
    "progress": ("nbtrain.telemetry.progress", "progress"),
    "graceful_stop": ("nbtrain.comm.recovery", "graceful_stop"),
    "parallelize": ("nbtrain.tensor_parallel.parallelize", "parallelize"),
    "declare_tp_gradients": ("nbtrain.tensor_parallel.layers", "declare_tp_gradients"),
    "tensor_parallel": ("nbtrain.tensor_parallel", None),
    "pipeline": ("nbtrain.pipeline", None),
    "PipelineTransformerBlockList": ("nbtrain.pipeline", "PipelineTransformerBlockList"),
    "stop_requested": ("nbtrain.comm.recovery", "stop_requested"),
    "plan": ("nbtrain.planner", "plan"),
    "plan_layouts": ("nbtrain.planner", "plan_layouts"),
    # BMTrain's modules and the rest of its top-level names.
    "distributed": ("nbtrain.distributed", None),
    "debug": ("nbtrain.debug", None),
    "utils": ("nbtrain.utils", None),
    "global_var": ("nbtrain.global_var", None),
    "print_block": ("nbtrain.utils", "print_block"),
    "print_dict": ("nbtrain.utils", "print_dict"),
    "see_memory": ("nbtrain.utils", "see_memory"),
    "load_nccl_pypi": ("nbtrain.utils", "load_nccl_pypi"),
    "wait_loader": ("nbtrain.utils", "wait_loader"),
    "gather_result": ("nbtrain.utils", "gather_result"),
    "grouped_parameters": ("nbtrain.zero.bmtrain_wrapper", "grouped_parameters"),
    "BMTrainModelWrapper": ("nbtrain.zero.bmtrain_wrapper", "BMTrainModelWrapper"),
    # The notebook layer imports ipyparallel: loaded when first used.
    "Cluster": ("nbtrain.notebook", "Cluster"),
    "DistributedError": ("nbtrain.notebook.errors", "DistributedError"),
    "RankError": ("nbtrain.notebook.errors", "RankError"),
    "RankDiedError": ("nbtrain.notebook.errors", "RankDiedError"),
    "CellTimeoutError": ("nbtrain.notebook.errors", "CellTimeoutError"),
}


def __getattr__(name):
    # Lazy so that `import nbtrain` stays light and engines start fast.
    if name not in _LAZY:
        raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


def load_ipython_extension(ipython):
    """`%load_ext nbtrain`: registers %nbtrain and %%distributed."""
    from .notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
