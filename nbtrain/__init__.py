"""nbtrain: train models that do not fit on one device, from Jupyter or torchrun.

BMTrain-compatible names: change `import bmtrain as bmt` to `import nbtrain as bmt`.
Importing nbtrain imports neither triton, ipywidgets nor ipyparallel; the notebook
layer (`Cluster`, the magics, the dashboard) loads on first use.
"""
from . import telemetry
from .comm import (get_context, init_distributed, print_rank, rank, sum_loss, synchronize,
                   world_size)
from .comm.config import config
from .zero import (Block, DistributedModule, DistributedParameter, ParameterInitializer,
                   TransformerBlockList, init_parameters, wrap)

__version__ = "0.1.0"

__all__ = [
    "init_distributed", "get_context", "rank", "world_size", "synchronize", "print_rank",
    "sum_loss", "config", "DistributedParameter", "DistributedModule", "ParameterInitializer",
    "init_parameters", "Block", "TransformerBlockList", "wrap", "telemetry", "progress",
    "optim", "lr_scheduler", "loss", "save", "load", "save_checkpoint", "load_checkpoint",
    "inspect",
]  # the notebook layer's names (Cluster, the errors) load lazily and stay out of `import *`

_LAZY = {
    "save": ("nbtrain.checkpoint", "save"),
    "load": ("nbtrain.checkpoint", "load"),
    "save_checkpoint": ("nbtrain.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("nbtrain.checkpoint", "load_checkpoint"),
    "optim": ("nbtrain.optim", None),
    "lr_scheduler": ("nbtrain.optim.lr_scheduler", None),
    "loss": ("nbtrain.nn.loss", None),
    "nn": ("nbtrain.nn", None),
    "inspect": ("nbtrain.inspect", None),
    "progress": ("nbtrain.telemetry.progress", "progress"),
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
