"""Functions `Cluster.pull` runs inside the engines (sent by reference, so importable).

A sharded value comes back whole: `pull_kind` tells a DistributedParameter
("param") or a tensor of a model sharded by nbtrain ("state_dict") from a plain
value; `pull_full` gathers it on every rank (a collective) and returns rank 0's.
"""

from __future__ import annotations


def _user_ns() -> dict:
    from IPython import get_ipython

    return get_ipython().user_ns


def _resolve(name: str):
    """The value of `name` ("x", "model.layers.0.weight") in this engine's namespace."""
    root, *path = name.split(".")
    ns = _user_ns()
    if root not in ns:
        raise NameError(f"name {root!r} is not defined on this rank")
    value = ns[root]
    for part in path:
        if part.isdigit() and not hasattr(value, "_modules"):
            value = value[int(part)]
        else:
            value = getattr(value, part)
    return value


def _is_sharded(model) -> bool:
    from nbtrain.zero import Block, DistributedParameter

    return any(isinstance(m, Block) for m in model.modules()) or any(
        isinstance(p, DistributedParameter) for p in model.parameters()
    )


def pull_kind(name: str) -> str:
    """How to pull `name` here: "param", "state_dict", "plain" or "missing"."""
    root, _, rest = name.partition(".")
    if root not in _user_ns():
        return "missing"
    try:
        value = _resolve(name)
    except Exception:  # a parameter moved into a Block's flat buffer
        value = None
    import torch

    from nbtrain.zero import DistributedParameter

    if isinstance(value, DistributedParameter) and not value.in_block:
        return "param"  # (one a Block holds shows only its part: the block's state dict)
    model = _user_ns()[root]
    if (
        rest
        and isinstance(model, torch.nn.Module)
        and _is_sharded(model)
        and (value is None or isinstance(value, torch.Tensor))
    ):
        return "state_dict"
    return "plain"


def pull_full(name: str, kind: str):
    """The full tensor of a sharded `name` on rank 0 (None elsewhere). Collective."""
    import nbtrain

    if kind == "param":
        value = _resolve(name).gather_copy()
    else:
        module, key = _state_dict_owner(name)
        state = dict(module.state_dict())
        if key not in state:
            raise KeyError(
                f"{name!r}: no {key!r} in the state dict; keys are like "
                f"{', '.join(list(state)[:4])}"
            )
        value = state[key]
    return value.detach().cpu() if nbtrain.get_context().rank == 0 else None


def _state_dict_owner(name: str):
    """The deepest Block on `name`'s path (else the root model) and the key under it."""
    from nbtrain.zero import Block

    root, *path = name.split(".")
    owner, key = _user_ns()[root], ".".join(path)
    module = owner
    for i, part in enumerate(path):
        module = getattr(module, "_modules", {}).get(part)
        if module is None:
            break
        if isinstance(module, Block):
            owner, key = module, ".".join(path[i + 1 :])
    return owner, key


def pull_value(name: str):
    return _resolve(name)
