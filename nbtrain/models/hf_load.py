"""Hugging Face folders (config.json + safetensors, sharded or not) read into any nbtrain
model, tensor by tensor, with no full copy of the model anywhere.

    config = read_hf_config(path)                  # config.json as a dict
    load_hf_weights(stage, path, hf_names)         # every parameter of `stage`, loaded

`load_hf_weights` works on a plain model, and on one built on the meta device and
then tensor-parallelised, cut into pipeline stages and sharded by `nbtrain.wrap`:
for each parameter it opens the file holding it and reads, as `nbtrain.load` does
(checkpoint/stream.py), only this rank's rows of a ZeRO-sharded parameter, or the
one tensor (a tensor-parallel slice, a transposed weight) that the model's
`load_state_dict` then cuts to this rank's slice. A rank never holds the whole model.

Names: a model package maps each of its plain parameter names to the checkpoint's
(`hf_names(plain_name) -> [HFWeight, ...]`, the first found in the folder wins). A
pipeline stage's names ("3.mlp.0.weight") are turned back into the plain model's by
`record_plain_names(stage, model)`, called before `wrap`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..checkpoint import stream


@dataclass(frozen=True)
class HFWeight:
    """A checkpoint tensor: its name in the Hugging Face files, and whether it is stored
    transposed (GPT-2's Conv1D keeps (in, out) where nn.Linear has (out, in))."""

    name: str
    transpose: bool = False


def read_hf_config(path: str) -> dict:
    """The folder's config.json as a dict. Raises FileNotFoundError naming the folder
    when it has none. Local."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"{path!r} has no config.json: give the folder a Hugging Face "
            "model was saved to (save_pretrained)"
        )
    with open(file) as f:
        return json.load(f)


def weight_files(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> the safetensors file holding it, from
    model.safetensors.index.json (a sharded save) or model.safetensors. Local."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            mapping = json.load(f)["weight_map"]
        missing = sorted({f for f in mapping.values() if not os.path.isfile(os.path.join(path, f))})
        if missing:
            raise FileNotFoundError(
                f"{path!r}: model.safetensors.index.json names {len(missing)} shard file(s) "
                f"the folder lacks: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                "; copy (or download) the missing shards into the folder, or save the "
                "model again"
            )
        return {name: os.path.join(path, file) for name, file in mapping.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        found = sorted(os.listdir(path)) if os.path.isdir(path) else "no such folder"
        raise FileNotFoundError(
            f"{path!r} has neither model.safetensors nor model.safetensors.index.json "
            f"(found: {found}); save the model with save_pretrained(..., "
            "safe_serialization=True)"
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def record_plain_names(stage: torch.nn.Module, model: torch.nn.Module) -> dict[str, str]:
    """Records on `stage` (`stage.plain_names`) each of its parameter names -> the name
    of the same parameter in `model`, the whole model the stage's layers came from.
    Call it before `nbtrain.wrap(stage)` (wrapping replaces the parameters). A parameter
    reached under several names (a tied embedding) is recorded once. Local."""
    plain = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        plain.setdefault(id(p), name)
    names, seen = {}, set()
    for name, p in stage.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) not in plain:
            raise ValueError(
                f"record_plain_names: the stage's parameter {name!r} is not a "
                "parameter of the model given"
            )
        names[name] = plain[id(p)]
    stage.plain_names = names
    return names


def load_hf_weights(model: torch.nn.Module, path: str, hf_names, *, progress: bool = False) -> int:
    """Loads every parameter of `model` from the Hugging Face folder `path`.

    Args:
        model: a plain model, or a stage (see `record_plain_names`), sharded or not.
        path: the folder (config.json and safetensors, sharded or not).
        hf_names: plain parameter name -> list of HFWeight, the first present in the
            folder is read (a tied head: its own name, else the embedding's).
        progress: a tqdm bar over the tensors.

    Returns the number of tensors read. Raises KeyError naming every parameter the
    folder lacks (nothing is half-loaded silently; what was read stays loaded), and
    ValueError for a shape mismatch (from the model's load_state_dict). Local: each
    rank reads its own parameters; no collective.
    """
    files = weight_files(path)
    plain_names = getattr(model, "plain_names", None)
    if plain_names is None:
        plain_names = {}
        seen = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                plain_names[name] = name
    owners = stream.slice_owners(model)
    missing, read = [], 0
    for key, plain in tqdm(
        plain_names.items(),
        desc=f"loading {os.path.basename(path)}",
        disable=not progress,
        leave=False,
    ):
        source = next((w for w in hf_names(plain) if w.name in files), None)
        if source is None:
            missing.append(f"{plain} (looked for {[w.name for w in hf_names(plain)]})")
            continue
        read += 1
        if key in owners and not source.transpose:  # only this rank's rows of it
            stream.load_slice(files[source.name], source.name, owners[key])
            continue
        value = stream.read_one(files[source.name], source.name)
        if source.transpose:
            value = value.t().contiguous()
        model.load_state_dict({key: value}, strict=False)
        del value  # one checkpoint tensor at a time
    if missing:
        raise KeyError(
            f"{path!r} lacks {len(missing)} of the model's parameters: " + "; ".join(missing)
        )
    return read
