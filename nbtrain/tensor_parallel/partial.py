"""Replicated parameters of a tensor-parallel model: whole or partial gradients over tp.

With tp_size > 1 a parameter that every tp rank holds whole (a layer norm written
by hand, a position embedding, a bias outside the parallel layers) gets, on each tp
rank, the gradient of the tokens that rank computed with it:

  * Megatron's layout (activations replicated between the parallel layers): every tp
    rank sees every token, the gradients agree, and their average over the ranks
    holding copies is the gradient ("whole");
  * the sequence-parallel layout (BMTrain's default: activations split along their
    first dimension between the parallel layers): each tp rank sees its slice of the
    tokens, so each gradient is partial and the gradient is their sum over tp.

Which one a parameter is in is declared by what makes the layout, never guessed:

  * `nbtrain.parallelize` declares the replicated parameters of the model it
    parallelizes by its `sequence_parallel`;
  * a layer that sums its own gradient over tp (nbtrain.nn.LayerNorm) declares its
    own parameters whole;
  * a model built from its own layers (a BMTrain script) declares its layout with
    `nbtrain.declare_tp_gradients(model, partial=...)`;
  * a parameter nobody declared takes the layout the process's tensor-parallel layers
    make: partial while a live layer takes or hands on token slices
    (`ColumnParallelLinear(gather_input=True)`, `RowParallelLinear(
    all_reduce_output=False)`, `VPEmbedding(sequence_parallel=True)`,
    `LayerNorm(sequence_parallel=True)`: BMTrain's defaults, which need the tokens
    split between layers), whole when none does (their flags are read when the layout
    is first needed).

The declaration is checked once, at the parameter's first non-zero gradient, never
used to guess: the tp peers compare fingerprints (a sum, a position-weighted sum and
an absolute sum per parameter, one all-gather over tp), and a gradient declared
whole that differs between the tp ranks (an op in a replicated region that depends
on the tp rank, or a sequence-parallel region declared as Megatron's) raises on
every rank of the reducing group, as does one declared partial that is the same on
every tp rank. A partial gradient is multiplied by tp_size before the usual average
over the ranks holding copies: the sum over tp, the mean over data parallel, exactly
plain PyTorch's gradient. A gradient still exactly zero after `TRIES` passes is
left unchecked (its gradient is zero either way); a frozen one waits until it trains,
and one with an Inf or NaN (an overflowing step that a loss scaler skips) until a
pass where it is finite.

Each owner that reduces replicated gradients (a Block's flat group, a
DistributedParameter, the data-parallel buckets) keeps one `TpLayout` per set of
parameters it reduces together (`nbtrain.zero.placement.tp_layout_over` reads their
declarations); checking costs two tiny collectives, on the first backward passes only.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..comm import collectives as C
from ..comm.collectives import CommKind
from ..comm.context import get_context

TRIES = 3
_RTOL = 1e-4  # fingerprints of gradients that agree differ by rounding at most

# The live tensor-parallel layers, each saying by its flags whether it takes or hands
# on token slices (`splits_tokens()`), read when a layout is first needed.
_TP_LAYERS: weakref.WeakSet = weakref.WeakSet()


def tp_size() -> int:
    return get_context().topology.tp_size


def note_layer(layer) -> None:
    """Records a tensor-parallel layer (one with a `splits_tokens()` method): while it
    lives, its flags take part in `default_layout`."""
    _TP_LAYERS.add(layer)


def default_layout() -> str:
    """The layout of an undeclared replicated parameter: "partial" while a live
    tensor-parallel layer takes or hands on token slices, else "whole"."""
    return "partial" if any(layer.splits_tokens() for layer in list(_TP_LAYERS)) else "whole"


class TpLayout:
    """Whether each of `count` gradients is partial over tp, by declaration.

    Args:
        count: how many gradients the owner reduces together.
        group: returns the process group they are then averaged over (looked up at
            use: groups are made again after a failing cell); every rank of it checks
            together.
        declared: returns each gradient's declared layout ("partial", "whole" or None:
            undeclared, `default_layout()`), read at the first backward so that a
            declaration made after the owner was built counts.
        names: the parameters' names, for the error that names one.
    """

    def __init__(
        self,
        count: int,
        group: Callable[[], object],
        declared: Callable[[], list],
        names: list[str] | None = None,
    ):
        self.partial: list[bool | None] = [None] * count
        self._group, self._declared = group, declared
        self._names = list(names) if names is not None else [f"#{i}" for i in range(count)]
        self._why = [""] * count  # "declared" or the default's reason, for errors
        self._unchecked = [True] * count
        self.tries = [0] * count  # passes that found the gradient zero everywhere

    def apply(self, grads: list[torch.Tensor | None], active: list[bool] | None = None) -> bool:
        """Multiplies each partial gradient by tp_size, in place. Returns whether any
        was. `active`: which parameters train now (requires_grad, the same on every
        rank); a frozen one is checked once it trains. Collective over `group` while
        an active one is unchecked (every rank calls it at the same point of
        backward, as the reduction that follows)."""
        size = tp_size()
        if size == 1:
            return False
        if any(p is None for p in self.partial):
            self._read_declarations()
        if any(u and (active is None or active[i]) for i, u in enumerate(self._unchecked)):
            self._check_all(grads, active)
        scaled = False
        for grad, partial in zip(grads, self.partial):
            if partial and grad is not None:
                grad.mul_(size)
                scaled = True
        return scaled

    def any_partial_possible(self) -> bool:
        """Whether `apply` may scale something (callers copy a gradient they must not
        change in place only then)."""
        return tp_size() > 1 and any(p is not False for p in self.partial)

    def _read_declarations(self) -> None:
        default = default_layout()
        for i, declared in enumerate(self._declared()):
            if self.partial[i] is not None:
                continue
            if declared is None:
                declared = default
                self._why[i] = (
                    "by default, as a live tensor-parallel layer hands on token slices "
                    "(BMTrain's sequence-parallel layout)"
                    if default == "partial"
                    else "by default, as no tensor-parallel layer hands on token slices"
                )
            else:
                self._why[i] = "as declared"
            self.partial[i] = declared == "partial"

    def _check_all(self, grads, active) -> None:
        ctx = get_context()
        topo = ctx.topology
        prints = torch.zeros(len(grads), 3, dtype=torch.float64, device=ctx.device)
        with torch.no_grad():
            for i, grad in enumerate(grads):
                if grad is None:
                    continue
                flat = grad.detach().reshape(-1).to(ctx.device, torch.float64)
                weights = (
                    torch.arange(flat.numel(), device=flat.device, dtype=torch.float64)
                    .remainder_(1009)
                    .add_(1)
                )
                prints[i] = torch.stack([flat.sum(), (flat * weights).sum(), flat.abs().sum()])
        peers = torch.empty(topo.tp_size, *prints.shape, dtype=prints.dtype, device=prints.device)
        C.all_gather(
            peers.view(-1),
            prints.view(-1),
            group=topo.group("tp"),
            label="tp layout",
            kind=CommKind.TP_ALL_GATHER,
        )
        scale = peers.abs().amax(0).clamp_min(1e-30)
        differs = ((peers - peers[:1]).abs() > _RTOL * scale).any(0).any(-1)
        nonzero = peers[..., 2].amax(0) > 0
        finite = torch.isfinite(peers).all(0).all(-1)
        # 3: not finite somewhere (a step a loss scaler skips: look again next pass),
        # 2: differs somewhere, 1: the same, 0: zero everywhere; the largest verdict wins
        verdict = torch.where(differs, 2, torch.where(nonzero, 1, 0))
        verdict = torch.where(finite, verdict, 3).to(torch.float64)
        C.all_reduce(
            verdict, op="max", group=self._group(), label="tp layout", kind=CommKind.TP_ALL_REDUCE
        )
        for i, v in enumerate(verdict.tolist()):
            if not self._unchecked[i] or (active is not None and not active[i]):
                continue
            if v == 3:
                continue
            if v:
                self._unchecked[i] = False
                self._check(i, v == 2)
            else:
                self.tries[i] += 1
                self._unchecked[i] = self.tries[i] < TRIES

    def _check(self, i: int, differs: bool) -> None:
        """Raises when the gradients contradict the layout (the same verdict on every
        rank of the group, so every rank raises)."""
        if differs == self.partial[i]:
            return
        name, why = self._names[i], self._why[i]
        if differs:
            raise ValueError(
                f"the gradient of {name!r} differs between the tp ranks, but it is whole "
                f"over tp {why} (every tp rank sees every token): an op before it depends "
                "on the tp rank (a dropout seeded per rank, the rank in the arithmetic), "
                "which would make the replicas drift; or it sits where each tp rank sees "
                "its own tokens: declare that with nbtrain.declare_tp_gradients(model, "
                "partial=True)"
            )
        raise ValueError(
            f"the gradient of {name!r} is the same on every tp rank, but it is partial "
            f"over tp {why} (each tp rank sees its own tokens), so summing it would count "
            "it tp_size times: declare it whole with "
            "nbtrain.declare_tp_gradients(module, partial=False)"
        )
