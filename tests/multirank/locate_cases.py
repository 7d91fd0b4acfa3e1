"""Rank functions for test_locate_divergence.py: correct layouts and three injected bugs,
each located by nbtrain.debug.locate_divergence against the plain model on one process."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 3


def _cfg():
    from nbtrain.models.gpt import GPTConfig

    return GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)


def _gpt():
    from nbtrain.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(_cfg())


def _gpt_batches(rows=4):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (rows, 8), generator=gen)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def _lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _summary(report):
    def one(f):
        return None if f is None else (f.step, f.direction, f.module, f.rank, f.tensor)

    return {
        "diverged": report.diverged,
        "first": one(report.first()),
        "steps": [
            [one(getattr(s, d)) for d in ("forward", "backward", "params")] for s in report.steps
        ],
        "skipped": report.skipped,
        "compared": {d: len(report.steps[0].errors[d]) for d in ("forward", "backward", "params")},
        "table": report.table(),
    }


def _locate(model, reference, batches, **kw):
    from nbtrain.debug import locate_divergence

    return locate_divergence(
        model,
        reference,
        batches,
        kw.pop("loss_fn", _lm_loss),
        kw.pop("optimizer", None) or _sgd(model.parameters()),
        _sgd(reference.parameters()),
        **kw,
    )


class _ScaleShardAfter(torch.optim.SGD):
    """SGD that, after step `at`, multiplies rank 1's shard of one parameter by 1.5."""

    def __init__(self, params, model, name, at):
        super().__init__(params, lr=0.5, momentum=0.9)
        self.model, self.name, self.at, self.count = model, name, at, 0

    def step(self, closure=None):
        import torch.distributed as dist

        import nbtrain

        super().step(closure)
        if self.count == self.at and dist.get_rank() == 1:
            with torch.no_grad():
                for shard in nbtrain.zero.shards(self.model):
                    if self.name in shard.names:
                        shard.values.mul_(1.5)
        self.count += 1


def zero_cases():
    """ZeRO-3 over 2 data-parallel ranks: correct, then a wrong scale on rank 1's shard
    of one parameter after step 1."""
    import nbtrain

    nbtrain.init_distributed()
    out = {}
    reference = _gpt()
    out["correct"] = _summary(
        _locate(nbtrain.wrap(_gpt(), zero_level=3), reference, _gpt_batches())
    )
    model, reference = nbtrain.wrap(_gpt(), zero_level=3), _gpt()
    bad = _ScaleShardAfter(model.parameters(), model, "layers.1.mlp.0.weight", at=1)
    report = _locate(model, reference, _gpt_batches(), optimizer=bad)
    out["scaled"] = _summary(report)

    def summed(model, batch):  # the loss summed over this rank's tokens, not averaged
        ids, target = batch
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, 32), target.reshape(-1), reduction="sum").backward()

    model = nbtrain.wrap(_gpt(), zero_level=3)
    found = _locate(model, _gpt(), _gpt_batches(), forward_backward=summed)
    out["summed"] = _summary(found)
    out["summed_ratio"] = found.steps[0].backward.ratio
    import matplotlib

    matplotlib.use("Agg")
    figure = report.plot()  # one line per step in each direction's panel
    out["plot_lines"] = [len(ax.get_lines()) for ax in figure.axes]
    return out


class _NoGradAllReduce(torch.autograd.Function):
    """copy_to_tp whose backward forgets the all-reduce over tp."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_cases():
    """tp 2 (Megatron layout, nbtrain's GPT plan): correct, then the column-parallel
    layers.1.mlp.0 skipping the all-reduce of its input gradient."""
    import nbtrain
    from nbtrain.models.gpt_tp import gpt_plan

    nbtrain.init_distributed(tp_size=2)
    out = {}
    model = _gpt()
    nbtrain.parallelize(model, gpt_plan(_cfg()))
    out["correct"] = _summary(_locate(model, _gpt(), _gpt_batches()))
    model = _gpt()
    nbtrain.parallelize(model, gpt_plan(_cfg()))
    broken = model.layers[1].mlp[0]

    def forward(x):  # ColumnParallelLinear.forward without copy_to_tp's all-reduce
        return F.linear(_NoGradAllReduce.apply(x), broken.weight, broken.bias)

    broken.forward = forward
    out["no_all_reduce"] = _summary(_locate(model, _gpt(), _gpt_batches()))
    return out


def _layers():
    torch.manual_seed(0)
    dims = [6, 12, 10, 12, 5]
    return [
        nn.Sequential(nn.Linear(a, b), nn.Tanh()) if i < 3 else nn.Linear(a, b)
        for i, (a, b) in enumerate(zip(dims, dims[1:]))
    ]


def pipeline_cases():
    """2 stages, 4 micro-batches (1F1B): correct, then stage 1 dropping micro-batch 2's
    loss (its gradient never flows)."""
    import torch.distributed as dist

    import nbtrain
    from nbtrain import pipeline

    nbtrain.init_distributed(pipe_size=2)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)) for _ in range(STEPS)
    ]
    out = {}
    for case, dropped in (("correct", None), ("dropped", 2)):
        layers = _layers()
        reference = nn.Sequential(*copy.deepcopy(layers))
        stage = pipeline.stage_of(layers, [range(0, 2), range(2, 4)])
        seen = []

        def loss(output, target, dropped=dropped, seen=seen):
            micro_batch = len(seen) % 4
            seen.append(micro_batch)
            value = F.mse_loss(output, target)
            return value * 0 if micro_batch == dropped else value

        def run(model, batch):
            x, y = batch
            pipeline.run(model, list(x.chunk(4)), list(y.chunk(4)), loss)

        report = _locate(stage, reference, batches, loss_fn=F.mse_loss, forward_backward=run)
        out[case] = _summary(report)
    out["rank"] = dist.get_rank()
    return out


def checkpoint_cases():
    """Blocks that recompute their forward in backward (`use_checkpoint=True`, BMTrain's
    default) at ZeRO-2 and ZeRO-3: correct, then rank 1's shard of one parameter
    scaled after step 1. A recomputed forward must not count as a second call."""
    import torch.distributed as dist

    import nbtrain

    nbtrain.init_distributed()
    rows = 2 * dist.get_world_size()  # every data-parallel rank gets 2 rows
    out = {}
    for level in (2, 3):
        model = nbtrain.wrap(_gpt(), zero_level=level, use_checkpoint=True)
        out[f"correct{level}"] = _summary(_locate(model, _gpt(), _gpt_batches(rows)))
        model = nbtrain.wrap(_gpt(), zero_level=level, use_checkpoint=True)
        bad = _ScaleShardAfter(model.parameters(), model, "layers.1.mlp.0.weight", at=1)
        out[f"scaled{level}"] = _summary(_locate(model, _gpt(), _gpt_batches(rows), optimizer=bad))
    return out
