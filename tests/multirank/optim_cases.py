"""Shared helpers for optimizer and checkpoint tests: a fixed global batch that every
world size (1, 2, 3) splits evenly, plain reference training, sharded training
through OptimManager."""

from __future__ import annotations

import torch
from support import cases

import nbtrain as nbt
from nbtrain import lr_scheduler
from nbtrain.optim import AdamOptimizer, OptimManager

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3: the same data at every world size
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)


def global_batches(steps: int, rows: int = GLOBAL_BATCH, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    shape = (steps, rows, cases.CFG.seq_len)
    return (
        torch.randint(0, cases.CFG.vocab_size, shape, generator=g),
        torch.randint(0, cases.CFG.vocab_size, shape, generator=g),
    )


def my_rows(rows: int = GLOBAL_BATCH) -> slice:
    """This rank's rows of a global batch of `rows`."""
    per = rows // nbt.world_size()
    return slice(nbt.rank() * per, (nbt.rank() + 1) * per)


def plain_train(
    steps: int,
    clip: float | None = None,
    norm_type: float = 2.0,
    rows: int = GLOBAL_BATCH,
    decoupled: bool = False,
):
    """torch.optim.Adam (L2 weight decay: AdamOptimizer's rule for fp32 parameters, as
    BMTrain's) or, when `decoupled`, torch.optim.AdamW (its rule for bf16/fp16 ones) on
    the plain fp32 model, one process. Returns (losses, norms, state)."""
    model = cases.plain_model()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(model.parameters(), **HYPER)
    xs, ys = global_batches(steps, rows)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        loss = model.loss(xs[s], ys[s])
        loss.backward()
        if clip is not None:
            norms.append(
                float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=norm_type))
            )
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def sharded_setup(
    dtype=torch.float32,
    optimizer_cls=AdamOptimizer,
    loss_scale=2.0**10,
    scheduler: bool = False,
    **manager_kwargs,
):
    """A wrapped GPT, an optimizer and a manager (optionally with a Cosine schedule)."""
    model = cases.plain_model().to(dtype)
    reduce_dtype = torch.float32 if dtype != torch.float32 else None
    model = nbt.wrap(model, zero_level=3, reduce_dtype=reduce_dtype)
    opt = optimizer_cls(model.parameters(), **HYPER)
    sched = (
        lr_scheduler.Cosine(opt, start_lr=HYPER["lr"], warmup_iter=4, end_iter=40)
        if scheduler
        else None
    )
    manager = OptimManager(loss_scale=loss_scale, **manager_kwargs)
    manager.add_optimizer(opt, sched)
    return model, opt, manager


def sharded_train(
    model,
    manager,
    steps: int,
    start: int = 0,
    total: int | None = None,
    clip: float | None = None,
    norm_type: float = 2.0,
):
    """Trains on steps [start, start + steps) of the global batches. Returns losses and
    clip norms (rank-local losses are averaged over ranks)."""
    xs, ys = global_batches(total or start + steps)
    rows = my_rows()
    losses, norms = [], []
    for s in range(start, start + steps):
        manager.zero_grad()
        loss = model.loss(xs[s, rows], ys[s, rows])
        manager.backward(loss)
        if clip is not None:
            norms.append(
                manager.clip_grad_norm(
                    manager.optimizers[0].param_groups, clip, norm_type=norm_type
                )
            )
        manager.step()
        losses.append(nbt.sum_loss(loss).item())
    return losses, norms


def shard_snapshot(opt) -> list:
    """Copies of every local parameter and its optimizer state (for equality checks)."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = {
                k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state.get(p, {}).items()
            }
            out.append((p.detach().clone(), state))
    return out
