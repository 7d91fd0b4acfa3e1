"""Sharded checkpoints of tensor-parallel models reshard across layouts: saved at
(tp=2, dp=1), loaded at (tp=1, dp=3) and (tp=2, dp=2), model and AdamW state, and the
loaded run continues exactly as the saving run did (within 1e-5)."""

import pytest
import torch
import torch.distributed as dist
from support.ranks import run_ranks

STEPS = 3


def _setup(tp, kind):
    """kind "wrap": GPT parallelized and wrapped (tp slices in flat ZeRO-3 buffers and
    DistributedParameters); "module": a DistributedModule (tp slices and a norm held
    whole, a Block with tp slices and a norm inside)."""
    import nbtrain
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_tp import gpt_plan

    nbtrain.init_distributed(tp_size=tp)
    torch.manual_seed(0)
    if kind == "wrap":
        cfg = GPTConfig(vocab_size=37, seq_len=8, hidden=24, heads=6, layers=2)
        model = nbtrain.wrap(nbtrain.parallelize(GPT(cfg), gpt_plan(cfg)))
        loss_fn = model.loss
    else:
        model, loss_fn = _module_model(nbtrain)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    manager = nbtrain.optim.OptimManager()
    manager.add_optimizer(opt)
    return model, opt, manager, loss_fn


def _module_model(nbtrain):
    from torch import nn

    from nbtrain.nn import ColumnParallelLinear, FusedCrossEntropy, RowParallelLinear, VPEmbedding

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(6)
            self.up = ColumnParallelLinear(6, 12, gather_input=False)
            self.down = RowParallelLinear(12, 6, all_reduce_output=True)

        def forward(self, h):
            return self.down(torch.relu(self.up(self.norm(h))))

    class Tiny(nbtrain.DistributedModule):
        def __init__(self):
            super().__init__()
            self.emb = VPEmbedding(11, 6, sequence_parallel=False)
            self.norm = nn.LayerNorm(6)
            self.ffn = nbtrain.Block(FFN())

        def forward(self, ids):
            h = self.norm(self.emb(ids))
            return self.emb(h + self.ffn(h), projection=True)

    model, ce = Tiny(), FusedCrossEntropy(parallel=True)
    return model, lambda ids, target: ce(model(ids % 11), target % 11)


def _steps(model, opt, manager, loss_fn, start):
    from nbtrain.comm.context import get_context

    topo = get_context().topology
    losses = []
    for step in range(start, start + STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, 37, (6, 8), generator=gen)
        target = torch.randint(0, 37, (6, 8), generator=gen)
        dp, d = topo.dp_size, topo.dp_rank
        loss = loss_fn(idx.chunk(dp)[d], target.chunk(dp)[d])
        loss.backward()
        manager.step()
        manager.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return losses


def _save(folder, kind):
    import nbtrain

    model, opt, manager, loss_fn = _setup(2, kind)
    _steps(model, opt, manager, loss_fn, 0)
    nbtrain.save_checkpoint(model, folder, manager, step=STEPS)
    losses = _steps(model, opt, manager, loss_fn, STEPS)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _load(folder, tp, kind):
    import nbtrain

    model, opt, manager, loss_fn = _setup(tp, kind)
    meta = nbtrain.load_checkpoint(model, folder, manager)
    losses = _steps(model, opt, manager, loss_fn, meta["step"])
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["wrap", "module"])
def test_tp_checkpoints_reshard_to_other_layouts(tmp_path, kind):
    folder = str(tmp_path / "ckpt")
    ref_losses, ref_state = run_ranks(_save, 2, folder, kind, timeout_s=180)[0]
    for world, tp in ((3, 1), (4, 2)):
        for rank, (losses, state) in enumerate(
            run_ranks(_load, world, folder, tp, kind, timeout_s=180)
        ):
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (world, rank)
            assert sorted(state) == sorted(ref_state)
            worst = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
            assert worst < 1e-5, (world, tp, rank, worst)


def _load_into_plain(folder):
    import nbtrain
    from nbtrain.models import GPT, GPTConfig

    nbtrain.init_distributed()
    model = nbtrain.wrap(GPT(GPTConfig(vocab_size=37, seq_len=8, hidden=24, heads=6, layers=2)))
    try:
        nbtrain.load_checkpoint(model, folder)
    except ValueError as exc:
        return str(exc)


def test_a_tp_checkpoint_in_a_model_without_tp_layers_is_a_clear_error(tmp_path):
    folder = str(tmp_path / "ckpt")
    run_ranks(_save, 2, folder, "wrap", timeout_s=180)
    message = run_ranks(_load_into_plain, 2, folder, timeout_s=180)[0]
    assert message == (
        "load_checkpoint: 'tok.weight' was saved as tensor-parallel slices, and the model holds "
        "it whole: build the model with the same layers as the saving run (nbtrain.parallelize "
        "works at tp_size 1 too), or move weights between them with nbtrain.save/load"
    ), message
