"""Which ranks a magic or a Cluster call means: "0,2", "0:2", "::2", "1:", "-1"."""

from __future__ import annotations


def select_ranks(targets, world: int) -> list[int]:
    """Normalise targets to a sorted list of ranks.

    Args:
        targets: None (every rank), an int, a slice, a list of ints, or a
            string of comma-separated ranks and slices: "0,2", "0:2", "::2",
            "1:", "-1" (the last rank). Negative ranks count from the end.
        world: the number of ranks.

    Raises:
        ValueError: a value is not a rank, is out of range, or selects nothing;
            the message names it and the valid range.
    """
    if targets is None:
        return list(range(world))
    if isinstance(targets, str):
        parts = [p for p in targets.replace(" ", "").split(",") if p]
        ranks = [r for part in parts for r in _parse_target(part, world)]
    elif isinstance(targets, slice):
        ranks = list(range(world)[targets])
    elif isinstance(targets, int):
        ranks = [_check_rank(targets, world)]
    else:
        ranks = [_check_rank(t, world) for t in targets]
    if not ranks:
        raise ValueError(f"targets {targets!r} select no rank: {_valid_ranks(world)}")
    return sorted(set(ranks))


def one_rank(targets) -> bool:
    """True when `targets` names one rank (an int, or a string such as "1" or "-1")."""
    if isinstance(targets, str):
        return targets.strip().lstrip("-").isdigit()
    return isinstance(targets, int)


def _valid_ranks(world: int) -> str:
    return (
        f"ranks are 0..{world - 1} (-1 is the last); use a rank, a list (0,2) "
        "or a slice (0:2, ::2, 1:)"
    )


def _check_rank(rank, world: int) -> int:
    """`rank` as a rank in 0..world-1 (negative counts from the end), else ValueError."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"target {rank!r} is not a rank: {_valid_ranks(world)}")
    if not -world <= rank < world:
        raise ValueError(f"target {rank} is out of range: {_valid_ranks(world)}")
    return rank % world


def _parse_target(part: str, world: int) -> list[int]:
    """One comma-separated part of a targets string: "2", "-1", "0:2", "::2"."""
    try:
        if ":" not in part:
            return [_check_rank(int(part), world)]
        bounds = part.split(":")
        if len(bounds) > 3:
            raise ValueError(part)
        return list(range(world)[slice(*(int(b) if b else None for b in bounds))])
    except ValueError as err:
        if "out of range" in str(err):
            raise
        raise ValueError(
            f"target {part!r} is not a rank or a slice: {_valid_ranks(world)}"
        ) from None
