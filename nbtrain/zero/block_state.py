"""A Block's state dict and gradients as full tensors: its flat groups gathered one at a
time, tensor-parallel slices assembled whole (nbtrain.tensor_parallel.slices), and
loading full tensors or this rank's slices back into the shards. `Block` calls these;
they read only its groups.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..tensor_parallel.slices import full_from_slice, slice_from_full


def full_items(groups, prefix: str = "", copy: bool = True):
    """(name, full tensor) of every parameter of `groups`, one group gathered at a time.
    `copy=False` gives views into the gathered group. Collective over each group's ranks."""
    for group in groups:
        full = group.gather_copy()
        for view, entry in zip(group.param_views(full), group.entries):
            if entry.tp is not None:
                value = full_from_slice(view, entry.tp)
            else:
                value = view.clone() if copy else view
            for name in entry.names:
                yield prefix + name, value
        del full


def load_groups(groups, state_dict: dict, prefix: str, missing_keys: list) -> set[str]:
    """Loads each parameter of `groups` from `state_dict` (a full tensor, or this rank's
    tensor-parallel slice); appends the absent ones to `missing_keys`; returns every key
    the groups own.

    Raises:
        ValueError: a tensor whose shape is neither the full one nor this rank's slice.
    """
    own = set()
    for group in groups:
        for index, (slot, entry) in enumerate(zip(group.layout.slots, group.entries)):
            keys = [prefix + n for n in entry.names]
            own.update(keys)
            present = [k for k in keys if k in state_dict]
            if not present:
                missing_keys.append(keys[0])
                continue
            value = state_dict[present[0]]
            if entry.tp is not None:  # the full tensor, or this rank's slice
                value = slice_from_full(value, entry.tp, slot.shape)
                if value is None:
                    raise ValueError(
                        f"load_state_dict: {present[0]!r} has shape "
                        f"{tuple(state_dict[present[0]].shape)} in the state dict but "
                        f"{tuple(entry.tp.full_shape)} in the model (this rank's "
                        f"tensor-parallel slice: {slot.shape})"
                    )
            if tuple(value.shape) != slot.shape:
                raise ValueError(
                    f"load_state_dict: {present[0]!r} has shape "
                    f"{tuple(value.shape)} in the state dict but {slot.shape} "
                    "in the model"
                )
            group.load_full(index, value.to(group.shard.dtype))
    return own


def full_named_grads(groups, prefix: str = "") -> dict[str, torch.Tensor]:
    """Gathered gradients of `groups` by parameter name (None-grads skipped). Collective."""
    out = {}
    for group in groups:
        grad = getattr(group.shard, "main_grad", None)
        grad = group.shard.grad if grad is None else grad
        if grad is None:
            continue
        full = torch.empty(group.layout.padded_numel, dtype=grad.dtype, device=group.shard.device)
        C.all_gather(full, grad.detach(), group=group.ranks.group, label=group.label + ".grad")
        for view, entry in zip(group.param_views(full), group.entries):
            out[prefix + entry.names[0]] = (
                view.clone() if entry.tp is None else full_from_slice(view, entry.tp)
            )
    return out
