"""Shared training cases: one GPT, built plain or sharded, trained with AdamW."""

from __future__ import annotations

import torch
from torch import nn

import nbtrain as nbt
from nbtrain.models import GPT, GPTConfig

# Sizes no world size of 2 or 3 divides evenly: padding is exercised.
CFG = GPTConfig(vocab_size=257, hidden=50, heads=5, layers=3, seq_len=8)
BATCH_PER_RANK = 2


def batches(world_size: int, steps: int, cfg: GPTConfig = CFG):
    """(x, y) of shape (steps, world_size * BATCH_PER_RANK, seq_len), seeded."""
    g = torch.Generator().manual_seed(1234)
    shape = (steps, world_size * BATCH_PER_RANK, cfg.seq_len)
    return (
        torch.randint(0, cfg.vocab_size, shape, generator=g),
        torch.randint(0, cfg.vocab_size, shape, generator=g),
    )


def plain_model(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def sharded_model(mode: str, zero_level: int, use_checkpoint: bool, cfg: GPTConfig = CFG) -> GPT:
    """mode: "blocks" (explicit Blocks, no links), "blocklist" or "wrap"."""
    model = plain_model(cfg)
    if mode == "blocks":
        model.layers = nn.ModuleList(nbt.Block(m, zero_level, use_checkpoint) for m in model.layers)
    elif mode == "blocklist":
        model.layers = nbt.TransformerBlockList(
            [nbt.Block(m, zero_level, use_checkpoint) for m in model.layers]
        )
    elif mode != "wrap":
        raise ValueError(mode)
    return nbt.wrap(model, zero_level=zero_level, use_checkpoint=use_checkpoint)


def make_adamw(model):
    # Adam's first step is close to sign(grad) * lr, so an element whose true
    # gradient is ~1e-9 moves by +-lr depending on reduction-order noise. eps=1e-6
    # damps updates of such elements; everything else is compared at 1e-5.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)


def train_plain(world_size: int, steps: int):
    """The single-process reference on the concatenated batch."""
    model = plain_model()
    opt = make_adamw(model)
    xs, ys = batches(world_size, steps)
    losses, first_grads = [], None
    for s in range(steps):
        opt.zero_grad()
        loss = model.loss(xs[s], ys[s])
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first_grads, model.state_dict()


def train_sharded(model, steps: int):
    """Each rank trains on its slice of the same batches; returns rank-0 results."""
    rank, world = nbt.rank(), nbt.world_size()
    opt = make_adamw(model)
    xs, ys = batches(world, steps)
    lo, hi = rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK
    losses, first_grads = [], None
    for s in range(steps):
        opt.zero_grad()
        loss = model.loss(xs[s, lo:hi], ys[s, lo:hi])
        loss.backward()
        if first_grads is None:
            first_grads = nbt.zero.full_named_grads(model)
        opt.step()
        losses.append(nbt.sum_loss(loss).item())
    return losses, first_grads, model.state_dict()
