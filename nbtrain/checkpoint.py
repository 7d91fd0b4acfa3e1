"""Checkpoints: one consolidated safetensors file, or sharded and reshardable N -> M.

`save(model, path)` writes the plain model's state dict (full tensors, plain names)
from rank 0: a file `safetensors.torch.load_file` reads and a plain torch model
loads. `load(model, path)` reads it into a sharded model of any world size.

`save_checkpoint(path, model, optim_manager, step)` writes a directory:

    path/meta.json              written last, names the version folder below
    path/v-<token>/rank00000.safetensors ... one file per rank

Every parameter is stored as the real (unpadded) elements of this rank's slice of
its flattened value: a Block's flat buffer (whose order does not depend on the world
size) or a DistributedParameter's flattened tensor. Rank s of S holds elements
[s * ceil(n / S), min((s + 1) * ceil(n / S), n)), so a loader of any world size M
computes which saved files overlap its own slice and reads only those ranges.
Optimizer state tensors shaped like their parameter are stored the same way;
scalar state (step counts), hyper-parameters, schedules and the loss scale are the
same on every rank and go into meta.json from rank 0.

Atomicity: each file is written to a temporary name, fsynced and renamed; meta.json
is replaced last. A save that dies anywhere before that rename leaves the previous
meta.json pointing at the previous, untouched version folder.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch
from safetensors.torch import load_file, save_file

from .dist import collectives as C
from .dist.context import get_context
from .zero.block import Block
from .zero.parameter import DistributedParameter

META = "meta.json"
FORMAT_VERSION = 1
_HOOK = None  # tests only: called as _HOOK(stage) at named points of save_checkpoint


def _hook(stage: str) -> None:
    if _HOOK is not None:
        _HOOK(stage)


# -- atomic files ------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: str, final: str, stage: str) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _hook(stage)
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))


def _write_tensors(path: str, tensors: dict, stage: str = "") -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp)
    _commit(tmp, path, stage)


def _write_json(path: str, value: dict, stage: str = "") -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    _commit(tmp, path, stage)


def _agreed(what: str, fn, run_here: bool = True):
    """Runs `fn` on this rank (if `run_here`), then every rank learns whether all
    succeeded, so no rank moves on (to the metadata, or out of the save) alone.

    The failing rank re-raises its own error; the others raise a RuntimeError.
    Collective: every rank calls this (one all-reduce).
    """
    result, error = None, None
    if run_here:
        try:
            result = fn()
        except Exception as exc:  # reported to the peers first, then re-raised
            error = exc
    flag = torch.tensor([0.0 if error is not None else 1.0], device=get_context().device)
    C.all_reduce(flag, op="min", label="checkpoint")
    if error is not None:
        raise error
    if flag.item() < 1.0:
        raise RuntimeError(f"{what} failed on another rank; see that rank's error")
    return result


# -- consolidated ------------------------------------------------------------------

def save(model: torch.nn.Module, path: str) -> None:
    """Writes the full model as one `.safetensors` file with the plain model's names.

    Collective: every rank calls this (the shards are gathered); rank 0 writes.
    """
    state = model.state_dict()
    # Clones: safetensors refuses tensors that share memory (tied weights).
    _agreed("nbtrain.save", lambda: _write_tensors(
        path, {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}),
        run_here=get_context().rank == 0)


def load(model: torch.nn.Module, path: str, strict: bool = True):
    """Loads a file written by `save` (or any safetensors state dict of the plain model).

    Returns torch's (missing_keys, unexpected_keys). A shape mismatch raises a
    ValueError naming the key and both shapes. Every rank reads the file and keeps
    its own slices. Collective-free, but every rank must call it.
    """
    # strict=False, then our own check: a Block's submodules report the Block's keys
    # as unexpected after the Block has consumed them (torch loads children last).
    result = model.load_state_dict(load_file(path), strict=False)
    owned = {prefix + ("." if prefix else "") + name
             for prefix, m in model.named_modules() if isinstance(m, Block)
             for g in m.groups for e in g.entries for name in e.names}
    result.unexpected_keys[:] = [k for k in result.unexpected_keys if k not in owned]
    if strict and (result.missing_keys or result.unexpected_keys):
        raise RuntimeError(f"nbtrain.load({path!r}): missing keys {result.missing_keys}, "
                           f"unexpected keys {result.unexpected_keys}")
    return result


# -- what each rank stores ------------------------------------------------------------

class _Entry:
    """One local parameter: its name, where its real elements sit, how it is laid out."""

    def __init__(self, name, param, numel, kind, begin, end, layout_info):
        self.name, self.param, self.numel, self.kind = name, param, numel, kind
        self.begin, self.end = begin, min(end, numel)  # real elements held here
        self.layout_info = layout_info  # JSON: the shapes a loader must match

    @property
    def local_numel(self) -> int:
        return max(0, self.end - self.begin)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().reshape(-1)[: self.local_numel].cpu().contiguous().clone()


def _entries(model: torch.nn.Module) -> list[_Entry]:
    ctx = get_context()
    groups = {id(g.shard): g for m in model.modules() if isinstance(m, Block) for g in m.groups}
    out = []
    for name, p in model.named_parameters():
        group = groups.get(id(p))
        if group is not None:
            prefix = name.rpartition(".")[0]
            slots = [[f"{prefix}.{s.name}" if prefix else s.name, list(s.shape)]
                     for s in group.layout.slots]
            begin, end = group.layout.shard_range(ctx.rank)
            out.append(_Entry(name, p, group.layout.numel, "flat", begin, end, slots))
        elif isinstance(p, DistributedParameter):
            n = p.numel()
            out.append(_Entry(name, p, p.full_numel, "sharded", ctx.rank * n,
                              (ctx.rank + 1) * n, [[name, list(p.full_shape)]]))
        else:  # replicated on every rank: rank 0 stores it
            end = p.numel() if ctx.rank == 0 else 0
            out.append(_Entry(name, p, p.numel(), "replicated", 0, end, [[name, list(p.shape)]]))
    return out


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
                raise ValueError("save_checkpoint: the optimizer holds a parameter that is "
                                 "not in the model")
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

def save_checkpoint(path: str, model: torch.nn.Module, optim_manager=None, step=None) -> None:
    """Writes model, optimizer state, schedules, loss scale and `step` as shards.

    Args:
        path: a directory (created if needed); a previous checkpoint there is
            replaced only once the new one is complete.
        model: the sharded model.
        optim_manager: an OptimManager whose optimizers (and schedules) to save.
        step: any JSON value, returned by `load_checkpoint` as meta["step"].

    Collective: every rank calls this; each writes its own file, rank 0 the metadata.
    """
    ctx = get_context()
    token = torch.tensor([time.time_ns() % (2**62)], dtype=torch.int64, device=ctx.device)
    C.broadcast(token, src=0, label="checkpoint.token")  # one version name on every rank
    version = f"v-{int(token.item()):x}"

    def write_shard() -> dict:
        os.makedirs(os.path.join(path, version), exist_ok=True)
        entries = _entries(model)
        tensors = {f"model/{e.name}": e.local(e.param) for e in entries}
        by_id = {id(e.param): e for e in entries}
        optims = [] if optim_manager is None else [
            _optim_part(opt, by_id, tensors, i) for i, opt in enumerate(optim_manager.optimizers)]
        if ctx.rank == 0:
            buffers = {n: b for n, b in model.named_buffers()}
            tensors.update({f"buffer/{n}": b.detach().cpu().contiguous().clone()
                            for n, b in buffers.items()})
        meta = {"format": FORMAT_VERSION, "world_size": ctx.world_size, "step": step,
                "version": version, "buffers": sorted(dict(model.named_buffers())),
                "params": {e.name: {"kind": e.kind, "numel": e.numel, "shapes": e.layout_info}
                           for e in entries},
                "optimizers": optims,
                "manager": None if optim_manager is None else optim_manager.scalar_state()}
        _write_tensors(os.path.join(path, version, f"rank{ctx.rank:05d}.safetensors"),
                       tensors, stage="shard")
        return meta

    def write_meta() -> None:
        _write_json(os.path.join(path, META), meta, stage="meta")
        _remove_other_versions(path, version)

    # Every shard is on disk before the metadata names them.
    meta = _agreed("save_checkpoint (shards)", write_shard)
    _agreed("save_checkpoint (metadata)", write_meta, run_here=ctx.rank == 0)


def _remove_other_versions(path: str, keep: str) -> None:
    # Old versions, and folders and metadata drafts left by saves that died.
    for name in os.listdir(path):
        if name.startswith("v-") and name != keep:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        elif name.startswith(META + ".tmp-"):
            os.remove(os.path.join(path, name))


from ._checkpoint_load import load_checkpoint  # noqa: E402  (the reading half)

__all__ = ["save", "load", "save_checkpoint", "load_checkpoint"]
