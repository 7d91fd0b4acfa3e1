"""Rank functions for test_offload.py: Blocks whose shards live in host memory."""

import torch

VOCAB = 96


def train(offload: bool, optimizer: str, steps: int):
    """A tiny GPT sharded by wrap (ZeRO-3, `offload`), trained `steps` steps on a fixed
    global batch (this rank's rows): (losses, full state after, where the Blocks'
    shards and the optimizer's state live)."""
    import nbtrain
    from nbtrain.models.gpt import GPT, GPTConfig
    from nbtrain.optim import AdamOffloadOptimizer, AdamOptimizer, OptimManager
    from nbtrain.zero import Block

    torch.manual_seed(0)
    model = nbtrain.wrap(
        GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, seq_len=16)), offload=offload
    )
    params = list(model.parameters())
    if optimizer == "adam":
        cls = AdamOffloadOptimizer if offload else AdamOptimizer
        opt = cls(params, lr=3e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    manager = OptimManager()
    manager.add_optimizer(opt)
    world, rank = nbtrain.world_size(), nbtrain.rank()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    mine = ids[rank * 4 // world : (rank + 1) * 4 // world]
    losses = []
    for _ in range(steps):
        manager.zero_grad()
        loss = model.loss(mine, mine.roll(-1, dims=1))
        manager.backward(loss)
        manager.clip_grad_norm(1.0)
        manager.step()
        losses.append(nbtrain.sum_loss(loss).item())
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    where = {
        "blocks": len(blocks),
        "offloaded": all(g.offload for b in blocks for g in b.groups),
        "shards": sorted({str(g.shard.device) for b in blocks for g in b.groups}),
        "grads": sorted(
            {str(g.shard.grad.device) for b in blocks for g in b.groups if g.shard.grad is not None}
        ),
    }
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, where
