"""RowParallelLinear's bias, replicated over tensor parallelism, against plain PyTorch.

Each tp rank holds the whole bias and, after the layer's all-reduce (or the sum of
its gradient over tp, sequence parallel), the whole gradient: as BMTrain's tp-mode
parameter without a split dimension it is sharded over data parallel only. Checked
with and without a Block around the layer, SGD with momentum and AdamW in an
OptimManager that clips the gradient norm (so a norm counting the bias once per tp
rank changes the update), over a few steps, against nn.Linear on one process:
  * `.grad` of the bias is the plain bias gradient on every rank (tp 2, dp 1);
  * OptimManager.clip_grad_norm returns torch.nn.utils.clip_grad_norm_'s norm;
  * the losses and the weights `nbtrain.save` writes (the full bias once) equal the
    plain run's; at world 3 with tp 1 (bias sharded over dp 3) too.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.ranks import run_ranks
from torch import nn

IN, OUT, ROWS, STEPS, MAX_NORM = 8, 6, 4, 3, 0.5
# (split_input, all_reduce_output, in a Block)
CONFIGS_TP2 = [(s, a, b) for s, a in ((True, True), (False, True), (False, False)) for b in (0, 1)]
CONFIGS_DP3 = [(True, True, 1), (False, True, 1)]


def _data(dp):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, dp * ROWS, IN, generator=g)
    return x, torch.randn(STEPS, dp * ROWS, OUT, generator=g)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _reference():
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


def train_plain(kind, dp):
    ref = _reference()
    opt = _optimizer(kind, ref.parameters())
    xs, ts = _data(dp)
    losses, bias_grads, norms = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(ref(xs[step]), ts[step], reduction="sum") / (ROWS * OUT * dp)
        loss.backward()
        bias_grads.append(ref.bias.grad.clone())
        norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return losses, bias_grads, norms, {k: v.clone() for k, v in ref.state_dict().items()}


def train_tp(kind, tp, configs, folder):
    import nbtrain as bmt
    from nbtrain.nn import RowParallelLinear

    topo = bmt.init_distributed(tp_size=tp).topology
    dp = dist.get_world_size() // tp
    xs, ts = _data(dp)
    out = []
    for index, (split, aro, block) in enumerate(configs):
        layer = RowParallelLinear(IN, OUT, split_input=split, all_reduce_output=aro)
        layer.load_state_dict(_reference().state_dict())  # the full tensors
        model = bmt.Block(layer) if block else layer
        opt = _optimizer(kind, model.parameters())
        manager = bmt.optim.OptimManager(loss_scale=None)
        manager.add_optimizer(opt)
        losses, bias_grads, norms = [], [], []
        for step in range(STEPS):
            x = xs[step].chunk(dp)[topo.dp_rank]  # this replica's rows
            t = ts[step].chunk(dp)[topo.dp_rank]
            if split:  # a token slice with every input feature
                x = x.chunk(tp)[topo.tp_rank]
            else:  # every token, this rank's input features
                x = x.chunk(tp, dim=-1)[topo.tp_rank]
            if not aro:  # sequence parallel: this rank's token slice of the output
                t = t.chunk(tp)[topo.tp_rank]
            manager.zero_grad()
            loss = F.mse_loss(model(x), t, reduction="sum") / (ROWS * OUT)
            manager.backward(loss)
            bias_grads.append(model._parameters["bias"].grad.clone())
            norms.append(manager.clip_grad_norm(opt.param_groups, MAX_NORM))
            manager.step()
            losses.append(loss.item())
        path = f"{folder}/linear{index}.pt"
        bmt.save(model, path)
        bmt.synchronize()
        saved = torch.load(path) if bmt.rank() == 0 else None
        out.append((losses, bias_grads, norms, saved, aro))
    return out


def _check(kind, world, tp, configs, tmp_path):
    dp = world // tp
    want_losses, want_bias, want_norms, want_state = train_plain(kind, dp)
    results = run_ranks(train_tp, world, kind, tp, configs, str(tmp_path), timeout_s=240)
    for c, config in enumerate(configs):
        where = f"{kind} world {world} tp {tp} (split_input, all_reduce_output, block)={config}"
        if tp > 1 or dp == 1:  # the bias gradient is whole on every rank
            for rank, result in enumerate(results):
                for step in range(STEPS):
                    torch.testing.assert_close(
                        result[c][1][step],
                        want_bias[step],
                        rtol=1e-5,
                        atol=1e-6,
                        msg=f"{where}: bias.grad, rank {rank} step {step}",
                    )
        for rank, result in enumerate(results):
            torch.testing.assert_close(
                result[c][2], want_norms, rtol=1e-5, atol=1e-6, msg=f"{where}: norm, rank {rank}"
            )
        losses = [r[c][0] for r in results]
        if config[1]:  # every tp rank's loss is its replica's: average the replicas
            mean = [sum(ls[s] for ls in losses) / world for s in range(STEPS)]
        else:  # each tp rank's token slice: the tp ranks' losses add up
            mean = [sum(ls[s] for ls in losses) / dp for s in range(STEPS)]
        torch.testing.assert_close(mean, want_losses, rtol=1e-5, atol=1e-6, msg=where)
        saved = results[0][c][3]
        assert sorted(saved) == ["bias", "weight"], where
        for key, value in want_state.items():
            torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-6, msg=where)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_row_parallel_bias_at_tp2_matches_plain_linear(kind, tmp_path):
    _check(kind, 2, 2, CONFIGS_TP2, tmp_path)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_row_parallel_bias_sharded_over_dp3_matches_plain_linear(kind, tmp_path):
    _check(kind, 3, 1, CONFIGS_DP3, tmp_path)
