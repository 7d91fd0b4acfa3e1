"""Parameters frozen one at a time inside a Block's flat buffer, against plain PyTorch.

Three Blocks in a TransformerBlockList (one of plain `nn.Linear`s, one of a
`DistributedModule` holding `DistributedParameter`s, one not checkpointing), at ZeRO-2
and ZeRO-3, on 1, 2 and 3 ranks (the flat buffers of 3 ranks cut parameters across
shards). Between steps one parameter after another is frozen with `requires_grad_` on
the object the block shows (a plain parameter's placeholder, a DistributedParameter)
and thawed again; the reference is the plain model on one process with the same
parameters frozen, trained on the whole batch while each rank trains on its slice.

Checked at every step: the loss equals the reference's, a frozen parameter's `.grad`
is None and a training one's is not (a DistributedParameter's: its part of the
reference's gradient); at the end every weight equals the reference's. SGD (momentum)
and nbtrain's Adam optimizers (in an OptimManager: AdamOptimizer's default, L2 decay for
fp32 as BMTrain's, against torch's Adam; AdamOptimizer and AdamOffloadOptimizer with
decoupled_weight_decay=True against torch's AdamW) run the "thaw" schedule, where
weights and biases of different Blocks are frozen and then trained again: nbtrain's
Adam counts steps per parameter inside a shard, so each thawed parameter's bias
correction is its own, as torch's. torch's AdamW stepping the shards keeps one count per
shard, so its schedule only freezes parameters for good (nbtrain/zero/freeze.py).
nbtrain's optimizers are also rebuilt mid-schedule from their saved state dicts (with
per-parameter counts, and with the single count of a shard none of whose parameters
was frozen yet), and a run saved by save_checkpoint at 2 ranks resumes at 3.
"""

import io

import pytest
import torch
import torch.nn.functional as F
from support.ranks import run_ranks
from torch import nn

import nbtrain as bmt

DIM, ROWS_PER_RANK = 6, 2
NAMES = ["0.fc1.bias", "1.fc2.weight", "0.fc2.weight", "1.fc1.bias", "2.fc1.weight"]
# step -> the parameters frozen for that step
SCHEDULES = {
    "toggle": [set(), {NAMES[0]}, {NAMES[1]}, {NAMES[2], NAMES[3]}, {NAMES[4]}],
    "for_good": [set(), {NAMES[0]}, {NAMES[0], NAMES[1]}, set(NAMES[:3]), set(NAMES[:4])],
    # frozen before the first step, or after some, then thawed: a bias and a weight in
    # each of Blocks 0 (fc1.bias), 1 (fc2.weight, fc1.bias) and 2 (fc1.weight)
    "thaw": [
        {NAMES[4]},
        {NAMES[0], NAMES[1], NAMES[4]},
        {NAMES[0], NAMES[1]},
        {NAMES[3]},
        set(),
        set(),
    ],
}
STEPS = len(SCHEDULES["thaw"])
SCHEDULES = {k: v + v[-1:] * (STEPS - len(v)) for k, v in SCHEDULES.items()}  # as last set
RUNS = [
    ("sgd", "toggle"),
    ("sgd", "thaw"),
    ("adamw", "for_good"),
    ("bmt", "thaw"),
    ("bmt_adamw", "thaw"),
    ("offload_adamw", "thaw"),
]
# nbtrain's optimizers (in an OptimManager) -> the torch optimizer they equal
MANAGED = {"bmt": "adam", "bmt_adamw": "adamw", "offload_adamw": "adamw"}


def _linear(dist: bool) -> nn.Module:
    """BMTrain's way to write a layer (a DistributedModule of DistributedParameters), or
    the same layer in plain PyTorch (the reference)."""
    base = bmt.DistributedModule if dist else nn.Module
    param = bmt.DistributedParameter if dist else nn.Parameter

    class Linear(base):
        def __init__(self):
            super().__init__()
            self.weight = param(torch.randn(DIM, DIM) / DIM**0.5)
            self.bias = param(torch.randn(DIM) * 0.1)

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    return Linear()


