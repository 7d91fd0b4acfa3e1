"""`detect_nonfinite`: the first module, rank, step and direction where a NaN or an Inf
appears.

    with nbtrain.debug.detect_nonfinite(model) as watch:
        for batch in batches:
            loss_fn(model(x), y).backward()
            optimizer.step()        # an OptimManager advances watch's step itself
            watch.step()            # a plain torch optimizer: advance it here
    print(watch.report())           # collective: the first origin over all ranks

When on, a forward hook on every module checks `torch.isfinite(output).all()` and a full
backward hook checks the gradients with respect to the module's inputs; the first
module of a step (forward before backward, in execution order) with a non-finite value
is this rank's origin for that step. Modules run before it held only finite values, so
it is where the NaN or Inf was made. A module whose inputs take no gradient (an
embedding fed token ids) is checked in forward only.

Each origin is published as a `nonfinite` event (module, direction, rank, step) and as
the metric `nonfinite=1` at its step, which the dashboard's loss panel marks with a
red line. Cost: one `isfinite` reduction per module output and input gradient (and a
device sync each) when on; with `enabled=False` no hook is installed at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import events
from ..comm.context import get_context
from .locate import _in_backward

DIRECTION_ORDER = {"forward": 0, "backward": 1}


@dataclass(frozen=True)
class NonFiniteOrigin:
    """Where a non-finite value first appeared.

    Attributes:
        step: the training step, counted from the detector's start (0: the first step
            it watched), however many steps the process trained before.
        module: the module's name in `model.named_modules()` ("" is the model itself).
        rank: the global rank that made it.
        direction: "forward" (the module's output) or "backward" (the gradient with
            respect to its inputs).
        index: the module's position among this step's checks of that direction on
            that rank (ranks running the same modules compare by it).
    """

    step: int
    module: str
    rank: int
    direction: str
    index: int

    def __str__(self) -> str:
        return (
            f"first non-finite value: step {self.step}, rank {self.rank}, {self.direction} "
            f"of module {self.module or '<model>'!r}"
        )


def _finite(values) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in values if t is not None)


def _tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out] if out.is_floating_point() or out.is_complex() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class NonFiniteDetector:
    """The switch `detect_nonfinite` returns; see the module docstring.

    Attributes:
        origins: this rank's first origin of each step, in step order (local).
        current_step: the step being run.
        enabled: whether hooks are installed.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model, self.enabled = model, bool(enabled)
        self.origins: list[NonFiniteOrigin] = []
        self.current_step = 0  # from this watch's start, not the process's first step
        # The events carry the process's step, the one the dashboard's loss axis shows.
        self._first_step = events.HUB.step
        self._handles: list = []
        self._counts = {"forward": 0, "backward": 0}
        self._seen_step: int | None = None
        if self.enabled:
            self._install()
            events.on_step_end(self._on_step_end)

    def _install(self) -> None:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))

    def _forward_hook(self, name):
        def hook(module, args, out):
            if _in_backward():  # activation checkpointing's recompute: checked already
                return
            self._check(name, "forward", _tensors(out))

        return hook

    def _backward_hook(self, name):
        def hook(module, grad_input, grad_output):
            self._check(name, "backward", grad_input)

        return hook

    def _check(self, name: str, direction: str, values) -> None:
        index = self._counts[direction]
        self._counts[direction] += 1
        if self._seen_step == self.current_step or _finite(values):
            return
        self._seen_step = self.current_step
        rank = get_context().rank
        origin = NonFiniteOrigin(self.current_step, name, rank, direction, index)
        self.origins.append(origin)
        events.publish(
            {
                "type": "nonfinite",
                "t": time.perf_counter(),
                "label": name,
                "direction": direction,
                "rank": rank,
                "step": self._first_step + origin.step,
            }
        )
        events.publish(
            {
                "type": "metric",
                "t": time.perf_counter(),
                "nonfinite": 1.0,
                "step": self._first_step + origin.step,
            }
        )

    def _on_step_end(self) -> None:
        if self._handles:
            self.step()

    def step(self) -> int:
        """Closes the current step (call it after each optimizer step when no
        OptimManager steps: OptimManager.step advances the counter itself). Local."""
        self.current_step += 1
        self._counts = {"forward": 0, "backward": 0}
        return self.current_step

    def report(self, group=None) -> NonFiniteOrigin | None:
        """The first origin over every rank: the earliest step, forward before backward,
        then the module that ran first, then the lowest rank; None when every value
        stayed finite. Collective: every rank of `group` (default: the world) calls it."""
        everyone = C.all_gather_object(self.origins[:1], group=group)
        found = [o for origins in everyone for o in origins]
        if not found:
            return None
        return min(found, key=lambda o: (o.step, DIRECTION_ORDER[o.direction], o.index, o.rank))

    def remove(self) -> None:
        """Removes every hook (the detector then reports what it saw). Local."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> NonFiniteDetector:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def detect_nonfinite(model: nn.Module, enabled: bool = True) -> NonFiniteDetector:
    """Watches `model` for the first NaN or Inf of each step (see the module docstring).

    Args:
        model: any module, plain or sharded; every submodule is watched.
        enabled: False installs nothing (no hook, no cost) and the detector reports
            None, so a script can keep the call and flip the switch.

    Returns a NonFiniteDetector, usable as a context manager (hooks removed on exit).
    Local; `report()` is collective.
    """
    return NonFiniteDetector(model, enabled)
