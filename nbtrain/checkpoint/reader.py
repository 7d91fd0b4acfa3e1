"""`load_checkpoint`: a sharded checkpoint read back at any world size.

A loader at world size M needs, for each parameter, the real elements of its own
slice; the checkpoint's meta.json gives the saving world size S, and the same
partition rule tells which saved rank files hold which ranges. Each overlapping
range is read with safetensors' lazy slicing, so a rank reads what it keeps.
Tensor-parallel slices reshard across tp sizes through nbtrain.tensor_parallel.reshard.

Entries are found by name, so a checkpoint reshards between pipeline layouts too
(saved at pp=2, loaded at pp=1 with dp=2, and the reverse): each rank reads the
entries of the layers it holds. meta.json lists, per entry, the ranks that stored its
parts (a stage's entries are stored by that stage's ranks only). A parameter stored
in another grouping (a Block's flat vector at one layout, single tensors at another)
is read by its own name from whichever saved vector holds it.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors import safe_open

from ..comm.context import get_context
from ..comm.renamed import model_first
from ..tensor_parallel.reshard import read_tp_entry
from ..zero.partition import shard_range
from .layout import META, local_entries

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}


class _Reader:
    """Lazily opened rank files of one checkpoint version."""

    def __init__(self, path: str, meta: dict):
        self.folder = os.path.join(path, meta["version"])
        self.world = int(meta["world_size"])
        self.tp = int(meta.get("tp_size", 1))
        self.dp = int(meta.get("dp_size", self.world))
        self.pipe_size = int(meta.get("pipe_size", 1))
        self.params = meta["params"]
        self.slots: dict = {}  # parameter name -> (saved entry, offset, shape, tp info)
        for entry, saved in self.params.items():
            offset = 0
            for name, shape, *tp in saved["shapes"]:
                self.slots.setdefault(name, (entry, offset, tuple(shape), tp))
                offset += math.prod(shape)
        self._files: dict = {}

    def file(self, rank: int):
        if rank not in self._files:
            name = os.path.join(self.folder, f"rank{rank:05d}.safetensors")
            if not os.path.exists(name):
                raise FileNotFoundError(f"checkpoint shard {name} is missing")
            try:
                self._files[rank] = safe_open(name, framework="pt", device="cpu")
            except Exception as err:  # safetensors' message names no file
                raise ValueError(
                    f"checkpoint shard {name} is not a readable safetensors "
                    f"file ({err}): truncated by a crash or overwritten? Load "
                    "an earlier checkpoint"
                ) from err
        return self._files[rank]

    def _ranks(self, saved: dict, tp_rank: int | None) -> list[int]:
        """The ranks that stored the parts of an entry, in partition order."""
        if "ranks" in saved:
            return saved["ranks"][tp_rank or 0]
        if tp_rank is None:  # written before pipelines: every rank, in rank order
            return list(range(self.world))
        return [d * self.tp + tp_rank for d in range(self.dp)]

    def read(
        self,
        key: str,
        saved: dict,
        begin: int,
        end: int,
        out: torch.Tensor,
        tp_rank: int | None = None,
    ) -> None:
        """Copies elements [begin, end) of saved vector `key` (described by `saved`, its
        meta.json record) into `out[: end - begin]`; with `tp_rank`, of the vector of
        that tp slot (cut over its dp group)."""
        ranks, numel = self._ranks(saved, tp_rank), saved["numel"]
        if saved["kind"] == "replicated":
            sources = [(ranks[0], 0, numel)]
        else:
            sources = [(r, *shard_range(numel, len(ranks), i)) for i, r in enumerate(ranks)]
        for rank, lo, hi in sources:
            a, b = max(lo, begin), min(hi, end, numel)
            if a < b:
                piece = self.file(rank).get_slice(key)[a - lo : b - lo]
                out[a - begin : b - begin].copy_(piece)


def _logical(info) -> tuple:
    """(name, shape) of a stored parameter; a tp slice by its full shape and split, as
    its slice's shape varies with the tp size."""
    name, shape, *tp = info
    return name, (tuple(tp[0]["full"]), tp[0]["dim"], tp[0]["groups"]) if tp else tuple(shape)


