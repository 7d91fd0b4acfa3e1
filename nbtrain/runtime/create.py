"""`create_runtime(cfg)`: the backend `cfg.backend` names, checked before anything is built."""

from __future__ import annotations

import os

from ..comm import context as _context
from .base import Runtime
from .config import RuntimeConfig


def _world_size() -> int:
    if _context.is_initialized():
        return _context.get_context().world_size
    return int(os.environ.get("WORLD_SIZE", "1"))


def create_runtime(cfg: RuntimeConfig) -> Runtime:
    """The runtime for `cfg`: a ReferenceRuntime or an NBTrainRuntime.

    Raises:
        TypeError: `cfg` is not a RuntimeConfig.
        ValueError: the "nbtrain" backend's tp x pp does not divide the world size.

    Local (nothing is built until `build_model`).
    """
    if not isinstance(cfg, RuntimeConfig):
        raise TypeError(f"create_runtime takes a RuntimeConfig, got {type(cfg).__name__}")
    if cfg.backend == "reference":
        from .reference import ReferenceRuntime

        return ReferenceRuntime(cfg)
    cfg.backend_cfg.parallel.check_world(_world_size())
    from .nbtrain_backend import NBTrainRuntime

    return NBTrainRuntime(cfg)
