"""The sharded checkpoint's layout, shared by its save and load, and atomic writes.

`save_checkpoint(model, path, optim_manager, step)` writes a directory:

    path/meta.json              written last, names the version folder below
    path/v-<token>/rank00000.safetensors ... one file per rank

Every parameter is stored as the real (unpadded) elements of this rank's slice of
its flattened value: a Block's flat buffer (whose order does not depend on the world
size) or a DistributedParameter's flattened tensor, cut by the one partition rule
(`nbtrain.zero.partition.shard_range`). A loader of any world size M computes which
saved files overlap its own slice and reads only those ranges.

Tensor-parallel slices are stored the same way within their tp slot: each tp rank's
vector (its slices back to back) is cut over that slot's data-parallel group, and
meta.json records the tp and dp sizes and each slice's split dimension and full
shape. A loader at another tp size assembles its own slices from the saved slices
that overlap them (nbtrain.tensor_parallel.reshard), one parameter at a time. Optimizer state
tensors shaped like their parameter are stored the same way; scalar state (step
counts), hyper-parameters, schedules and the loss scale are the same on every rank
and go into meta.json from rank 0.

Pipeline stages: every rank stores the entries of its own stage under the plain
model's names (a Stage names its layers by their index in the whole model), a
stage's replicated tensors and buffers by the stage's first rank, a parameter tied
across stages (a GPT's embedding and output projection) once, under its first name,
by the first stage holding it. meta.json joins every rank's entries and records,
per entry, the ranks that stored its parts (per tp slot), and for each buffer the
rank that stored it; a loader at any pipeline layout reads the entries it holds.

Atomicity: each file is written to a temporary name, fsynced and renamed; meta.json
is replaced last. A save that dies anywhere before that rename leaves the previous
meta.json pointing at the previous, untouched version folder.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from ..comm import collectives as C
from ..comm.context import get_context
from ..zero import ShardKind, flat_buffers, is_slice, placement_of, shards, slice_kind

META = "meta.json"
FORMAT_VERSION = 1


# -- atomic files ------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: str, final: str) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))


def write_tensors(path: str, tensors: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp)
    _commit(tmp, path)


def write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    _commit(tmp, path)


def agreed(what: str, fn, run_here: bool = True):
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


# -- what each rank stores ------------------------------------------------------------


class Entry:
    """One local parameter: its name, where its real elements sit, how it is laid out."""

    def __init__(self, name, param, numel, kind, begin, end, layout_info, tp=False, shard=None):
        self.name, self.param, self.numel, self.kind = name, param, numel, kind
        self.begin, self.end = begin, min(end, numel)  # real elements held here
        self.layout_info = layout_info  # JSON: the shapes a loader must match
        self.tp = tp  # holds tensor-parallel slices: the vector differs per tp rank
        self.shard = shard  # (index, count) of the part this rank stores; None: nothing
        self.whole = True  # the loader reads it as one saved entry (else by parameter)

    def load_range(self) -> tuple[int, int]:
        """The elements this rank reads back: a replicated tensor is stored once but
        every rank holds all of it."""
        return (0, self.numel) if self.kind == "replicated" else (self.begin, self.end)

    @property
    def local_numel(self) -> int:
        return max(0, self.end - self.begin) if self.shard is not None else 0

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().reshape(-1)[: self.local_numel].cpu().contiguous().clone()

    def saved_info(self) -> dict:
        """This rank's part of the entry's meta.json record (writer.merge_params joins
        the ranks' parts)."""
        topo = get_context().topology
        return {
            "kind": self.kind,
            "numel": self.numel,
            "shapes": self.layout_info,
            "tp": self.tp,
            "shard": self.shard,
            "tp_slot": topo.tp_rank if self.tp else 0,
        }


def slot_info(name: str, shape, placed=None) -> list:
    """[name, shape] of one parameter in a stored vector; a tensor-parallel slice (its
    Placement `placed`) adds its split dimension, part count and full shape."""
    info = [name, list(shape)]
    if placed is not None:
        info.append(
            {"dim": placed.split_dim, "groups": placed.parts, "full": list(placed.full_shape)}
        )
    return info


def _tie_aliases(model: torch.nn.Module) -> dict[str, str]:
    """A pipeline stage's names of parameters an earlier stage holds too -> the plain
    model's first name for them (`Stage.tied_names`), with the stage's prefix."""
    out = {}
    for prefix, m in model.named_modules():
        for local, first in getattr(m, "tied_names", {}).items():
            out[f"{prefix}.{local}" if prefix else local] = f"{prefix}.{first}" if prefix else first
    return out


def local_entries(model: torch.nn.Module) -> list[Entry]:
    """This rank's parameters as checkpoint entries, under the plain model's names.

    With pipeline stages every rank holds its stage's parameters only; a parameter
    tied to an earlier stage's is named (and stored) as that stage's, once. A
    replicated parameter is stored by the first rank of its stage (or tp slot).
    """
    topo = get_context().topology
    buffers = {id(b.shard): b for b in flat_buffers(model)}
    experts = [n for n, p in model.named_parameters() if slice_kind(p) == "ep"] + [
        m.names[0]
        for b in buffers.values()
        for m in b.members
        if m.tp is not None and m.tp.slice_group == "ep"
    ]
    if experts and topo.ep_size > 1:
        raise NotImplementedError(
            f"sharded checkpoints do not store experts split over ep_size {topo.ep_size} "
            f"yet ({experts[0]!r}): save with nbtrain.save(model, path) and load with "
            "nbtrain.load, whose one file holds every expert"
        )
    aliases = _tie_aliases(model)
    sharded = {id(s.param): s for s in shards(model) if s.kind is ShardKind.PARAMETER}
    out = []
    for name, p in model.named_parameters():
        buffer = buffers.get(id(p))
        if buffer is not None:
            slots = [slot_info(m.names[0], m.shape, m.tp) for m in buffer.members]
            ranks = buffer.ranks
            out.append(
                Entry(
                    name,
                    p,
                    buffer.numel,
                    "flat",
                    buffer.start,
                    buffer.start + buffer.shard.numel(),
                    slots,
                    tp=any(m.tp is not None for m in buffer.members),
                    shard=(ranks.rank, ranks.size),
                )
            )
            continue
        tp = is_slice(p)
        plain = aliases.get(name, name)
        shard = sharded.get(id(p))
        placed = placement_of(p) if tp else None
        info = [slot_info(plain, p.shape if shard is None else shard.shape, placed)]
        if shard is not None:
            ranks = shard.ranks
            out.append(
                Entry(
                    plain,
                    p,
                    shard.numel,
                    "sharded",
                    shard.start,
                    shard.stop,
                    info,
                    tp,
                    shard=(ranks.rank, ranks.size),
                )
            )
        else:  # the same on every rank (of its stage, or tp slot): the first one stores it
            first = (topo.dp_rank if tp else topo.zero_rank) == 0 and plain == name
            out.append(
                Entry(
                    plain,
                    p,
                    p.numel(),
                    "replicated",
                    0,
                    p.numel() if first else 0,
                    info,
                    tp,
                    shard=(0, 1) if first else None,
                )
            )
    return out
