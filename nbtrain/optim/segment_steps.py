"""Adam step counts per parameter of a flat shard, once one of them was frozen.

A Block's flat shard is one tensor to an optimizer, yet each parameter in it may be
frozen for some steps (nbtrain/zero/freeze.py). torch's Adam counts steps per
parameter, and its bias correction uses that count; so does nbtrain's AdamOptimizer
for the parameters inside a shard: while no parameter of the shard was ever frozen
it keeps one count (`state["step"]`, the fast path); from the first step that leaves
one out (on any rank: every rank's state has the same keys) it also keeps
`state["segment_step"]`, an int32 tensor the shape of the shard (host memory, 4 bytes
per element) holding each element's parameter's count. Being the shard's shape it is
saved, loaded and resharded element by element like the moments (save_checkpoint at
another world size included). A state saved with one count loads as the fast path.
Local: no communication.
"""

from __future__ import annotations

import torch

from ..zero import frozen_spans, partly_frozen, segment_spans

SEGMENT_STEP = "segment_step"


def step_pieces(param: torch.Tensor, state: dict) -> list[tuple[int | None, int | None, int]]:
    """The parts of `param` this step updates, as (lo, hi, steps taken before), and
    advances their counts (not `state["step"]`, the caller's). (None, None, step):
    the whole parameter on one count. Frozen parameters' elements are left out and
    keep their counts. Local."""
    counts = state.get(SEGMENT_STEP)
    # Decided per group, not per rank's elements, so every rank's state has the same keys.
    if counts is None and not partly_frozen(param):
        return [(None, None, state["step"])]
    frozen = set(frozen_spans(param))
    if counts is None:
        counts = torch.full((param.numel(),), int(state["step"]), dtype=torch.int32)
        state[SEGMENT_STEP] = counts = counts.view(param.shape)
    if counts.shape != param.shape:
        raise ValueError(
            f"AdamOptimizer: {SEGMENT_STEP} has shape {tuple(counts.shape)}, the parameter "
            f"{tuple(param.shape)}: load the state saved for this parameter"
        )
    flat = counts.view(-1)
    pieces, at = [], 0
    segments = sorted(segment_spans(param))
    firsts = flat[[lo for lo, _ in segments]].tolist() if segments else []
    for (lo, hi), before in zip(segments, firsts):
        if lo > at:  # elements of no parameter (padding): the shard's count
            pieces.append((at, lo, state["step"]))
        at = hi
        if (lo, hi) not in frozen:
            pieces.append((lo, hi, before))
    if at < flat.numel():
        pieces.append((at, flat.numel(), state["step"]))
    merged = []
    for lo, hi, before in pieces:
        flat[lo:hi] = before + 1
        if merged and merged[-1][1] == lo and merged[-1][2] == before:
            merged[-1] = (merged[-1][0], hi, before)
        else:
            merged.append((lo, hi, before))
    return merged
