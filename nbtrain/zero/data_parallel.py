"""Data-parallel gradients for the plain parameters of a DistributedModule.

A BMTrain-style model often keeps its embedding, final norm and head as plain
`nn.Embedding` / `nn.LayerNorm` / `nn.Linear` outside its Blocks. Every rank holds
them whole, so their gradients must be averaged over ranks exactly as DDP does,
or each rank steps on its own gradient and the replicas drift apart silently.

`DataParallelGrads` does it DDP's way:
  * parameters are packed into buckets of at most `bucket_numel` elements, in
    reverse order of registration (backward reaches the head first);
  * a hook after each parameter's gradient is accumulated marks it ready; a full
    bucket is all-reduced asynchronously through the model's `GradReducer`, so it
    overlaps the rest of backward. Buckets are issued strictly in index order on
    every rank, so ranks whose graphs finish parameters in another order still
    agree on the order of collectives;
  * when backward ends, buckets not yet issued (parameters without a gradient on
    this rank) are issued. Each bucket carries one count per parameter of the
    ranks that had a gradient: a parameter no rank used keeps `grad = None`, as in
    plain PyTorch, and one used on some ranks only gets the average over all.

Gradient accumulation over several backward passes reduces the accumulated
gradient each time: the mean of (already averaged + new local) is the already
averaged part plus the mean of the new part, so the result is exact.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.context import get_context
from ..comm.topology import ALONE
from .placement import is_slice, live_group, place, tp_layout_over
from .reducer import GradReducer, current_backward

BUCKET_NUMEL = 1 << 22  # 16 MiB of fp32 per bucket, near DDP's 25 MB default
_CHECK_CHUNK_NUMEL = 1 << 20  # the replica check's fp64 temporaries: 16 MiB at most


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        self.numel = sum(p.numel() for p in params)
        self.ready: set[int] = set()

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class DataParallelGrads:
    """Averages gradients of replicated parameters over the ranks (bucketed, async).

    Args:
        params: the trainable parameters that every rank holds whole.
        reducer: the model's reduction queue.
        bucket_numel: most elements per bucket.
        group: the ranks holding copies (None: every rank; a tensor-parallel slice is
            held by its data-parallel group): a group, or the name of its kind in the
            topology ("zero", "dp"), looked up at each use.
        replicated: the parameters are held whole by the tp ranks too (False for
            tensor-parallel slices): a gradient partial over tp is summed there.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        reducer: GradReducer,
        bucket_numel: int = BUCKET_NUMEL,
        group=None,
        replicated: bool = True,
    ):
        self.reducer, self._group = reducer, group
        self.buckets = _make_buckets(params, bucket_numel)
        # Held whole by the tp ranks too: which gradients are partial over tp, per bucket
        # (nbtrain.tensor_parallel.partial). Slices of a tp layer are never partial.
        for bucket in self.buckets:
            bucket.tp_layout = (
                tp_layout_over(bucket.params, group)  # group: a kind
                if replicated
                and get_context().topology.tp_size > 1
                and not any(is_slice(p) for p in bucket.params)
                else None
            )
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self._backward_id: int | None = None  # the pass these buckets are filling for
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets
            for p in b.params
        ]
        for b in self.buckets:
            for p in b.params:
                place(p, owner="dp")  # its gradient has an owner (shards.has_grad_owner)

    @property
    def group(self):
        """The process group averaged over, looked up at each use (`group` may name a
        kind of the topology's groups): after a failing cell the groups are made again."""
        return live_group(self._group)

    def remove(self) -> None:
        """Detaches the gradient hooks (the parameters get a new owner)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for b in self.buckets:
            for p in b.params:
                place(p, owner=None)

    # -- backward ---------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        backward_id = current_backward()
        if backward_id != self._backward_id:
            self._reset()  # a pass that died half way left buckets part filled
            self._backward_id = backward_id
            self.reducer.at_end(self._flush)
        self._bucket_of[id(param)].ready.add(id(param))
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._issue(self.buckets[self._next])

    def _flush(self) -> None:
        while self._next < len(self.buckets):
            self._issue(self.buckets[self._next])
        self._reset()

    def _reset(self) -> None:
        self._next, self._backward_id = 0, None
        for bucket in self.buckets:
            bucket.ready.clear()

    def _issue(self, bucket: _Bucket) -> None:
        self._next = bucket.index + 1
        ref = bucket.params[0]
        # Layout: every parameter's gradient back to back, then one count each.
        flat = torch.zeros(bucket.numel + len(bucket.params), dtype=ref.dtype, device=ref.device)
        offset = 0
        for i, p in enumerate(bucket.params):
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                flat[bucket.numel + i] = 1
            offset += p.numel()
        if bucket.tp_layout is not None:  # sequence parallel: a sum over tp
            views, offset = [], 0
            for p in bucket.params:
                views.append(flat[offset : offset + p.numel()] if p.grad is not None else None)
                offset += p.numel()
            bucket.tp_layout.apply(views, [p.requires_grad for p in bucket.params])
        handle = C.all_reduce(
            flat, op="sum", group=self.group, async_op=True, label=f"dp.bucket{bucket.index}"
        )
        world = (
            get_context().world_size
            if self.group is None
            else torch.distributed.get_world_size(self.group)
        )

        def finish():
            grads = flat[: bucket.numel].div_(world)
            counts = flat[bucket.numel :].tolist()
            start = 0
            for p, count in zip(bucket.params, counts):
                value = grads[start : start + p.numel()].view_as(p)
                start += p.numel()
                if count == 0:
                    continue  # no rank produced a gradient: leave None, as torch does
                if p.grad is None:
                    p.grad = value
                else:
                    p.grad.copy_(value)

        self.reducer.add(handle, finish)


def _make_buckets(params: list[nn.Parameter], bucket_numel: int) -> list[_Bucket]:
    buckets, current, numel, key = [], [], 0, None
    for p in reversed(params):
        p_key = (p.dtype, p.device)
        if current and (p_key != key or numel + p.numel() > bucket_numel):
            buckets.append(_Bucket(len(buckets), current))
            current, numel = [], 0
        current.append(p)
        numel += p.numel()
        key = p_key
    if current:
        buckets.append(_Bucket(len(buckets), current))
    return buckets


def check_replicas_equal(named_params: list[tuple[str, torch.Tensor]], group=None) -> None:
    """Raises if any parameter's value differs between ranks, naming the first one.

    Compares per-parameter fingerprints (sum and a position-weighted sum, in fp64,
    taken in chunks so no full-size fp64 copy is made) with one max and one min
    all-reduce: bytes independent of the model's size.

    Collective: every rank of `group` (None: the world) calls this with the same
    names in the same order.
    """
    if not named_params or group is ALONE:
        return
    ctx = get_context()
    prints = torch.zeros(len(named_params), 2, dtype=torch.float64, device=ctx.device)
    with torch.no_grad():
        for i, (_, p) in enumerate(named_params):
            flat = p.detach().reshape(-1)
            for start in range(0, flat.numel(), _CHECK_CHUNK_NUMEL):
                chunk = flat[start : start + _CHECK_CHUNK_NUMEL].to(torch.float64)
                weights = (
                    torch.arange(
                        start, start + chunk.numel(), device=chunk.device, dtype=torch.float64
                    )
                    .remainder_(1009)
                    .add_(1)
                )
                prints[i, 0] += chunk.sum()
                prints[i, 1] += (chunk * weights).sum()
    high, low = prints.clone(), prints.clone()
    C.all_reduce(high, op="max", group=group, label="dp.check")
    C.all_reduce(low, op="min", group=group, label="dp.check")
    differ = (high != low).any(dim=1).nonzero().flatten().tolist()
    if differ:
        names = [named_params[i][0] for i in differ]
        raise ValueError(
            f"parameter {names[0]!r} has different values on different ranks "
            f"({len(names)} differ: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}). "
            "Plain parameters of a DistributedModule are replicated: build the model after "
            "nbtrain.init_distributed(seed=...) on every rank with the same seed, or load the "
            "same weights everywhere."
        )
