"""BMTrain's `BMTrainModelWrapper(model)` and `grouped_parameters(model)`.

    model = nbtrain.BMTrainModelWrapper(PlainModel())   # model(x) as before
    opt = torch.optim.AdamW(model.parameters())         # steps this rank's shards

BMTrain's wrapper makes every parameter a DistributedParameter and every entry of
every nn.ModuleList a Block (neighbours linked for prefetching). Here it is
`nbtrain.wrap` with BMTrain's defaults and reach:

- a ModuleList whose every entry has parameters becomes a TransformerBlockList of
  Blocks (an nn.ModuleList: indexing and the model's own loop work as before);
- a ModuleList with some parameter-free entries (an activation between layers) keeps
  its type: each entry with parameters becomes a Block in place, neighbouring
  Blocks linked; the others stay as they are (a Block of nothing shards nothing);
- the model itself may be a ModuleList;
- every other parameter becomes a DistributedParameter, gathered for the forward of
  the module that owns it; buffers move to the context's device.

Names do not change: `state_dict()` holds full tensors under the plain model's names,
and `load_state_dict` takes them. Blocks default to BMTrain's ZeRO-3 with activation
checkpointing (`use_checkpoint=True`); the results equal the plain model's either
way. Lists nested inside a list's entry stay inside that entry's Block (BMTrain
nests Blocks). Unlike BMTrain, the model keeps its class (BMTrain swaps in a subclass
of it and DistributedModule).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..comm.context import get_context
from .block import Block, ZeroLevel
from .wrap import _layer_lists, wrap


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _under(name: str, prefixes) -> bool:
    return any(p == "" or name.startswith(p + ".") for p in prefixes)


def _partial_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Outermost ModuleLists that `wrap` leaves alone but BMTrain turns into Blocks:
    the model itself if it is one, and lists with some parameter-free entries."""
    skip = [name for name, _ in _layer_lists(model)]  # wrap makes these block lists
    out = []
    for name, module in model.named_modules():
        if _under(name, skip):
            continue
        if isinstance(module, Block):
            skip.append(name)  # sharded by hand already, with what it holds
            continue
        if not isinstance(module, nn.ModuleList) or name in skip or not len(module):
            continue
        if any(isinstance(m, Block) for m in module):
            skip.append(name)
            continue
        if any(_has_params(m) for m in module):
            skip.append(name)
            out.append((name, module))
    return out


def _check_no_ties(model: nn.Module, lists) -> None:
    """A parameter used by two entries of a list, or by an entry and the rest of the
    model, cannot live in one Block's flat buffer: refuse, naming both uses."""
    entries = [f"{name}.{i}" if name else str(i) for name, ml in lists for i in range(len(ml))]
    where: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        place = next((e for e in entries if pname.startswith(e + ".")), "the model outside")
        first = where.setdefault(id(p), f"{pname}@{place}")
        if first.rpartition("@")[2] != place:
            raise ValueError(
                f"parameter {pname!r} is tied to {first.rpartition('@')[0]!r}, "
                "in another layer of a list; untie them or wrap that list by "
                "hand"
            )


def _blocks_in_place(name: str, ml: nn.ModuleList, level: ZeroLevel, use_checkpoint: bool) -> None:
    prev = None
    for i, entry in enumerate(ml):
        if _has_params(entry) and not isinstance(entry, Block):
            entry = ml[i] = Block(
                entry, level, use_checkpoint, label=f"{name}.{i}" if name else str(i)
            )
        if isinstance(entry, Block):
            if prev is not None:  # neighbours prefetch each other, as in a block list
                object.__setattr__(prev, "_next_block", entry)
                object.__setattr__(entry, "_prev_block", prev)
            prev = entry


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)


def BMTrainModelWrapper(
    model: nn.Module, zero_level: int = 3, use_checkpoint: bool = True
) -> nn.Module:
    """Shards a plain model in place as BMTrain's wrapper does, and returns it.

    Args:
        model: any torch model; its forward is not changed.
        zero_level: 2 or 3 for every Block (BMTrain's wrapper: 3).
        use_checkpoint: recompute each Block's activations in backward (BMTrain's
            wrapper: True).

    Collective: every rank calls this on an identical model.
    """
    level = ZeroLevel.parse(zero_level)
    _move_buffers(model, get_context().device)
    lists = _partial_lists(model)
    _check_no_ties(model, lists)
    for name, ml in lists:
        _blocks_in_place(name, ml, level, use_checkpoint)
    return wrap(model, zero_level=level, use_checkpoint=use_checkpoint)


def grouped_parameters(model: nn.Module) -> Iterator[tuple[str | None, list[nn.Parameter]]]:
    """(group, parameters) pairs covering what `model.parameters()` yields, each
    parameter once: BMTrain's grouping by a parameter's `group` attribute (None for
    a parameter without one, which in nbtrain is every parameter unless a user set
    it). A Block contributes its flat shards, the parameters an optimizer steps.

        param_groups = [{"params": ps} for _, ps in nbtrain.grouped_parameters(model)]

    Local.
    """
    groups: dict[str | None, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for param in module._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            groups.setdefault(getattr(param, "group", None), []).append(param)
    yield from groups.items()


__all__ = ["BMTrainModelWrapper", "grouped_parameters"]
