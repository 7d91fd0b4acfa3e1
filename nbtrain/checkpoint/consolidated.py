"""The consolidated checkpoint: the plain model's state dict in one file, in BMTrain's
torch.save format, or safetensors for a `.safetensors` path.

`save(model, path)` writes the plain model's state dict (full tensors, plain names):
`torch.load` reads it and a plain torch model loads it, as a checkpoint of BMTrain's
`bmt.save`; for a path ending in `.safetensors`, `safetensors.torch.load_file` does.
`load(model, path)` reads either format (told apart by the file's first bytes, not its
name) into a sharded model of any world size. The safetensors save never holds the
whole model on a rank: it gathers and writes one Block (or one module's own
parameters) at a time; the load reads one tensor at a time and keeps this rank's
slices (stream.py).

With pipeline stages (`nbtrain.pipeline.stage_of`, whose names are the plain
`nn.Sequential(*layers)`'s) each stage's first rank writes its stage's tensors and
rank 0 joins them into the file; `load` gives each stage the tensors of its own layers.
"""

from __future__ import annotations

import os

import safetensors.torch
import torch

from ..comm import collectives as C
from ..comm.context import get_context
from ..zero import state_keys
from . import stream
from .layout import _commit, agreed
from .torch_file import SAFETENSORS_SUFFIX


def save(model, path: str) -> None:
    """Writes the full model as one file with the plain model's names.

    BMTrain's format, whatever the name (`x.pt`, `x.ckp`, `x.bin`): a `torch.save` of
    the full state dict, what `bmt.save` writes, so `torch.load` and a BMTrain script
    read it; building it holds the whole state dict in rank 0's memory, as BMTrain
    does. A path ending in `.safetensors` gets a safetensors file instead, streamed
    part by part: no rank ever holds the whole model.

    Collective: every rank calls this (each Block is gathered in turn); each pipeline
    stage's first rank writes a part beside `path`, rank 0 joins the parts into `path`
    (atomically: a failed save leaves any earlier file at `path` as it was).
    """
    ctx = get_context()
    folder = os.path.dirname(os.path.abspath(path))
    writes = ctx.topology.zero_rank == 0  # the first rank of each stage (rank 0 at pp 1)
    part = f"{path}.part{ctx.rank}"
    writer = None

    def start():
        nonlocal writer
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"nbtrain.save({path!r}): the folder {folder!r} does not exist; create it first"
            )
        if writes:
            try:
                writer = stream.PartWriter(part)
            except OSError as err:
                raise OSError(
                    f"nbtrain.save({path!r}): cannot write beside it ({err.strerror}: {part!r})"
                ) from err

    agreed(f"nbtrain.save({path!r})", start)
    try:
        for key, tensor in stream.units(model):
            if writer is not None:
                writer.add(key, tensor)
            del tensor  # one unit's tensors at a time
    finally:
        if writer is not None:
            writer.close()
    entries = writer.entries if writer is not None else None
    if ctx.world_size > 1:
        everyone = C.all_gather_object((part, entries))
    else:
        everyone = [(part, entries)]
    parts = [(p, e) for p, e in everyone if e is not None]

    def join():
        tmp = f"{path}.tmp-{os.getpid()}"
        safetensors_file = path.endswith(SAFETENSORS_SUFFIX)
        joined = tmp if safetensors_file else f"{tmp}{SAFETENSORS_SUFFIX}"
        try:
            stream.join_parts(joined, parts)
            if joined != tmp:
                torch.save(safetensors.torch.load_file(joined), tmp)
            _commit(tmp, path)
        except BaseException:
            stream.remove_quietly(tmp)
            raise
        finally:
            if joined != tmp:
                stream.remove_quietly(joined)

    try:
        agreed(f"nbtrain.save({path!r})", join, run_here=ctx.rank == 0)
    finally:
        if writer is not None:
            stream.remove_quietly(part)


def load(model, path: str, strict: bool = True):
    """Loads a file written by `save`: a `torch.save` file of the plain model's state
    dict (BMTrain's `bmt.save` checkpoints; loaded with weights_only=True and
    memory-mapped, see torch_file.py) or a safetensors one, whatever the file's name.

    Returns torch's (missing_keys, unexpected_keys). Each tensor is read on its own
    and the model keeps its slices (with pipeline stages, of its own stage's tensors:
    the other stages' keys are not unexpected). A shape mismatch raises a ValueError
    naming the key and both shapes; a file that is neither format, a ValueError
    naming it. Collective-free, but every rank must call it.
    """
    from torch.nn.modules.module import _IncompatibleKeys

    if not os.path.isfile(path):
        raise FileNotFoundError(f"nbtrain.load: no file {path!r}")
    source = stream.open_weights(path)
    in_file = stream.file_keys(source)
    wanted = state_keys(model)
    present = set(in_file)
    owners = stream.slice_owners(model)
    for key in wanted:
        if key not in present:
            continue
        if key in owners:  # only this rank's rows of it
            stream.load_slice(source, key, owners[key])
        else:
            model.load_state_dict({key: stream.read_one(source, key)}, strict=False)
    missing = [k for k in wanted if k not in present]
    expected = set(wanted)
    unexpected = (
        [] if get_context().topology.pipe_size > 1 else [k for k in in_file if k not in expected]
    )  # the other stages' layers
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"nbtrain.load({path!r}): missing keys {missing}, unexpected keys {unexpected}"
        )
    return _IncompatibleKeys(missing, unexpected)
