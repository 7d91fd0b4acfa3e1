"""A `torch.save` file of a state dict (what BMTrain's `bmt.save` writes), read the way
stream.py reads a safetensors file: by name, whole or by rows.

The file is opened with `torch.load(weights_only=True)`, so it can hold tensors and
plain containers only, never code; and memory-mapped (`mmap=True`, files in torch's
zip format, the default since torch 1.6), so a rank's rows are read from the pages
that hold them and no rank loads the whole model. An older, non-zip file is read
whole (torch cannot map it).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping

import torch

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format
PICKLE_MAGIC = b"\x80"  # the legacy format starts with a pickle protocol opcode
SAFETENSORS_SUFFIX = ".safetensors"  # `save` writes safetensors for this suffix only


def is_safetensors_file(path: str) -> bool:
    """True when the file starts like a safetensors file: an 8-byte header length,
    then the JSON header's "{" (torch's legacy pickle has a magic number there)."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def is_torch_file(path: str) -> bool:
    """True when the file starts like a `torch.save` file (either format) and not like
    a safetensors file (whose length bytes may begin as a pickle does). Local."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(ZIP_MAGIC):
        return True
    return head.startswith(PICKLE_MAGIC) and not is_safetensors_file(path)


class TorchFile:
    """A state dict saved by torch.save, with safetensors' `safe_open` interface
    (`keys`, `get_tensor`, `get_slice(key)[rows]`, `get_slice(key).get_shape()`).

    Raises ValueError naming the file when it holds anything but a mapping of names to
    tensors, or objects that `weights_only` loading refuses.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            if path.endswith(SAFETENSORS_SUFFIX):
                # torch.load reads a path of that name as safetensors: a file object
                # it reads as what it is (whole: only a path can be mapped).
                with open(path, "rb") as f:
                    state = torch.load(f, map_location="cpu", weights_only=True)
            else:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as err:
                    if "mmap" not in str(err):
                        raise
                    state = torch.load(path, map_location="cpu", weights_only=True)  # legacy
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"nbtrain.load: {path!r} holds objects other than tensors, which loading "
                f"with weights_only=True refuses ({str(err).splitlines()[0]}). Save the "
                "model's state dict alone (torch.save(model.state_dict(), path))"
            ) from err
        except Exception as err:  # torch's errors for a damaged file vary by the damage
            raise ValueError(
                f"nbtrain.load: {path!r} is not a readable torch.save file "
                f"({err}); was it truncated?"
            ) from err
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ValueError(
                f"nbtrain.load: {path!r} holds a {type(state).__name__}, not a "
                "state dict (names to tensors); save model.state_dict()"
            )
        self.state = dict(state)

    def __enter__(self) -> "TorchFile":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.state)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.state[key].clone()  # off the map: the caller may keep or change it

    def get_slice(self, key: str) -> "_Rows":
        return _Rows(self.state[key])


class _Rows:
    """`file.get_slice(key)`: the shape, and rows by index (read from the map)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, rows) -> torch.Tensor:
        return self.tensor[rows].clone()