class Layer(nn.Module):
    def __init__(self, dist_params=None):
        super().__init__()
        if dist_params is None:
            self.fc1, self.fc2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        else:
            self.fc1, self.fc2 = _linear(dist_params), _linear(dist_params)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _layers(dist):
    torch.manual_seed(0)
    return [Layer(), Layer(dist_params=dist), Layer()]  # layer 1: BMTrain's way


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind in MANAGED:
        cls = (
            bmt.optim.AdamOffloadOptimizer
            if kind.startswith("offload")
            else bmt.optim.AdamOptimizer
        )
        # None: BMTrain's rule (L2 for these fp32 parameters); True: AdamW's decay
        decoupled = True if kind.endswith("adamw") else None
        manager = bmt.optim.OptimManager(loss_scale=None)
        manager.add_optimizer(
            cls(params, lr=0.05, weight_decay=0.1, decoupled_weight_decay=decoupled)
        )
        return manager
    if kind == "adam":  # the reference for "bmt": L2 decay for fp32, as BMTrain's
        return torch.optim.Adam(params, lr=0.05, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


# nbtrain's optimizer is rebuilt from its saved state after this step: after step 2 the
# shards hold per-parameter step counts; after step 0 blocks 0 and 1 hold one count
# (the single-count state, as older nbtrain saved), block 2 already per parameter.
RELOAD_AFTER = {"bmt": 2, "bmt_adamw": 2, "offload_adamw": 0}


def _reloaded(kind, manager, model):
    """A new manager whose optimizer loads `manager`'s state, saved through bytes."""
    buffer = io.BytesIO()
    torch.save(manager.optimizers[0].state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    counted = ["segment_step" in st for st in saved["state"].values()]  # per Block, every rank
    assert counted == ([False, False, True] if kind == "offload_adamw" else [True] * 3), counted
    fresh = _optimizer(kind, model.parameters())
    fresh.optimizers[0].load_state_dict(saved)
    return fresh


def _holder(model, name):
    """The object a user freezes: the plain model's parameter, or what a Block shows."""
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _batches(world):
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, world * ROWS_PER_RANK, DIM, generator=g)


def _train_plain(kind, schedule, world, resumed=(STEPS, 1)):
    """The reference; `resumed` (step, world): from that step on, that world's batches."""
    model = nn.Sequential(*_layers(dist=False))
    # AdamOptimizer on fp32 parameters takes weight decay as L2 (BMTrain's rule): the
    # reference for "bmt" is torch's Adam.
    opt = _optimizer(MANAGED.get(kind, kind), model.parameters())
    xs, later = _batches(world), _batches(resumed[1])
    xs, losses, grads = [later[s] if s >= resumed[0] else xs[s] for s in range(STEPS)], [], []
    for step in range(STEPS):
        for name, p in model.named_parameters():
            p.requires_grad_(name not in SCHEDULES[schedule][step])
        opt.zero_grad()
        loss = (model(xs[step]) ** 2).mean()
        loss.backward()
        grads.append({n: _holder(model, n).grad for n in NAMES})
        opt.step()
        losses.append(loss.item())
    return losses, grads, model.state_dict()


def _train_blocks():
    """Every (zero level, optimizer) run on this rank: losses, grads seen, final state."""
    rank, world = bmt.rank(), bmt.world_size()
    out = {}
    for level in (2, 3):
        for kind, schedule in RUNS:
            layers = _layers(dist=True)
            model = bmt.TransformerBlockList(
                [
                    bmt.Block(layers[0], zero_level=level),
                    bmt.Block(layers[1], zero_level=level),
                    bmt.Block(layers[2], zero_level=level, use_checkpoint=False),
                ]
            )
            opt = _optimizer(kind, model.parameters())
            xs, losses, grads = _batches(world), [], []
            rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
            for step in range(STEPS):
                for name in NAMES:
                    _holder(model, name).requires_grad_(name not in SCHEDULES[schedule][step])
                opt.zero_grad()
                loss = (model(xs[step, rows]) ** 2).mean()
                opt.backward(loss) if kind in MANAGED else loss.backward()
                seen = {}
                for name in NAMES:
                    p = _holder(model, name)
                    grad = p.grad
                    part = (getattr(p, "_start_partition", None), getattr(p, "_end_partition", 0))
                    seen[name] = (None if grad is None else grad.clone(), part)
                grads.append(seen)
                opt.step()
                if step == RELOAD_AFTER.get(kind):
                    opt = _reloaded(kind, opt, model)
                losses.append(loss.item())
            out[(level, kind, schedule)] = (losses, grads, model.state_dict())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parameters_frozen_one_at_a_time_in_a_block_train_as_plain_pytorch(world_size):
    results = run_ranks(_train_blocks, world_size, timeout_s=300)
    for kind, schedule in RUNS:
        ref_losses, ref_grads, ref_state = _train_plain(kind, schedule, world_size)
        for level in (2, 3):
            what = f"zero {level}, {kind}, {schedule}, {world_size} ranks"
            per_rank = [r[(level, kind, schedule)] for r in results]
            for step in range(STEPS):  # each rank's loss is its slice's: their mean is the batch's
                mean = sum(r[0][step] for r in per_rank) / world_size
                assert mean == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6), (what, step)
                frozen = SCHEDULES[schedule][step]
                for name in NAMES:
                    for _losses, grads, _ in per_rank:
                        grad, (start, end) = grads[step][name]
                        if name in frozen:
                            assert grad is None, (what, step, name)
                            continue
                        assert grad is not None, (what, step, name)
                        if start is not None and name.startswith("1."):  # a DistributedParameter
                            expected = ref_grads[step][name].reshape(-1)[start:end]
                            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
            state = per_rank[0][2]
            assert sorted(state) == sorted(ref_state), what
            for k, v in ref_state.items():
                torch.testing.assert_close(
                    state[k],
                    v,
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, k=k, what=what: f"{what} {k}: {m}",
                )


