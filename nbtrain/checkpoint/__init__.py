"""The checkpoint layer: one consolidated safetensors file, or sharded and reshardable N -> M
across data-parallel, tensor-parallel and pipeline layouts."""

from .asynchronous import wait
from .consolidated import load, save
from .reader import load_checkpoint
from .writer import save_checkpoint

__all__ = ["save", "load", "save_checkpoint", "load_checkpoint", "wait"]
