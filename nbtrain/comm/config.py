"""`nbtrain.config`: the context under BMTrain's `bmt.config[...]` keys, read-only.

BMTrain keeps a process-wide mutable dict; here it is a view of the one context
that `init_distributed` made, so it can never disagree with it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from .context import get_context


class Config(Mapping):
    """Read-only mapping: rank, world_size, local_rank, local_size, zero_rank, tp_size, ...

    Every lookup reads the current context (a clear error before init_distributed).
    Parallelisms not enabled report BMTrain's neutral values (tp_size=1, pipe_size=1).
    """

    def _values(self) -> dict:
        ctx = get_context()
        return {
            "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
            "local_size": int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)),
            "seed": ctx.seed, "backend": ctx.backend, "device": ctx.device,
            "zero_rank": ctx.rank, "zero_size": ctx.world_size,
            "tp_size": 1, "tp_rank": 0,
            "tp_zero_size": ctx.world_size, "tp_zero_rank": ctx.rank,
            "pipe_size": 1, "pipe_rank": 0, "pipe_enabled": False,
            "num_micro_batches": None, "topology": ctx,
        }

    def __getitem__(self, key: str):
        values = self._values()
        try:
            return values[key]
        except KeyError:
            raise KeyError(f"nbtrain.config has no key {key!r}; keys: "
                           f"{', '.join(sorted(values))}") from None

    def __setitem__(self, key, value):
        raise TypeError(f"nbtrain.config is read-only (tried to set {key!r}); pass settings "
                        "to nbtrain.init_distributed(...) instead")

    def __iter__(self):
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())

    def __repr__(self) -> str:
        try:
            return f"nbtrain.config({self._values()})"
        except RuntimeError:
            return "nbtrain.config(<not initialised: call nbtrain.init_distributed()>)"


config = Config()
