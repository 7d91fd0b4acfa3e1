"""`load_checkpoint`: a sharded checkpoint read back at any world size.

A loader at world size M needs, for each parameter, the real elements of its own
slice; the checkpoint's meta.json gives the saving world size S, and the same
partition rule tells which saved rank files hold which ranges. Each overlapping
range is read with safetensors' lazy slicing, so a rank reads what it keeps.
Tensor-parallel slices reshard across tp sizes through tp_reshard.py.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from ..zero.partition import shard_range
from .layout import META, local_entries
from .tp_reshard import read_tp_entry

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}


class _Reader:
    """Lazily opened rank files of one checkpoint version."""

    def __init__(self, path: str, meta: dict):
        self.folder = os.path.join(path, meta["version"])
        self.world = int(meta["world_size"])
        self.tp = int(meta.get("tp_size", 1))
        self.dp = int(meta.get("dp_size", self.world))
        self.params = meta["params"]
        self._files: dict = {}

    def file(self, rank: int):
        if rank not in self._files:
            name = os.path.join(self.folder, f"rank{rank:05d}.safetensors")
            if not os.path.exists(name):
                raise FileNotFoundError(f"checkpoint shard {name} is missing")
            self._files[rank] = safe_open(name, framework="pt", device="cpu")
        return self._files[rank]

    def read(self, key: str, kind: str, numel: int, begin: int, end: int,
             out: torch.Tensor, tp_rank: int | None = None) -> None:
        """Copies elements [begin, end) of saved vector `key` into `out[: end - begin]`;
        with `tp_rank`, of the vector of that tp slot (cut over its dp group)."""
        if tp_rank is None:
            ranks, size = list(range(self.world)), self.world
        else:  # the saving ranks of that tp slot: rank = dp_rank * tp_size + tp_rank
            ranks, size = [d * self.tp + tp_rank for d in range(self.dp)], self.dp
        if kind == "replicated":
            sources = [(ranks[0], 0, numel)]
        else:
            sources = [(r, *shard_range(numel, size, i)) for i, r in enumerate(ranks)]
        for rank, lo, hi in sources:
            a, b = max(lo, begin), min(hi, end, numel)
            if a < b:
                piece = self.file(rank).get_slice(key)[a - lo:b - lo]
                out[a - begin:b - begin].copy_(piece)


def _logical(info) -> tuple:
    """(name, shape) of a stored parameter; a tp slice by its full shape and split, as
    its slice's shape varies with the tp size."""
    name, shape, *tp = info
    return name, (tuple(tp[0]["full"]), tp[0]["dim"], tp[0]["groups"]) if tp else tuple(shape)


def _check_fits(entry, saved: dict | None) -> None:
    if saved is None:
        raise KeyError(f"load_checkpoint: parameter {entry.name!r} is not in the checkpoint")
    mine = dict(map(_logical, entry.layout_info))
    theirs = dict(map(_logical, saved["shapes"]))
    for name, shape in mine.items():
        if name not in theirs:
            raise KeyError(f"load_checkpoint: {name!r} is not in the checkpoint")
        if isinstance(theirs[name][0], tuple) != isinstance(shape[0], tuple):
            ways = ["whole", "as tensor-parallel slices"]
            if isinstance(shape[0], tuple):
                ways.reverse()
            raise ValueError(
                f"load_checkpoint: {name!r} was saved {ways[1]}, and the model holds it "
                f"{ways[0]}: build the model "
                "with the same layers as the saving run (nbtrain.parallelize works at "
                "tp_size 1 too), or move weights between them with nbtrain.save/load")
        if theirs[name] != shape:
            raise ValueError(f"load_checkpoint: {name!r} has shape {theirs[name]} in the "
                             f"checkpoint but {shape} in the model")
    if list(mine) != list(theirs) or (saved["numel"] != entry.numel and not entry.tp):
        raise ValueError(f"load_checkpoint: {entry.name!r} holds {list(theirs)} in the "
                         f"checkpoint but {list(mine)} in the model")


def _load_vector(reader, key, entry, target: torch.Tensor) -> None:
    """Fills `target` (shaped like the local parameter) from the checkpoint; padding 0."""
    saved = reader.params[entry.name]
    flat = torch.zeros(target.numel(), dtype=target.dtype)
    begin, end = entry.load_range()
    if entry.tp:
        read_tp_entry(reader, key, entry, saved, begin, end, flat)
    else:
        reader.read(key, saved["kind"], entry.numel, begin, end, flat)
    with torch.no_grad():
        target.copy_(flat.view(target.shape))


def _load_optimizer(reader, part: dict, opt, entries_by_id: dict) -> None:
    groups = part["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(groups)} param groups, "
                         f"the optimizer {len(opt.param_groups)}")
    state, saved_groups, index = {}, [], 0
    for saved, group in zip(groups, opt.param_groups):
        names = [entries_by_id[id(p)].name for p in group["params"]]
        if names != saved["params"]:
            raise ValueError(f"load_checkpoint: optimizer parameters {names} differ from the "
                             f"checkpoint's {saved['params']}")
        ids = []
        for p, name in zip(group["params"], names):
            entry = entries_by_id[id(p)]
            st = {}
            for key, dtype in part["tensor_keys"][name].items():
                value = torch.zeros(p.shape, dtype=_DTYPES[dtype])
                _load_vector(reader, f"optim{reader.optim_index}/{name}/{key}", entry, value)
                st[key] = value.to(p.device)
            for key, sc in part["scalars"][name].items():
                dtype = sc.get("tensor_dtype")
                st[key] = sc["value"] if dtype is None else torch.tensor(
                    sc["value"], dtype=_DTYPES[dtype])
            if st:
                state[index] = st
            ids.append(index)
            index += 1
        hyper = {k: tuple(v) if isinstance(v, list) else v
                 for k, v in saved.items() if k != "params"}
        saved_groups.append({**hyper, "params": ids})
    opt.load_state_dict({"state": state, "param_groups": saved_groups})


def load_checkpoint(path: str, model: torch.nn.Module, optim_manager=None) -> dict:
    """Restores a `save_checkpoint` directory into a model (and manager) of any world size.

    Returns:
        The metadata dict: "step", "world_size" (of the saving run), "version", ...

    Raises:
        KeyError / ValueError naming the parameter (and both shapes) when the
        checkpoint does not fit the model or optimizer.

    Collective-free, but every rank must call it (each reads its own ranges).
    """
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    reader = _Reader(path, meta)
    entries = local_entries(model)
    for entry in entries:
        _check_fits(entry, meta["params"].get(entry.name))
    for entry in entries:
        _load_vector(reader, f"model/{entry.name}", entry, entry.param.data)
    buffers = dict(model.named_buffers())
    for name in meta["buffers"]:
        if name in buffers:
            with torch.no_grad():
                buffers[name].copy_(reader.file(0).get_tensor(f"buffer/{name}"))
    if optim_manager is not None:
        parts = meta.get("optimizers") or []
        if len(parts) != len(optim_manager.optimizers):
            raise ValueError(f"load_checkpoint: the checkpoint has {len(parts)} optimizers, "
                             f"the manager {len(optim_manager.optimizers)}")
        by_id = {id(e.param): e for e in entries}
        for i, (part, opt) in enumerate(zip(parts, optim_manager.optimizers)):
            reader.optim_index = i
            _load_optimizer(reader, part, opt, by_id)
        if meta.get("manager") is not None:
            optim_manager.load_scalar_state(meta["manager"])
    return meta