def _check_shape(name: str, theirs: tuple, shape: tuple) -> None:
    if isinstance(theirs[0], tuple) != isinstance(shape[0], tuple):
        ways = ["whole", "as tensor-parallel slices"]
        if isinstance(shape[0], tuple):
            ways.reverse()
        raise ValueError(
            f"load_checkpoint: {name!r} was saved {ways[1]}, and the model holds it "
            f"{ways[0]}: build the model "
            "with the same layers as the saving run (nbtrain.parallelize works at "
            "tp_size 1 too), or move weights between them with nbtrain.save/load"
        )
    if theirs != shape:
        raise ValueError(
            f"load_checkpoint: {name!r} has shape {theirs} in the "
            f"checkpoint but {shape} in the model"
        )


def _check_fits(entry, reader) -> bool:
    """Raises unless every parameter of `entry` is in the checkpoint with its shape.
    True: saved as one entry of the same name and layout (read whole); False: read
    parameter by parameter from wherever they are stored (another grouping)."""
    saved = reader.params.get(entry.name)
    mine = dict(map(_logical, entry.layout_info))
    if saved is not None:
        theirs = dict(map(_logical, saved["shapes"]))
        for name, shape in mine.items():
            if name in theirs:
                _check_shape(name, theirs[name], shape)
        if list(mine) == list(theirs):
            if saved["numel"] != entry.numel and not entry.tp:
                raise ValueError(
                    f"load_checkpoint: {entry.name!r} holds {saved['numel']} "
                    f"elements in the checkpoint but {entry.numel} in the model"
                )
            return True
    for name, shape in mine.items():
        found = reader.slots.get(name)
        if found is None:
            raise KeyError(f"load_checkpoint: parameter {name!r} is not in the checkpoint")
        _check_shape(name, _logical([name, list(found[2]), *found[3]])[1], shape)
        if found[3] or isinstance(shape[0], tuple):
            raise ValueError(
                f"load_checkpoint: {name!r} is a tensor-parallel slice saved in "
                f"{found[0]!r} and held in {entry.name!r}: tp slices reshard "
                "only when the model groups them as the saving run did"
            )
    return False


def _load_vector(
    reader, entry, target: torch.Tensor, prefix: str = "model/", suffix: str = ""
) -> None:
    """Fills `target` (shaped like the local parameter) from the checkpoint vector
    `{prefix}{name}{suffix}`; padding 0."""
    flat = torch.zeros(target.numel(), dtype=target.dtype)
    begin, end = entry.load_range()
    if entry.whole:
        saved, key = reader.params[entry.name], f"{prefix}{entry.name}{suffix}"
        if entry.tp:
            read_tp_entry(reader, key, entry, saved, begin, end, flat)
        else:
            reader.read(key, saved, begin, end, flat)
    else:
        offset = 0
        for name, shape, *_ in entry.layout_info:
            numel = math.prod(shape)
            lo, hi = max(begin, offset), min(end, offset + numel)
            if lo < hi:
                source, at, _, _ = reader.slots[name]
                reader.read(
                    f"{prefix}{source}{suffix}",
                    reader.params[source],
                    at + lo - offset,
                    at + hi - offset,
                    flat[lo - begin :],
                )
            offset += numel
    with torch.no_grad():
        target.copy_(flat.view(target.shape))


def _saved_state_names(reader, entry, group_names: set) -> str:
    """The name the checkpoint keeps `entry`'s optimizer state under: its own, or that of
    the saved vector holding its first parameter (another grouping)."""
    if entry.whole and entry.name in group_names:
        return entry.name
    names = [reader.slots[n][0] for n, *_ in entry.layout_info]
    missing = [n for n, s in zip(entry.layout_info, names) if s not in group_names]
    if missing:
        raise ValueError(
            f"load_checkpoint: optimizer parameter {entry.name!r} holds "
            f"{[m[0] for m in missing]}, which the checkpoint's param group "
            "does not: build the optimizer's param groups as the saving run did"
        )
    return names[0]


