"""FlatGroup: parameters of one dtype stored as one flat buffer, sharded over ranks.

A group owns:
  * `shard`, this rank's contiguous slice of the flat buffer: an ordinary
    `nn.Parameter`, so any torch optimizer can update it;
  * `full`, the gathered flat buffer. When released its storage is resized to
    zero bytes (FSDP2's trick): views of it that autograd saved stay valid
    objects and see the data again once the storage is re-grown and re-gathered.

Gradients: the `_GatherFlat` autograd function turns the shard into the full
buffer in forward; in backward it reduce-scatters (average, DDP semantics) the
full gradient asynchronously through the model's `GradReducer` and returns
nothing. The result is added into `shard.grad` when the collective completes: at
the latest when the next reduction is issued or when the backward pass ends.

The ranks sharing the shards are a `ShardGroup`: the world for replicated
parameters, the data-parallel group for tensor-parallel slices (placement.py).

A group publishes `gather` and `release` events (with its label), so how many
blocks are gathered at once can be read from the event stream.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import events
from .freeze import SlotGrads, shard_grad
from .partition import FlatLayout
from .placement import ShardGroup, place
from .reducer import GradReducer


def _restore_version(tensor: torch.Tensor, version: int) -> None:
    # Refilling `full` restores data that autograd saved views of; it is not a
    # change those views must be protected from. The backend may write the
    # output after issue (gloo copies on its own thread), so the counter is
    # restored after the wait, to its value from before the issue.
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


class FlatGroup:
    """One flat, sharded buffer for parameters that share dtype and requires_grad."""

    def __init__(
        self,
        layout: FlatLayout,
        full_values: list[torch.Tensor],
        *,
        ranks: ShardGroup,
        device: torch.device,
        dtype: torch.dtype,
        requires_grad: bool,
        label: str,
        reducer: GradReducer,
        grad_dtype: torch.dtype | None = None,
        offload: bool = False,
    ):
        if layout.world_size != ranks.size:
            raise ValueError(f"layout for {layout.world_size} ranks, group of {ranks.size}")
        self.layout, self.label, self.reducer = layout, label, reducer
        self.ranks, self.rank = ranks, ranks.rank
        self.grad_dtype = grad_dtype or dtype
        begin, end = layout.shard_range(ranks.rank)
        # Offloaded: the shard (and so its gradient and the optimizer's state) lives in
        # host memory, pinned for asynchronous copies on CUDA; each gather first copies
        # it to the device (at prefetch time, so the copy overlaps like the gather).
        self.device, self.offload = torch.device(device), bool(offload)
        home = torch.device("cpu") if self.offload else self.device
        local = torch.zeros(
            layout.shard_numel,
            dtype=dtype,
            device=home,
            pin_memory=self.offload and self.device.type == "cuda",
        )
        for slot, value in zip(layout.slots, full_values):
            if value.is_meta:  # built on the meta device: zeros until loaded
                continue
            part = slot.local_part(begin, end)
            if part is not None:
                lo, hi = part
                local[lo - begin : hi - begin].copy_(
                    value.detach().reshape(-1)[lo - slot.offset : hi - slot.offset]
                )
        self.shard = nn.Parameter(local, requires_grad=requires_grad)
        # Each element on one rank (norms sum over ranks); its frozen spans and segments
        # are read through the record (freeze.py).
        place(self.shard, owner="flat", flat=self)
        self.synced_requires_grad = requires_grad  # the owning Block's (members.sync_requires_grad)
        # Which parameters train (set by the owning Block at each forward) and which
        # hold a gradient in the shard's (freeze.py): an optimizer skips the others.
        self.trainable = [requires_grad] * len(layout.slots)
        self.slot_grads = SlotGrads(len(layout.slots))
        # A group of one rank (world 1, or this rank alone) holds the whole buffer in
        # its shard: `full` is the shard itself, and gathering, releasing and reducing
        # copy nothing. Not when offloaded: then the shard lives on the host.
        self.alias = ranks.size == 1 and not self.offload
        if self.alias:
            self.full = self.shard.detach()
            self._full_nbytes = 0
        else:
            self.full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
            self._full_nbytes = self.full.untyped_storage().nbytes()
            self.full.untyped_storage().resize_(0)
        self.gathered = self.alias
        self._handle = self._staged = None
        self._generation = C.generation()  # of the groups the last gather ran on
        # Across the micro-batches of a pipeline step (`zero.accumulate.micro_batches`):
        # stay gathered, and add the full gradients up here, reduced once at the end.
        self.hold = False
        self.deferred: torch.Tensor | None = None
        self._deferred_trainable = None
        # Replicated parameters of a tensor-parallel model: which gradients are partial
        # over tp (summed there, tensor_parallel.partial). Set by the owning Block; None: no tp.
        self.tp_layout = None

    @property
    def requires_grad(self) -> bool:
        """Whether the shard trains: `requires_grad_` on it between steps is honoured."""
        return self.shard.requires_grad

    # -- gather / release -------------------------------------------------
    def start_gather(self) -> None:
        """Issue the all-gather (async) unless already gathered or in flight.

        Collective: every rank calls this for the same group in the same order.
        """
        self._forget_stale()
        if self.alias or self._handle is not None or self._fresh():
            return
        storage = self.full.untyped_storage()
        if storage.nbytes() != self._full_nbytes:
            storage.resize_(self._full_nbytes)
        self._version = self.full._version
        self._shard_version = self.shard._version
        self._generation = C.generation()
        with torch.no_grad():
            self._staged = self._on_device(self.shard.detach())  # kept until the wait
            self._handle = C.all_gather(
                self.full, self._staged, async_op=True, group=self.ranks.group, label=self.label
            )
        events.instant("gather", self.label)

    def wait_gather(self) -> None:
        """Blocks until `full` holds every rank's data (gathers now if needed)."""
        self._forget_stale()
        if self.alias or (self._handle is None and self._fresh()):
            return
        self.start_gather()
        self._handle.wait()
        _restore_version(self.full, self._version)
        self._handle = self._staged = None
        self.gathered = True

    def _forget_stale(self) -> None:
        """After a failed cell the groups are made again (nbtrain.comm.recovery), and
        the ranks were cut at different places: one had this group gathered, or its
        gather in flight on the aborted group, another not. Each forgets what it had, so
        every rank gathers anew at the next use, in the same order."""
        if self._generation != C.generation() and not self.alias:
            self._handle = self._staged = None
            self.gathered = False
            self._generation = C.generation()

    def _fresh(self) -> bool:
        """Gathered, and from the shard as it is now. A shard changed while gathered
        (an optimizer step or a load after a backward that raised before releasing
        this group) makes the gathered copy stale: it is gathered again."""
        if self.gathered and self.shard._version != self._shard_version:
            self.gathered = False
        return self.gathered

    def release(self, force: bool = False) -> None:
        """Frees the gathered storage (views stay valid objects); kept while `hold`
        is set, unless `force`."""
        if self.alias or (self.hold and not force):
            return
        self._forget_stale()
        if self._handle is not None:  # never free under a collective in flight
            self.wait_gather()
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False
            events.instant("release", self.label)

    # -- autograd -----------------------------------------------------------
    def full_tensor(self, on_grad_ready=None) -> torch.Tensor:
        """The gathered buffer as an autograd-aware tensor (after wait_gather).
        `on_grad_ready` (default: the group's `on_grad_ready`) is called by its
        backward before the reduction; the parameters trainable now are the ones
        this use's gradient is for."""
        if self.requires_grad and torch.is_grad_enabled():
            hook = on_grad_ready or getattr(self, "on_grad_ready", None)
            return _GatherFlat.apply(self, hook, tuple(self.trainable), self.shard)
        return self.full.detach()

    def has_grad(self, slot: int) -> bool:
        """Whether parameter `slot` holds a gradient in the shard's (else its `.grad`
        reads None and optimizers leave it alone). Local."""
        return self.slot_grads.has(shard_grad(self.shard), slot)

    def segments(self) -> list[tuple[int, int]]:
        """This rank's [lo, hi) range in the shard of each parameter with elements here,
        in order (what an optimizer may count steps for one by one: freeze.py). Local."""
        begin, end = self.layout.shard_range(self.rank)
        parts = (slot.local_part(begin, end) for slot in self.layout.slots)
        return [(lo - begin, hi - begin) for lo, hi in filter(None, parts)]

    def partly_frozen(self) -> bool:
        """Whether some parameter of the group holds no gradient in the shard's, while
        the shard has one: the same on every rank, wherever that parameter's elements
        lie. Local."""
        grad = shard_grad(self.shard)
        return grad is not None and not all(
            self.slot_grads.has(grad, i) for i in range(len(self.trainable))
        )

    def frozen_spans(self) -> list[tuple[int, int]]:
        """This rank's [lo, hi) ranges in the shard of the parameters without a
        gradient, while the shard has one (what an optimizer's step must not touch:
        freeze.py). Local."""
        if not self.partly_frozen():
            return []
        grad = shard_grad(self.shard)
        begin, end = self.layout.shard_range(self.rank)
        spans = []
        for i, slot in enumerate(self.layout.slots):
            part = slot.local_part(begin, end)
            if part is not None and not self.slot_grads.has(grad, i):
                spans.append((part[0] - begin, part[1] - begin))
        return spans

    def param_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into `full`; split keeps the backward to one buffer."""
        sizes = [s.numel for s in self.layout.slots]
        pad = self.layout.padded_numel - self.layout.numel
        pieces = full.split(sizes + [pad] if pad else sizes)
        return [p.view(s.shape) for p, s in zip(pieces, self.layout.slots)]

    def reduce_grad(self, grad_full: torch.Tensor, on_done=None, trainable=None) -> None:
        """Average `grad_full` over ranks into `shard.grad` (async, queued).
        `trainable`: which parameters the gradient is for (default: all).

        When `grad_dtype` differs from the shard's dtype the result accumulates in
        `shard.main_grad` (dtype `grad_dtype`) instead; nbtrain's optimizers read it.
        """
        grad_full = grad_full.to(self.grad_dtype).contiguous()
        if self.ranks.grad_scale != 1.0:  # experts: a sum over the ep ranks' tokens
            grad_full = grad_full * self.ranks.grad_scale
        if self.tp_layout is not None and self.tp_layout.any_partial_possible():
            grad_full = grad_full.clone()  # autograd's tensor is not ours to scale
            self.tp_layout.apply([v.view(-1) for v in self.param_views(grad_full)])
        trainable = tuple(trainable or [True] * len(self.trainable))
        if self.hold:  # a later micro-batch adds to it; reduced once by flush_deferred
            if self.deferred is None:
                self.deferred = grad_full.clone()
                self._deferred_trainable = trainable
            else:
                self.deferred.add_(grad_full)
                self._deferred_trainable = tuple(
                    a or b for a, b in zip(self._deferred_trainable, trainable)
                )
            if on_done is not None:
                on_done()
            return
        if self.ranks.size == 1:  # the whole gradient is this rank's: nothing to reduce
            out, handle = grad_full, _DONE
        else:
            out = torch.empty(
                self.layout.shard_numel, dtype=self.grad_dtype, device=grad_full.device
            )
            handle = C.reduce_scatter(
                out, grad_full, op="avg", async_op=True, group=self.ranks.group, label=self.label
            )

        def finish(grad_full=grad_full):  # keeps the input alive until done
            self._add_to_grad(out, trainable)
            if on_done is not None:
                on_done()

        self.reducer.add(handle, finish)

    def flush_deferred(self) -> None:
        """Reduces the gradient added up while `hold` was set (now, not queued).
        Collective over the group's ranks, in the same group order on each."""
        grad_full, self.deferred = self.deferred, None
        if grad_full is None:
            return
        out = torch.empty(self.layout.shard_numel, dtype=self.grad_dtype, device=grad_full.device)
        C.reduce_scatter(out, grad_full, op="avg", group=self.ranks.group, label=self.label)
        self._add_to_grad(out, self._deferred_trainable)

    def _add_to_grad(self, out: torch.Tensor, trainable) -> None:
        shard = self.shard
        before = shard_grad(shard)
        if out.device != shard.device:  # offloaded: the gradient joins the host shard
            out = out.to(shard.device)
        if out.dtype != shard.dtype:
            # A wider reduce dtype (fp32 for a bf16 shard) is kept as
            # `shard.main_grad` for the optimizer's fp32 master weights:
            # rounding it into shard.grad would throw the precision away.
            main = getattr(shard, "main_grad", None)
            if main is None:
                shard.main_grad = out
            else:
                main.add_(out)
        elif shard.grad is None:
            shard.grad = out
        else:
            shard.grad.add_(out)
        after = shard_grad(shard)
        self.slot_grads.added(after, trainable, created=after is not before)

    # -- whole-tensor access (state dicts, checkpoints) ----------------------
    def gather_copy(self) -> torch.Tensor:
        """A fresh gathered copy of the flat buffer. Collective."""
        out = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.device)
        C.all_gather(
            out,
            self._on_device(self.shard.detach()),
            group=self.ranks.group,
            label=self.label + ".copy",
        )
        return out

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the shard, or a part of it) on the compute device: a copy when
        offloaded (asynchronous from pinned memory on CUDA), else itself."""
        if not self.offload:
            return tensor
        return tensor.to(self.device, non_blocking=True, copy=True)

    def load_full(self, index: int, value: torch.Tensor) -> None:
        """Copies this rank's part of parameter `index` from a full tensor."""
        slot = self.layout.slots[index]
        begin, end = self.layout.shard_range(self.rank)
        part = slot.local_part(begin, end)
        if part is not None:
            lo, hi = part
            with torch.no_grad():
                self.shard[lo - begin : hi - begin].copy_(
                    value.reshape(-1)[lo - slot.offset : hi - slot.offset]
                )


class _Done:
    """The handle of a reduction that needed no collective."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()


class _GatherFlat(torch.autograd.Function):
    """shard -> full flat buffer; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, group: FlatGroup, on_grad_ready, trainable, shard: torch.Tensor):
        ctx.group, ctx.on_grad_ready, ctx.trainable = group, on_grad_ready, trainable
        return group.full.detach()

    @staticmethod
    def backward(ctx, grad_full):
        if ctx.on_grad_ready is not None:
            ctx.on_grad_ready()
        ctx.group.reduce_grad(grad_full, trainable=ctx.trainable)
        return None, None, None, None
