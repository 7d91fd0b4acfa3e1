"""What a Block takes from its module: each distinct parameter once, with every name it
has (tied parameters) and every (module, attribute) that holds it."""

from __future__ import annotations

from torch import nn

from .parameter import DistributedParameter
from .placement import is_slice, placement_of


class ParamEntry:
    """One distinct parameter: its names (ties) and the modules that use it."""

    def __init__(self, name, param):
        self.names = [name]
        self.owners = []  # (module, attribute name)
        self.param = param
        # A DistributedParameter stays the user's object after the block takes its
        # values: its `.data` becomes this rank's part of it in the block's shard,
        # `.grad` the same part of the shard's gradient (BMTrain's layout).
        self.member = param if isinstance(param, DistributedParameter) else None
        self.rest = None  # what the owners' attribute shows outside forward
        # A slice's placement (its split dimension and full shape), else None.
        self.tp = placement_of(param) if is_slice(param) else None


def collect_entries(module: nn.Module) -> list[ParamEntry]:
    """The distinct parameters of `module`, each with every name and owner it has."""
    entries: dict[int, ParamEntry] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for pname, param in mod._parameters.items():
            if param is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            entry = entries.get(id(param))
            if entry is None:
                entry = entries[id(param)] = ParamEntry(full, param)
            elif full not in entry.names:
                entry.names.append(full)
            if (mod, pname) not in [(m, n) for m, n in entry.owners]:
                entry.owners.append((mod, pname))
    return list(entries.values())
