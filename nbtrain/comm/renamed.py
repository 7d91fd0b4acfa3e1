"""Old spellings of renamed keywords and flags: they keep working for one release.

    @renamed_kwargs(tp="tp_size")
    def build(tp_size=1): ...
    build(tp=2)   # works, with a FutureWarning: "build(tp=...) is deprecated; use tp_size="

    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp", dest="tp_size", type=int, action=RenamedFlag, new="--tp-size")

FutureWarning, not DeprecationWarning: Python shows it by default, so a user running a
notebook or a script sees it. The table of names is docs/naming.md. This module lives
in the lowest layer so that every layer (configs, checkpoints, the notebook, the
commands) can use it; it imports nothing of nbtrain.
"""

from __future__ import annotations

import argparse
import functools
import os
import warnings


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """A FutureWarning: `old` still works for one release; `new` is the name to use."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        FutureWarning,
        stacklevel=stacklevel,
    )


def renamed_kwargs(**renames: str):
    """Decorator for a function or a class (its `__init__`): each old keyword in
    `renames` (old="new") is passed on as the new one, with a FutureWarning.

    Giving both spellings is a TypeError naming them."""

    def wrap(obj):
        target = obj.__init__ if isinstance(obj, type) else obj
        owner = obj.__name__

        @functools.wraps(target)
        def inner(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{owner}() got both {old}= and {new}=: "
                            f"{old} is the old name of {new}; pass only {new}="
                        )
                    warn_renamed(f"{owner}({old}=...)", f"{new}=")
                    kwargs[new] = kwargs.pop(old)
            return target(*args, **kwargs)

        if isinstance(obj, type):
            obj.__init__ = inner
            return obj
        return inner

    return wrap


def model_first(func: str, model, path):
    """`(model, path)`, BMTrain's order of `save`/`load`, for a function that took
    `(path, model)` before: that old order (a str or PathLike first, a model second)
    still works, swapped, with a FutureWarning."""
    if isinstance(model, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        warn_renamed(
            f"{func}(path, model)",
            f"{func}(model, path), the order of nbtrain.save and BMTrain's bmt.save",
            stacklevel=4,
        )
        return path, model
    return model, path


class RenamedFlag(argparse.Action):
    """An old command-line flag: stores into the new flag's `dest` and warns.

    Add it beside the new flag, hidden from the help:
    `add_argument("--tp", dest="tp_size", type=int, action=RenamedFlag, new="--tp-size")`.
    """

    def __init__(self, option_strings, dest, new: str, **kwargs):
        kwargs.setdefault("help", argparse.SUPPRESS)
        kwargs.setdefault("default", argparse.SUPPRESS)  # the new flag's default stands
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        warn_renamed(f"the flag {option_string}", self.new, stacklevel=2)
        setattr(namespace, self.dest, values)
