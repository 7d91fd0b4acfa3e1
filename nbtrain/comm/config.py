"""`nbtrain.config`: the context under BMTrain's `bmt.config[...]` keys, read-only.

BMTrain keeps a process-wide mutable dict; here it is a view of the one context
that `init_distributed` made, so it can never disagree with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .context import get_context, is_initialized


class Config(Mapping):
    """Read-only mapping: rank, world_size, local_rank, local_size, zero_rank, tp_size, ...

    Every lookup reads the current context. Before init_distributed it holds BMTrain's
    answers for one process: rank 0, local_rank 0, world_size 1, initialized False.
    The topology keys follow BMTrain: tp_zero_* is the data-parallel group of this
    tensor-parallel slot, zero_* the ranks of this pipeline stage, and `topology`
    has BMTrain's attributes (stage_id, pipe_idx, tp_id, pp_zero_id, ...; see
    nbtrain.comm.topology_names).
    """

    def _values(self) -> dict:
        if not is_initialized():  # BMTrain's answers before init_distributed: one rank
            return {"rank": 0, "local_rank": 0, "world_size": 1, "initialized": False}
        ctx = get_context()
        topo = ctx.topology
        return {
            "initialized": True,
            # BMTrain's communicators are its NCCL ones; here the torch process groups,
            # which nbtrain.distributed's collectives take (None: every rank).
            "comm": None,
            "tp_comm": topo.group("tp"),
            "zero_comm": topo.group("zero"),
            "tp_zero_comm": topo.group("dp"),
            "pipe_comm": topo.group("pipe"),
            "pp_zero_comm": topo.group("zero"),  # BMTrain's: the ranks of one stage
            "pp_tp_zero_comm": topo.group("dp"),
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "local_rank": ctx.local_rank,
            "local_size": int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)),
            "seed": ctx.seed,
            "backend": ctx.backend,
            "device": ctx.device,
            "zero_rank": topo.zero_rank,
            "zero_size": topo.tp_size * topo.dp_size,
            "tp_size": topo.tp_size,
            "tp_rank": topo.tp_rank,
            "tp_zero_size": topo.dp_size,
            "tp_zero_rank": topo.dp_rank,
            "pipe_size": topo.pipe_size,
            "pipe_rank": topo.pipe_rank,
            "pipe_enabled": topo.pipe_size > 1,
            "num_micro_batches": ctx.num_micro_batches,
            "micros": ctx.num_micro_batches or topo.pipe_size,  # BMTrain's name, resolved
            "topology": topo,
            # BMTrain gathers parameters on a side stream ("load_stream") and computes on
            # "calc_stream". nbtrain issues its collectives on the current stream, so both
            # keys are that stream (torch.cuda's on CUDA, torch.cpu's dummy on the CPU):
            # a BMTrain script's `current_stream().wait_stream(config["load_stream"])`
            # orders nothing more than it already is.
            "calc_stream": _current_stream(ctx.device),
            "load_stream": _current_stream(ctx.device),
        }

    def __getitem__(self, key: str):
        values = self._values()
        try:
            return values[key]
        except KeyError:
            raise KeyError(
                f"nbtrain.config has no key {key!r}; keys: {', '.join(sorted(values))}"
            ) from None

    def __setitem__(self, key, value):
        raise TypeError(
            f"nbtrain.config is read-only (tried to set {key!r}); pass settings "
            "to nbtrain.init_distributed(...) instead"
        )

    def __iter__(self):
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())

    def __repr__(self) -> str:
        try:
            return f"nbtrain.config({self._values()})"
        except RuntimeError:
            return "nbtrain.config(<not initialised: call nbtrain.init_distributed()>)"


def _current_stream(device):
    return torch.get_device_module(device).current_stream()


config = Config()
