"""`block._parameters["weight"]`: a Block's parameters under its module's names.

BMTrain's Block shares its module's `_parameters`, so code written for it reads a
parameter the block holds as `block._parameters[name]` and takes its `.grad`. An
nbtrain Block registers its flat shards instead (what `parameters()` and the
optimizers see). Its `_parameters` is this dict: it iterates as before, the shards
only, and a lookup of a name it does not hold answers the parameter of that name in
the wrapped module, as the module shows it outside forward: the user's
DistributedParameter, or the placeholder of a plain parameter (its `.grad` this
rank's part of the shard's gradient either way).
"""

from __future__ import annotations


class NamedMembers(dict):
    """The Block's own parameters (the flat shards), and by name the module's."""

    def __init__(self, own: dict, block) -> None:
        super().__init__(own)
        self._block = block

    def __missing__(self, name: str):
        for group in getattr(self._block, "_groups", ()):
            for entry in group.entries:
                if name in entry.names and entry.rest is not None:
                    return entry.rest
        raise KeyError(name)
