"""`nbtrain.debug`: a process-wide scratch dict for debugging (BMTrain's `bmt.debug`).

    nbtrain.debug.set("h", hidden)       # a tensor is kept detached, on the CPU
    nbtrain.debug.append("losses", loss.item())
    nbtrain.debug.get("h"); nbtrain.debug.clear()

Each process (rank) has its own; nothing is communicated. nbtrain.inspect's
`inspect_tensor` does not use it.

The debugging instruments live beside it, loaded on first use:
`locate_divergence` (locate.py: where a parallel layout first leaves its plain twin)
and `detect_nonfinite` (nonfinite.py: the first module, rank, step and direction
where a NaN or Inf appears).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "DEBUG_VARS",
    "append",
    "clear",
    "detect_nonfinite",
    "extend",
    "get",
    "locate_divergence",
    "set",
]

_LAZY = {
    "locate_divergence": "locate",
    "locate_steps": "locate",
    "DivergenceReport": "locate",
    "Finding": "locate",
    "detect_nonfinite": "nonfinite",
    "NonFiniteDetector": "nonfinite",
    "NonFiniteOrigin": "nonfinite",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbtrain.debug' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


DEBUG_VARS: dict[str, Any] = {}


def clear(key: str | None = None) -> None:
    """Forgets `key`, or everything with no key (a missing key is no error)."""
    if key is None:
        DEBUG_VARS.clear()
    else:
        DEBUG_VARS.pop(key, None)


def set(key: str, value: Any) -> None:  # noqa: A001 (BMTrain's bmt.debug.set)
    """Keeps `value` under `key`; a tensor is kept detached and copied to the CPU."""
    if torch.is_tensor(value):
        value = value.detach().cpu()
    DEBUG_VARS[key] = value


def get(key: str, default: Any = None) -> Any:
    """The value kept under `key`, or `default`."""
    return DEBUG_VARS.get(key, default)


def append(key: str, value: Any) -> None:
    """Appends `value` to the list under `key` (made empty first if missing). Tensors
    are kept as they are (not detached), as in BMTrain."""
    DEBUG_VARS.setdefault(key, []).append(value)


def extend(key: str, values) -> None:
    """Extends the list under `key` (made empty first if missing) with `values`."""
    DEBUG_VARS.setdefault(key, []).extend(values)
