"""Rank functions for test_pipeline_checkpoint.py: train at one pipeline layout, save,
load at another in the same ranks, train on, against the plain model on this process.

A layout is (pipe_size, zero_level): zero_level None keeps the stages plain (the GPT
with its embedding tied to its output projection needs that at pp > 1), else each
stage is `nbtrain.wrap`ped at that level over its data-parallel ranks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipeline_cases import MICRO, _layers, _optimizer
from torch import nn

HALF, TOTAL = 3, 6  # steps before the save, and in all
BATCH = 8  # rows per step, split over the data-parallel ranks
GPT_CFG = dict(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)


def _model(kind: str, seed: int) -> list[nn.Module]:
    """The layers, the same on every rank for one seed (another seed: other values, so
    only a working load makes the second run match)."""
    if kind == "mlp":
        layers = _layers()
        if seed:
            torch.manual_seed(seed)
            for m in layers:
                for p in m.parameters():
                    torch.nn.init.normal_(p)
        return layers
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_pipe import gpt_layers

    torch.manual_seed(seed)
    return gpt_layers(GPT(GPTConfig(**GPT_CFG)))


def _batch(kind: str, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 5, generator=gen)
    vocab = GPT_CFG["vocab_size"]
    return (
        torch.randint(0, vocab, (BATCH, 8), generator=gen),
        torch.randint(0, vocab, (BATCH, 8), generator=gen),
    )


def _loss_fn(kind: str):
    if kind == "mlp":
        return F.mse_loss
    vocab = GPT_CFG["vocab_size"]
    return lambda logits, target: F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))


def _stage(kind: str, layout, seed: int, optimizer: str):
    import nbtrain
    from nbtrain import pipeline

    pipe, zero_level = layout
    nbtrain.init_distributed(pipe_size=pipe)
    stage = pipeline.stage_of(_model(kind, seed))
    if zero_level is not None:
        stage = nbtrain.wrap(stage, zero_level=zero_level)
    manager = nbtrain.optim.OptimManager()
    manager.add_optimizer(_optimizer(stage.parameters(), optimizer))
    return stage, manager


def _train(kind, stage, manager, steps) -> list[float]:
    from nbtrain import pipeline
    from nbtrain.comm.context import get_context

    topo = get_context().topology
    losses = []
    for step in steps:
        x, y = _batch(kind, step)
        mine_x, mine_y = x.chunk(topo.dp_size)[topo.dp_rank], y.chunk(topo.dp_size)[topo.dp_rank]
        out = pipeline.run(
            stage, list(mine_x.chunk(MICRO)), list(mine_y.chunk(MICRO)), _loss_fn(kind)
        )
        manager.step()
        manager.zero_grad()
        mean = torch.tensor(sum(out) / len(out))
        dist.all_reduce(mean)  # every stage has the losses: the mean over the world
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _plain(kind: str, optimizer: str):
    """The plain model trained TOTAL steps on the whole batch; its state after HALF."""
    plain = nn.Sequential(*_model(kind, 0))
    opt = _optimizer(plain.parameters(), optimizer)
    losses, half = [], None
    for step in range(TOTAL):
        if step == HALF:
            half = {k: v.clone() for k, v in plain.state_dict().items()}
        x, y = _batch(kind, step)
        loss = _loss_fn(kind)(plain(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return plain.state_dict(), half, losses


def resume(kind: str, first, second, optimizer: str, folder: str) -> dict:
    """HALF steps at layout `first`, save_checkpoint (and the consolidated file), a
    fresh model at layout `second` (other initial values, empty optimizer) loads it and
    trains to TOTAL. Returns the worst differences with the plain run and the names."""
    import nbtrain

    stage, manager = _stage(kind, first, 0, optimizer)
    losses = _train(kind, stage, manager, range(HALF))
    nbtrain.save_checkpoint(stage, folder, manager, step=HALF)
    nbtrain.save(stage, f"{folder}.safetensors")
    first_keys = sorted(stage.state_dict())
    stage, manager = _stage(kind, second, 7, optimizer)
    meta = nbtrain.load_checkpoint(stage, folder, manager)
    losses += _train(kind, stage, manager, range(meta["step"], TOTAL))
    state = stage.state_dict()  # this stage's layers, under the plain names
    ref, half, ref_losses = _plain(kind, optimizer)
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "params": max((v - ref[k]).abs().max().item() for k, v in state.items()),
        "keys": sorted(state),
        "first_keys": first_keys,
        "plain_keys": sorted(ref),
        "half": half if dist.get_rank() == 0 else None,
    }
