"""`save_checkpoint`: model, optimizer state, schedules and loss scale, as shards.

The layout is described in `layout.py`; `reader.py` reads it back at any world size
and pipeline layout. Each rank describes the entries it holds; rank 0 joins the
descriptions (with pipeline stages they differ) into meta.json.
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from ..comm import collectives as C
from ..comm.context import get_context
from ..comm.renamed import model_first
from .layout import FORMAT_VERSION, META, agreed, local_entries, write_json, write_tensors


def _scalar(value):
    if torch.is_tensor(value):
        return {"value": value.item(), "tensor_dtype": str(value.dtype).replace("torch.", "")}
    return {"value": value}


def _optim_part(opt, entries_by_id: dict, tensors: dict, index: int) -> dict:
    groups, scalars, tensor_keys = [], {}, {}
    for group in opt.param_groups:
        names = []
        for p in group["params"]:
            entry = entries_by_id.get(id(p))
            if entry is None:
                raise ValueError(
                    "save_checkpoint: the optimizer holds a parameter that is not in the model"
                )
            names.append(entry.name)
            state = opt.state.get(p, {})
            scalars[entry.name] = {}
            tensor_keys[entry.name] = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.numel() == p.numel() and value.dim() > 0:
                    tensors[f"optim{index}/{entry.name}/{key}"] = entry.local(value)
                    tensor_keys[entry.name][key] = str(value.dtype).replace("torch.", "")
                else:
                    scalars[entry.name][key] = _scalar(value)
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": names})
    return {"param_groups": groups, "scalars": scalars, "tensor_keys": tensor_keys}


# -- sharded save -----------------------------------------------------------------------


def save_checkpoint(
    model: torch.nn.Module, path: str, optim_manager=None, step=None, non_blocking: bool = False
) -> None:
    """Writes model, optimizer state, schedules, loss scale and `step` as shards.

    Args:
        model: the sharded model.
        path: a directory (created if needed); a previous checkpoint there is
            replaced only once the new one is complete.
        optim_manager: an OptimManager whose optimizers (and schedules) to save.
        step: any JSON value, returned by `load_checkpoint` as meta["step"].
        non_blocking: return once this rank's shards are copied to host memory; the
            files are written in the background (asynchronous.py): the next save,
            `nbtrain.checkpoint.wait()` or the end of the process waits for them, and
            a failure is raised there. Still atomic: until every rank's file is
            written, meta.json names the previous checkpoint.

    The order is `nbtrain.save`'s and BMTrain's `bmt.save(model, path)`; the old
    `save_checkpoint(path, model)` still works, with a FutureWarning.

    With pipeline stages every rank passes its own stage (`nbtrain.pipeline.stage_of`)
    and the manager of its optimizers; the checkpoint holds the plain model's names and
    loads at any other pipeline layout.

    Collective: every rank calls this; each writes its own file, rank 0 the metadata
    (every rank's description of its entries is gathered to it).
    """
    from . import asynchronous

    model, path = model_first("save_checkpoint", model, path)  # the old order warns
    asynchronous.wait()  # an earlier background save finishes (or fails) first
    ctx = get_context()
    token = torch.tensor([time.time_ns() % (2**62)], dtype=torch.int64, device=ctx.device)
    C.broadcast(token, src=0, label="checkpoint.token")  # one version name on every rank
    version = f"v-{int(token.item()):x}"
    file = os.path.join(path, version, f"rank{ctx.rank:05d}.safetensors")

    def snapshot() -> tuple[dict, dict]:
        """This rank's tensors (copies in host memory) and its description of them."""
        entries = local_entries(model)
        tensors = {f"model/{e.name}": e.local(e.param) for e in entries}
        by_id = {id(e.param): e for e in entries}
        optims = (
            []
            if optim_manager is None
            else [
                _optim_part(opt, by_id, tensors, i)
                for i, opt in enumerate(optim_manager.optimizers)
            ]
        )
        buffers = {}
        if ctx.topology.zero_rank == 0:  # a stage's buffers: its first rank stores them
            buffers = dict(model.named_buffers())
            tensors.update(
                {f"buffer/{n}": b.detach().cpu().contiguous().clone() for n, b in buffers.items()}
            )
        return tensors, {
            "params": {e.name: e.saved_info() for e in entries},
            "optimizers": optims,
            "buffers": sorted(buffers),
        }

    def write_meta(parts, manager_state) -> None:
        topo = ctx.topology
        meta = {
            "format": FORMAT_VERSION,
            "world_size": ctx.world_size,
            "step": step,
            "tp_size": topo.tp_size,
            "dp_size": topo.dp_size,
            "pipe_size": topo.pipe_size,
            "version": version,
            **merge_parts(parts),
            "manager": manager_state,
        }
        write_json(os.path.join(path, META), meta)
        _remove_other_versions(path, version)

    manager_state = None if optim_manager is None else optim_manager.scalar_state()
    if non_blocking:  # the same snapshot and description; the writing in the background
        tensors, part = agreed("save_checkpoint (snapshot)", snapshot)
        parts = C.all_gather_object(part)
        commit = (lambda: write_meta(parts, manager_state)) if ctx.rank == 0 else None
        asynchronous.start(path, version, file, tensors, ctx.rank, ctx.world_size, commit)
        return

    def write_shard() -> dict:
        try:
            os.makedirs(os.path.dirname(file), exist_ok=True)
        except OSError as err:
            raise OSError(
                f"save_checkpoint({path!r}): cannot create the checkpoint folder "
                f"there ({err.strerror}); choose a writable path"
            ) from err
        tensors, part = snapshot()
        write_tensors(file, tensors)
        return part

    # Every shard is on disk before the metadata names them.
    part = agreed("save_checkpoint (shards)", write_shard)
    parts = C.all_gather_object(part)  # every rank's entries: stages hold different ones
    agreed(
        "save_checkpoint (metadata)",
        lambda: write_meta(parts, manager_state),
        run_here=ctx.rank == 0,
    )


def merge_parts(parts: list[dict]) -> dict:
    """meta.json's "params", "buffers" and "optimizers" from every rank's description
    (in rank order): each parameter once, with the ranks that store its parts."""
    params: dict = {}
    for rank, part in enumerate(parts):
        for name, info in part["params"].items():
            info = dict(info)
            shard, slot = info.pop("shard"), info.pop("tp_slot")
            merged = params.setdefault(name, {**info, "ranks": {}})
            if shard is not None:
                merged["ranks"].setdefault(slot, {}).setdefault(shard[0], rank)
    for name, info in params.items():
        # "ranks": per tp slot, the ranks storing its parts in partition order
        slots = info["ranks"]
        info["ranks"] = [
            [slots.get(t, {})[i] for i in sorted(slots.get(t, {}))]
            for t in range(max(slots, default=0) + 1)
        ]
        if any(
            sorted(slots.get(t, {})) != list(range(len(r))) for t, r in enumerate(info["ranks"])
        ) or not any(info["ranks"]):
            raise RuntimeError(
                f"save_checkpoint: the parts of {name!r} stored by the ranks "
                f"({slots}) do not cover it"
            )
    buffer_ranks: dict = {}
    for rank, part in enumerate(parts):
        for name in part["buffers"]:
            buffer_ranks.setdefault(name, rank)
    return {
        "params": params,
        "buffers": sorted(buffer_ranks),
        "buffer_ranks": buffer_ranks,
        "optimizers": _merge_optimizers([p["optimizers"] for p in parts]),
    }


def _merge_optimizers(per_rank: list[list[dict]]) -> list[dict]:
    """One record per optimizer index: the stages' param groups joined (hyper-parameters
    of the first rank holding the group), state records by parameter name."""
    counts = {len(o) for o in per_rank}
    if len(counts) > 1:
        raise ValueError(
            f"save_checkpoint: the ranks hold {sorted(counts)} optimizers: give "
            "every rank's OptimManager the same number"
        )
    out = []
    for parts in zip(*per_rank):
        groups, scalars, tensor_keys = [], {}, {}
        for part in parts:
            for g, group in enumerate(part["param_groups"]):
                if g == len(groups):
                    groups.append({**group, "params": []})
                groups[g]["params"] += [n for n in group["params"] if n not in groups[g]["params"]]
            for name, value in part["scalars"].items():
                scalars.setdefault(name, value)
            for name, value in part["tensor_keys"].items():
                tensor_keys.setdefault(name, value)
        out.append({"param_groups": groups, "scalars": scalars, "tensor_keys": tensor_keys})
    return out


def _remove_other_versions(path: str, keep: str) -> None:
    # Old versions, and folders and metadata drafts left by saves that died.
    for name in os.listdir(path):
        if name.startswith("v-") and name != keep:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        elif name.startswith(META + ".tmp-"):
            os.remove(os.path.join(path, name))
