"""Streaming the consolidated safetensors file: no rank ever holds the whole model.

Saving walks the model one unit at a time (a Block, or a module holding its own
parameters): the unit's full tensors are gathered (collective), its writer appends
their bytes to a part file and frees them. Each pipeline stage's first rank writes
the stage's part (at pp 1: rank 0 alone); rank 0 then writes the safetensors header
(the names, dtypes, shapes and offsets every writer reported) and copies the parts
after it. The parts lie beside the file, so every writer must see that folder (as
the sharded checkpoint's ranks do).

Loading opens the file for one tensor at a time (the file is never mapped whole). A
tensor this rank keeps a contiguous part of (a Block's parameter, a
DistributedParameter) is read by rows, only those holding that part (safetensors
slicing); any other (a tensor-parallel slice, a buffer) is read whole and handed to
the model's own load_state_dict, which keeps this rank's slice.
"""

from __future__ import annotations

import json
import os
import struct

import torch
from safetensors import safe_open
from torch import nn

from ..zero import Block, ShardKind, full_items_by_parameter, shards
from .torch_file import TorchFile, is_torch_file

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def units(model: nn.Module):
    """(key, full tensor) of `model`'s state dict, one unit at a time: each Block's
    state dict (its parameters gathered), each other module's own parameters and
    buffers. Collective: every rank of the model's groups iterates in step."""

    def walk(module, prefix):
        if isinstance(module, Block):  # one parameter at a time, then its buffers
            yield from full_items_by_parameter(module, prefix)
            rest = {
                prefix + n: b
                for n, b in module._buffers.items()
                if b is not None and n not in module._non_persistent_buffers_set
            }
            for name, child in module._modules.items():
                if child is not None:  # their parameters are in the flat groups
                    rest.update(child.state_dict(prefix=prefix + name + "."))
            yield from rest.items()
            return
        if not module._modules:
            yield from module.state_dict(prefix=prefix).items()
            return
        own = {}
        module._save_to_state_dict(own, prefix, False)
        for hook in module._state_dict_hooks.values():
            hook(module, own, prefix, {})
        children = tuple(prefix + name + "." for name in module._modules)
        yield from ((k, v) for k, v in own.items() if not k.startswith(children))
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, prefix + name + ".")

    yield from walk(model, "")


class PartWriter:
    """Appends tensors to one part file, recording (key, dtype, shape, nbytes)."""

    def __init__(self, path: str):
        self.path, self.entries = path, []
        self.file = open(path, "wb")

    def add(self, key: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in DTYPES:
            raise TypeError(
                f"nbtrain.save: {key!r} has dtype {t.dtype}, which safetensors "
                f"cannot store here; use one of {sorted(map(str, DTYPES))}"
            )
        data = t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""
        self.file.write(memoryview(data))
        self.entries.append((key, DTYPES[t.dtype], list(t.shape), t.numel() * t.element_size()))

    def close(self) -> None:
        self.file.close()


def join_parts(path: str, parts: list[tuple[str, list]]) -> None:
    """Writes the safetensors file `path` (to `path` directly: the caller renames) from
    (part file, entries) pairs, in order; a key stored by two parts (a weight tied
    across pipeline stages) is kept from the first."""
    header, offset, chosen = {}, 0, []
    for part, entries in parts:
        position, keep = 0, []
        for key, dtype, shape, nbytes in entries:
            if key not in header:
                header[key] = {
                    "dtype": dtype,
                    "shape": shape,
                    "data_offsets": [offset, offset + nbytes],
                }
                keep.append((position, nbytes))
                offset += nbytes
            position += nbytes
        chosen.append((part, keep))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for part, keep in chosen:
            with open(part, "rb") as src:
                for position, nbytes in keep:
                    src.seek(position)
                    _copy(src, out, nbytes)


def _copy(src, dst, nbytes: int, chunk: int = 16 << 20) -> None:
    while nbytes > 0:
        data = src.read(min(chunk, nbytes))
        if not data:
            raise IOError(f"{src.name}: ended {nbytes} bytes early")
        dst.write(data)
        nbytes -= len(data)


def open_weights(path: str):
    """The file to read tensors from: a TorchFile for a `torch.save` state dict
    (BMTrain's checkpoints), else the path (read as safetensors; `file_keys` says
    when it is neither). Told apart by the file's first bytes, whatever its name.
    Either is what `source` means in the functions below."""
    if is_torch_file(path):
        return TorchFile(path)
    return path


def _open(source):
    return safe_open(source, framework="pt") if isinstance(source, str) else source


def file_keys(source) -> list[str]:
    """The tensor names in a weights file (a safetensors file: its header only). Raises
    ValueError naming the file when it is not a readable safetensors file."""
    try:
        with _open(source) as f:
            return list(f.keys())
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors' own errors say little about which file
        raise ValueError(
            f"{source!r} is not a readable safetensors file, nor a "
            f"torch.save state dict ({err}); was it truncated, or written by "
            "something else?"
        ) from err


def slice_owners(model: nn.Module) -> dict:
    """key -> this rank's contiguous part of it (a `nbtrain.zero.Shard`): a Block's
    parameter or a DistributedParameter; tensor-parallel slices and plain tensors are
    not listed (they take the whole tensor). Local."""
    return {
        name: shard
        for shard in shards(model)
        if shard.kind is not ShardKind.REPLICATED and shard.tp is None
        for name in shard.names
    }


def read_range(source, key: str, start: int, stop: int, shape) -> torch.Tensor | None:
    """Elements [start, stop) of the flattened tensor `key`, reading only the rows that
    hold them (safetensors slicing); None when start == stop. Raises ValueError when
    the file's shape is not `shape`. `source`: see open_weights. Local."""
    with _open(source) as f:
        piece = f.get_slice(key)
        saved = tuple(piece.get_shape())
        if saved != tuple(shape):
            raise ValueError(
                f"nbtrain.load: {key!r} has shape {saved} in the file but "
                f"{tuple(shape)} in the model"
            )
        if stop <= start:
            return None
        if len(saved) < 2:
            return f.get_tensor(key).reshape(-1)[start:stop]
        row = 1
        for n in saved[1:]:
            row *= n
        first, last = start // row, -(-stop // row)
        rows = piece[first:last].reshape(-1)
        return rows[start - first * row : stop - first * row]


def load_slice(source, key: str, owner) -> None:
    """Reads only this rank's part of `key` into its owner (see slice_owners)."""
    values = read_range(source, key, owner.start, owner.stop, owner.shape)
    if values is not None:
        with torch.no_grad():
            owner.values.copy_(values)


def read_one(source, key: str) -> torch.Tensor:
    """One tensor of the file, the file opened and closed around it."""
    with _open(source) as f:
        return f.get_tensor(key)


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