RESHARD_AT = 4  # steps of the "thaw" schedule before the checkpoint


def _train_resharded(folder, steps):
    """Steps `steps` of the "thaw" schedule at ZeRO-3 with AdamOptimizer (decoupled) on
    this world: saved to `folder` after them when they start at 0, else resumed from it."""
    rank, world = bmt.rank(), bmt.world_size()
    model = bmt.TransformerBlockList([bmt.Block(layer, zero_level=3) for layer in _layers(True)])
    opt = _optimizer("bmt_adamw", model.parameters())
    if steps.start:
        bmt.load_checkpoint(model, folder, opt)
    xs, losses = _batches(world), []
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    for step in steps:
        for name in NAMES:
            _holder(model, name).requires_grad_(name not in SCHEDULES["thaw"][step])
        opt.zero_grad()
        loss = (model(xs[step, rows]) ** 2).mean()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    if not steps.start:
        bmt.save_checkpoint(model, folder, opt)
    return losses, model.state_dict()


def test_per_parameter_adam_steps_reshard_through_a_checkpoint(tmp_path):
    """Saved at 2 ranks mid-schedule (thawed parameters' counts behind their shards'),
    resumed at 3: the per-parameter counts reshard with the moments, and the run goes on
    as torch's AdamW on the plain model."""
    folder = str(tmp_path / "checkpoint")
    first = run_ranks(_train_resharded, 2, folder, range(RESHARD_AT), timeout_s=300)
    second = run_ranks(_train_resharded, 3, folder, range(RESHARD_AT, STEPS), timeout_s=300)
    ref_losses, _, ref_state = _train_plain("bmt_adamw", "thaw", 2, resumed=(RESHARD_AT, 3))
    losses = [sum(r[0][i] for r in first) / 2 for i in range(RESHARD_AT)]
    losses += [sum(r[0][i] for r in second) / 3 for i in range(STEPS - RESHARD_AT)]
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(second[0][1][k], v, rtol=1e-4, atol=1e-6, msg=k)