def _load_optimizer(reader, part: dict, opt, entries_by_id: dict) -> None:
    groups = part["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"load_checkpoint: the checkpoint has {len(groups)} param groups, "
            f"the optimizer {len(opt.param_groups)}"
        )
    state, saved_groups, index = {}, [], 0
    for saved, group in zip(groups, opt.param_groups):
        names = [entries_by_id[id(p)].name for p in group["params"]]
        same_layout = reader.pipe_size == 1 == get_context().topology.pipe_size
        if (
            same_layout
            and names != saved["params"]
            and all(entries_by_id[id(p)].whole for p in group["params"])
        ):
            raise ValueError(
                f"load_checkpoint: optimizer parameters {names} differ from the "
                f"checkpoint's {saved['params']}"
            )
        ids = []
        for p in group["params"]:
            entry = entries_by_id[id(p)]
            source = _saved_state_names(reader, entry, set(saved["params"]))
            st = {}
            for key, dtype in part["tensor_keys"][source].items():
                value = torch.zeros(p.shape, dtype=_DTYPES[dtype])
                _load_vector(reader, entry, value, f"optim{reader.optim_index}/", f"/{key}")
                st[key] = value.to(p.device)
            for key, sc in part["scalars"][source].items():
                dtype = sc.get("tensor_dtype")
                st[key] = (
                    sc["value"]
                    if dtype is None
                    else torch.tensor(sc["value"], dtype=_DTYPES[dtype])
                )
            if st:
                state[index] = st
            ids.append(index)
            index += 1
        hyper = {
            k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k != "params"
        }
        saved_groups.append({**hyper, "params": ids})
    opt.load_state_dict({"state": state, "param_groups": saved_groups})


def load_checkpoint(model: torch.nn.Module, path: str, optim_manager=None) -> dict:
    """Restores a `save_checkpoint` directory into `model` (and manager) of any world size
    and pipeline layout (a `nbtrain.pipeline.stage_of` stage reads its own layers'
    entries, a parameter tied across stages on every stage holding it), whether or not
    the saving and loading runs group parameters alike (Blocks, plain or sharded ones).

    The order is `nbtrain.load`'s and BMTrain's `bmt.load(model, path)`; the old
    `load_checkpoint(path, model)` still works, with a FutureWarning.

    Returns:
        The metadata dict: "step", "world_size" (of the saving run), "version", ...

    Raises:
        KeyError / ValueError naming the parameter (and both shapes) when the
        checkpoint does not fit the model or optimizer.

    Collective-free, but every rank must call it (each reads its own ranges). A
    background save (`non_blocking=True`) of this rank is waited for first.
    """
    from .asynchronous import wait

    model, path = model_first("load_checkpoint", model, path)  # the old order warns
    wait()
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    reader = _Reader(path, meta)
    entries = local_entries(model)
    for entry in entries:
        entry.whole = _check_fits(entry, reader)
    for entry in entries:  # a parameter tied across stages: every stage reads it
        _load_vector(reader, entry, entry.param.data)
    buffers = dict(model.named_buffers())
    for name in meta["buffers"]:
        if name in buffers:
            rank = meta.get("buffer_ranks", {}).get(name, 0)
            with torch.no_grad():
                buffers[name].copy_(reader.file(rank).get_tensor(f"buffer/{name}"))
    if optim_manager is not None:
        parts = meta.get("optimizers") or []
        if len(parts) != len(optim_manager.optimizers):
            raise ValueError(
                f"load_checkpoint: the checkpoint has {len(parts)} optimizers, "
                f"the manager {len(optim_manager.optimizers)}"
            )
        by_id = {id(e.param): e for e in entries}
        for i, (part, opt) in enumerate(zip(parts, optim_manager.optimizers)):
            reader.optim_index = i
            _load_optimizer(reader, part, opt, by_id)
        if meta.get("manager") is not None:
            optim_manager.load_scalar_state(meta["manager"])
    return meta
