"""Replicated parameters of a tensor-parallel model: whole or partial gradients over tp.

With tp_size > 1 a parameter that every tp rank holds whole (a layer norm written
by hand, a position embedding, a bias outside the parallel layers) gets, on each tp
rank, the gradient of the tokens that rank computed with it:

  * Megatron's layout (activations replicated between the parallel layers): every tp
    rank sees every token, the gradients agree, and their average over the ranks
    holding copies is the gradient;
  * the sequence-parallel layout (BMTrain's default: activations split along their
    first dimension between the parallel layers): each tp rank sees its slice of the
    tokens, so each gradient is partial and the gradient is their sum over tp.

Which one a parameter is in is declared where the layout is made (its Placement's
`tp_grad`): `nbtrain.parallelize` declares the replicated parameters of the model it
parallelizes by its `sequence_parallel`, nbtrain.nn.LayerNorm (which sums its own
gradient over tp) declares its own whole, and a model built from its own layers
declares its layout with `declare_tp_gradients(model, partial=...)`. The declaration
is checked once, at the parameter's first non-zero gradient: a gradient declared whole
that differs between the tp ranks (an op in a replicated region that depends on the
tp rank, or a sequence-parallel region declared as Megatron's) raises, as does one
declared partial that is the same on every tp rank; it is never summed or averaged
silently. An undeclared parameter (a BMTrain script, whose layers declare nothing) is
read from its gradients instead: at its first non-zero gradient the tp peers compare
fingerprints (a sum, a position-weighted sum and an
absolute sum per parameter, one all-gather over tp), and the verdict is made the same
on every rank of the reducing group (one max all-reduce). A partial gradient is
multiplied by tp_size before the usual average over the ranks holding copies: the
sum over tp, the mean over data parallel, exactly plain PyTorch's gradient. A layer
that sums its own gradient over tp (nbtrain.nn.LayerNorm) hands over gradients that
agree, so it is left whole. A trainable parameter whose gradient stays exactly zero
for `TRIES` passes is taken as whole (its gradient is zero either way); a frozen one
waits undecided until it trains.

Each owner that reduces replicated gradients (a Block's flat group, a
DistributedParameter, the data-parallel buckets) keeps one `TpLayout` per set of
parameters it reduces together; deciding costs two tiny collectives, on the first
backward passes only.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.collectives import CommKind
from ..comm.context import get_context
from .placement import live_group, placement_of

TRIES = 3
_RTOL = 1e-4  # fingerprints of gradients that agree differ by rounding at most

WHOLE, PARTIAL = False, True


def tp_size() -> int:
    return get_context().topology.tp_size


class TpLayout:
    """Whether each of `count` gradients is partial over tp (None: not known yet).

    Args:
        count: how many gradients the owner reduces together.
        group: the process group they are then averaged over (None: every rank;
            a `ShardGroup` or a kind's name, looked up at use); every rank of it
            decides together.
    """

    def __init__(self, count: int, group=None, params=None, names=None, fallback=None):
        """`params`: the `count` tensors whose placements declare the layout (read at
        the first backward, so a declaration made after the owner was built counts),
        `fallback` the one whose declaration holds for those undeclared (a Block's flat
        shard: what `module.parameters()` shows once wrapped); `names`: theirs, for
        the error that names one."""
        self._fallback = fallback
        self.partial: list[bool | None] = [None] * count
        self._group = group
        self._params = list(params) if params is not None else [None] * count
        self._names = list(names) if names is not None else [None] * count
        self.tries = [0] * count  # passes that found the gradient zero everywhere

    def apply(self, grads: list[torch.Tensor | None], active: list[bool] | None = None) -> bool:
        """Multiplies each partial gradient by tp_size, in place. Returns whether any
        was. `active`: which parameters train now (requires_grad, the same on every
        rank); a frozen one waits undecided until it trains. Collective over `group`
        while an active one is undecided (every rank calls it at the same point of
        backward, as the reduction that follows)."""
        size = tp_size()
        if size == 1:
            return False
        if any(p is None and (active is None or active[i]) for i, p in enumerate(self.partial)):
            self._decide(grads, active)
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

    def _decide(self, grads, active) -> None:
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
        # 2: partial somewhere, 1: whole, 0: zero everywhere; the largest verdict wins
        verdict = torch.where(differs, 2, torch.where(nonzero, 1, 0)).to(torch.float64)
        C.all_reduce(
            verdict,
            op="max",
            group=live_group(self._group),
            label="tp layout",
            kind=CommKind.TP_ALL_REDUCE,
        )
        for i, v in enumerate(verdict.tolist()):
            if self.partial[i] is not None or (active is not None and not active[i]):
                continue
            declared = placement_of(self._params[i]).tp_grad or placement_of(self._fallback).tp_grad
            if declared is not None and v:
                self._check(i, declared, v == 2)
                self.partial[i] = declared == "partial"
            elif v == 2:
                self.partial[i] = PARTIAL
            elif v == 1:
                self.partial[i] = WHOLE
            else:
                self.tries[i] += 1
                if self.tries[i] >= TRIES:
                    self.partial[i] = WHOLE

    def _check(self, i: int, declared: str, differs: bool) -> None:
        """Raises when the gradients contradict the declared layout (the same verdict
        on every rank of the group, so every rank raises)."""
        if differs == (declared == "partial"):
            return
        grad = self._params[i]
        name = self._names[i] or (
            f"a parameter of shape {tuple(grad.shape)}" if grad is not None else f"#{i}"
        )
        if differs:
            raise ValueError(
                f"the gradient of {name!r} differs between the tp ranks, but it is declared "
                "whole over tp (every tp rank sees every token): an op before it depends on "
                "the tp rank (a dropout seeded per rank, the rank in the arithmetic), which "
                "would make the replicas drift; or it sits where each tp rank sees its own "
                "tokens: declare that with nbtrain.zero.declare_tp_gradients(model, "
                "partial=True)"
            )
        raise ValueError(
            f"the gradient of {name!r} is the same on every tp rank, but it is declared "
            "partial over tp (each tp rank sees its own tokens), so summing it would "
            "count it tp_size times: declare it whole with "
            "nbtrain.zero.declare_tp_gradients(module, partial=False)"
        )
