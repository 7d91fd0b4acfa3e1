"""parallelize(GPT, gpt_plan) at tp 2 and 3 trains like the plain GPT on one process,
and its state_dict (full tensors, plain names) loads into the plain model."""

import copy

import pytest
import torch
import torch.distributed as dist
from support.ranks import run_ranks


def _train(optimizer, tie):
    import nbtrain
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_tp import gpt_plan

    nbtrain.init_distributed(tp_size=dist.get_world_size())
    # vocabulary 37: padded at tp 2 and 3 when tied (an untied head needs a multiple)
    cfg = GPTConfig(
        vocab_size=37 if tie else 36, seq_len=8, hidden=24, heads=6, layers=2, tie_embeddings=tie
    )
    torch.manual_seed(0)
    plain = GPT(cfg)
    model = nbtrain.parallelize(copy.deepcopy(plain), gpt_plan(cfg))

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)

    opts = [make(plain.parameters()), make(model.parameters())]
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(5):
        idx = torch.randint(0, cfg.vocab_size, (3, 8), generator=gen)
        target = torch.randint(0, cfg.vocab_size, (3, 8), generator=gen)
        losses = []
        for net, opt in zip((plain, model), opts):
            loss = net.loss(idx, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
    state = model.state_dict()
    ref = plain.state_dict()
    state_err = max((state[k] - v).abs().max().item() for k, v in ref.items())
    fresh = GPT(cfg)
    fresh.load_state_dict(state)  # the tp model's state in a plain model
    return {
        "loss": worst,
        "state": state_err,
        "keys": sorted(state) == sorted(ref),
        "local_qkv": tuple(model.layers[0].attn.qkv.weight.shape),
    }


@pytest.mark.parametrize(
    "tp,optimizer,tie", [(2, "sgd", True), (3, "adamw", True), (2, "adamw", False)]
)
def test_parallelized_gpt_trains_like_the_plain_one(tp, optimizer, tie):
    for rank, out in enumerate(run_ranks(_train, tp, optimizer, tie, timeout_s=180)):
        assert out["loss"] < 1e-5 and out["state"] < 1e-5 and out["keys"], (rank, out)
        assert out["local_qkv"] == (3 * 24 // tp, 24)  # really split


def _errors():
    import nbtrain
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_tp import gpt_plan

    nbtrain.init_distributed(tp_size=dist.get_world_size())
    out = {}
    cfg = GPTConfig(vocab_size=36, seq_len=8, hidden=24, heads=4, layers=1)
    for key, call in (
        ("heads", lambda: nbtrain.parallelize(GPT(cfg), gpt_plan(cfg))),
        ("typo", lambda: nbtrain.parallelize(GPT(cfg), {"layer.*.mlp.0": "colwise"})),
        ("style", lambda: nbtrain.parallelize(GPT(cfg), {"tok": "colwise"})),
        (
            "layout",
            lambda: nbtrain.parallelize(GPT(cfg), gpt_plan(cfg, True), sequence_parallel=False),
        ),
        ("replicated", lambda: nbtrain.parallelize(GPT(cfg), {"head": "replicated"})),
    ):
        try:
            call()
        except ValueError as exc:
            out[key] = str(exc)
    return out


def test_bad_plans_and_indivisible_heads_are_clear_errors():
    out = run_ranks(_errors, 3, timeout_s=120)[0]
    assert out["heads"].startswith("attention has 4 heads, which tp_size 3 does not divide")
    assert out["typo"].startswith("parallelize: pattern(s) ['layer.*.mlp.0'] matched no module")
    assert out["style"] == (
        "parallelize: tok is a Embedding, not an nn.Linear, so it cannot be 'colwise'"
    )
    assert out["layout"].startswith(
        "parallelize: sequence_parallel=False, but the plan was made for sequence_parallel=True"
    )
    assert out["replicated"] == (
        "parallelize: head is a Linear; 'replicated' takes an nn.LayerNorm or an nn.Embedding"
    )


def _train_zero(tp, zero_level, optimizer, sequence_parallel=False):
    """parallelize + wrap: tensor-parallel slices ZeRO-sharded over their data-parallel
    group, replicated parameters over the world; 10 steps against one plain process."""
    import nbtrain
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_tp import gpt_plan

    topo = nbtrain.init_distributed(tp_size=tp).topology
    dp, dp_rank = topo.dp_size, topo.dp_rank
    cfg = GPTConfig(vocab_size=37, seq_len=8, hidden=24, heads=6, layers=2)
    torch.manual_seed(0)
    plain = GPT(cfg)
    plan = gpt_plan(cfg, sequence_parallel)
    model = nbtrain.parallelize(copy.deepcopy(plain), plan)
    if zero_level is not None:
        model = nbtrain.wrap(model, zero_level=zero_level)

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)

    opts = [make(plain.parameters()), make(model.parameters())]
    manager = nbtrain.optim.OptimManager()
    manager.add_optimizer(opts[1])
    gen = torch.Generator().manual_seed(1)
    loss_err = norm_err = 0.0
    for _ in range(10):
        idx = torch.randint(0, cfg.vocab_size, (6 * dp, 8), generator=gen)  # tp 2, 3 divide
        target = torch.randint(0, cfg.vocab_size, (6 * dp, 8), generator=gen)
        ref = plain.loss(idx, target)
        ref.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
        loss = model.loss(idx.chunk(dp)[dp_rank], target.chunk(dp)[dp_rank])
        loss.backward()
        norm = manager.clip_grad_norm(1e9)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss_err = max(loss_err, abs(loss.item() / dist.get_world_size() - ref.item()))
        norm_err = max(norm_err, abs(norm - ref_norm))
    state, ref_state = model.state_dict(), plain.state_dict()
    state_err = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    # A fresh sharded model takes the plain model's state (full tensors) and gives it back.
    torch.manual_seed(5)
    again = nbtrain.parallelize(GPT(cfg), gpt_plan(cfg, sequence_parallel))
    if zero_level is not None:
        again = nbtrain.wrap(again, zero_level=zero_level)
    again.load_state_dict(ref_state)
    again_state = again.state_dict()
    reload_err = max((again_state[k] - v).abs().max().item() for k, v in ref_state.items())
    stored = sum(p.numel() for p in model.parameters())
    return {
        "loss": loss_err,
        "norm": norm_err,
        "state": state_err,
        "reload": reload_err,
        "keys": sorted(state) == sorted(ref_state),
        "stored": stored,
        "total": sum(p.numel() for p in plain.parameters()),
    }


# (world, tp, zero_level): tp 2 and 3 alone, and two data-parallel replicas of tp 2 under
# ZeRO-2 and ZeRO-3; each with both optimizers and both layouts.
LAYOUTS = [(2, 2, None), (3, 3, None), (4, 2, 2), (4, 2, 3)]


@pytest.mark.parametrize(
    "world,tp,zero_level,optimizer,sequence_parallel",
    [
        (*layout, optimizer, sp)
        for layout in LAYOUTS
        for optimizer in ("adamw", "sgd")
        for sp in (False, True)
    ],
)
def test_parallelized_and_wrapped_gpt_trains_like_the_plain_one(
    world, tp, zero_level, optimizer, sequence_parallel
):
    """Megatron's layout and sequence parallel, plain (tp = world) and wrapped with ZeRO."""
    for rank, out in enumerate(
        run_ranks(_train_zero, world, tp, zero_level, optimizer, sequence_parallel, timeout_s=240)
    ):
        assert out["loss"] < 1e-5 and out["norm"] < 1e-5, (rank, out)
        assert out["keys"] and out["state"] < 1e-5 and out["reload"] < 1e-5, (rank, out)
        if zero_level is not None:  # every element stored once, give or take padding
            assert out["stored"] * world < out["total"] * 1.1, (rank, out)


def _planned_shapes(tie):
    """The planner's count of a GPT before and after `parallelize` (its slices read
    through their placement's full shape), on this tp rank."""
    import nbtrain
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_tp import gpt_plan
    from nbtrain.planner.shape import shape_of

    nbtrain.init_distributed(tp_size=2)
    cfg = GPTConfig(vocab_size=38, seq_len=8, hidden=24, heads=6, layers=2, tie_embeddings=tie)
    torch.manual_seed(0)
    plain = GPT(cfg)
    before, _ = shape_of(plain)
    after, _ = shape_of(nbtrain.parallelize(copy.deepcopy(plain), gpt_plan(cfg)))
    local = sum(p.numel() for p in nbtrain.parallelize(GPT(cfg), gpt_plan(cfg)).parameters())
    return before, after, local, sum(p.numel() for p in plain.parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_the_planner_counts_a_parallelized_model_whole(tie):
    for before, after, local, plain in run_ranks(_planned_shapes, 2, tie, timeout_s=120):
        assert local < plain  # the slices are smaller: the count must not be theirs
        assert after == before, (after, before)
        assert after.numel == plain, (after.numel, plain)
