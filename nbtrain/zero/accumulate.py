"""Several micro-batches, one reduction: what a pipeline stage does within a step.

    with micro_batches(stage):
        for each micro-batch: forward, backward

Inside, every Block of `stage` keeps its parameters gathered after the first
micro-batch gathered them (ZeRO-3 gathers once per step, not twice per micro-batch),
and adds its full gradients up locally instead of reduce-scattering them after each
backward. Leaving the block reduces each flat group's sum once (the same average
over the data-parallel ranks as one reduction per micro-batch gives) and frees the
gathered parameters. The cost is memory: the stage's full parameters and full
gradients stay allocated for the whole schedule.

On an error nothing is reduced (a peer may have failed; the notebook's recovery
aborts the group) and the sums are dropped: the failed step contributes no gradient.
"""

from __future__ import annotations

import contextlib

from torch import nn

from .flat import FlatGroup


def _groups(modules) -> list[FlatGroup]:
    from .block import Block

    found, seen = [], set()
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, Block):
                for group in sub.groups:
                    if id(group) not in seen:
                        seen.add(id(group))
                        found.append(group)
    return found


@contextlib.contextmanager
def micro_batches(*modules: nn.Module):
    """Gather once and reduce once across the backward passes run inside.

    Collective on leaving: every rank sharing the Blocks' shards leaves it together.
    """
    groups = [g for g in _groups(modules) if not g.hold]  # an outer block keeps its own
    for group in groups:
        group.hold = True
    ok = False
    try:
        yield
        ok = True
    finally:
        for group in groups:
            group.hold = False
        try:
            if ok:
                for group in groups:  # module order: the same on every rank
                    group.flush_deferred()
        finally:
            for group in groups:
                group.deferred = None
                group.release()
