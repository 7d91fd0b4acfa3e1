"""AdamOptimizer + OptimManager on real gloo ranks against torch.optim.Adam in one process
(fp32 parameters take weight decay as L2, as in BMTrain).

One run_ranks call per world size runs every scenario; the checks happen here.
"""

import math

import optim_cases as oc
import pytest
import torch
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain.optim import AdamOffloadOptimizer

STEPS = 20
ACCUM = 4


def _padding_is_zero(model) -> bool:
    ok = True
    for block in model.layers:
        for group in block.groups:
            begin, _ = group.layout.shard_range(nbt.rank())
            real = max(0, group.layout.numel - begin)
            ok &= bool((group.shard.detach()[real:] == 0).all())
    return ok


def _parity():
    model, opt, manager = oc.sharded_setup()
    losses, _ = oc.sharded_train(model, manager, STEPS)
    state = model.state_dict()
    off_model, _, off_manager = oc.sharded_setup(optimizer_cls=AdamOffloadOptimizer)
    oc.sharded_train(off_model, off_manager, STEPS)
    off_state = off_model.state_dict()
    return dict(
        losses=losses,
        state=state,
        padding_zero=_padding_is_zero(model),
        offload_equal=all(torch.equal(state[k], off_state[k]) for k in state),
        loss_scale=manager.loss_scale,
        skipped=manager.num_skipped,
    )


def _half(dtype):
    model, opt, manager = oc.sharded_setup(dtype=dtype)
    losses, _ = oc.sharded_train(model, manager, STEPS)
    masters_ok = True
    for group in opt.param_groups:
        for p in group["params"]:
            master = opt.state[p]["master"]
            masters_ok &= (
                p.dtype == dtype
                and master.dtype == torch.float32
                and opt.state[p]["exp_avg"].dtype == torch.float32
                and torch.equal(p.detach(), master.to(dtype))
            )
    flat_main_grad = any(
        getattr(g.shard, "main_grad", None) is not None for b in model.layers for g in b.groups
    )
    return dict(
        losses=losses,
        state=model.state_dict(),
        masters_ok=masters_ok,
        flat_main_grad_fp32=flat_main_grad,
    )


def _clip(norm_type):
    model, opt, manager = oc.sharded_setup(loss_scale=2.0**8)
    _, norms = oc.sharded_train(model, manager, 3, clip=0.05, norm_type=norm_type)
    return dict(norms=norms, state=model.state_dict())


def _recorded_norm():
    """No clip_grad_norm call: the manager still records each step's global norm (of
    the unscaled gradients, in the overflow check's all-reduce)."""
    model, opt, manager = oc.sharded_setup(loss_scale=2.0**8)
    norms = []
    for s in range(3):
        oc.sharded_train(model, manager, 1, start=s, total=3)
        norms.append(nbt.telemetry.RECORDER.last_metric("grad_norm"))
    return norms


def _accumulate():
    model, opt, manager = oc.sharded_setup()
    rows = oc.GLOBAL_BATCH * ACCUM
    xs, ys = oc.global_batches(3, rows)
    per = oc.GLOBAL_BATCH // nbt.world_size()
    for s in range(3):
        manager.zero_grad()
        for k in range(ACCUM):
            lo = k * oc.GLOBAL_BATCH + nbt.rank() * per
            manager.backward(model.loss(xs[s, lo : lo + per], ys[s, lo : lo + per]) / ACCUM)
        manager.step()
    return model.state_dict()


def _overflow():
    model, opt, manager = oc.sharded_setup(loss_scale=2.0**10, loss_scale_steps=3)
    oc.sharded_train(model, manager, 1)
    xs, ys = oc.global_batches(5)
    rows = oc.my_rows()
    manager.zero_grad()
    manager.backward(model.loss(xs[1, rows], ys[1, rows]))
    if nbt.rank() == nbt.world_size() - 1:  # inf on one rank only
        model.layers[1].groups[0].shard.grad[3] = float("inf")
    before = oc.shard_snapshot(opt)
    applied = manager.step()
    after = oc.shard_snapshot(opt)
    unchanged = all(
        torch.equal(p0, p1)
        and s0.keys() == s1.keys()
        and all(torch.equal(s0[k], s1[k]) if torch.is_tensor(s0[k]) else s0[k] == s1[k] for k in s0)
        for (p0, s0), (p1, s1) in zip(before, after)
    )
    scale_after_skip = manager.loss_scale
    scales = []
    for s in range(2, 5):
        manager.zero_grad()
        manager.backward(model.loss(xs[s, rows], ys[s, rows]))
        manager.step()
        scales.append(manager.loss_scale)
    # OptimManager.step's own metric events (wrap's token counts are events of their own)
    metrics = [m for m in nbt.telemetry.RECORDER.snapshot("metric") if "skipped" in m][-4:]
    return dict(
        applied=applied,
        unchanged=unchanged,
        scale_after_skip=scale_after_skip,
        scales=scales,
        skipped=manager.num_skipped,
        metric_skipped=[m["skipped"] for m in metrics],
        metric_scales=[m["loss_scale"] for m in metrics],
        metric_keys=set(metrics[0]),
    )


def _manager_state_dict():
    """bf16: manager.state_dict() moved to a fresh run continues bit for bit."""
    a_model, a_opt, a_manager = oc.sharded_setup(dtype=torch.bfloat16, scheduler=True)
    oc.sharded_train(a_model, a_manager, 3, total=5)
    b_model, b_opt, b_manager = oc.sharded_setup(dtype=torch.bfloat16, scheduler=True)
    b_model.load_state_dict(a_model.state_dict(), strict=False)
    b_manager.load_state_dict(a_manager.state_dict())
    masters_fp32 = all(st["master"].dtype == torch.float32 for st in b_opt.state.values())
    a_losses, _ = oc.sharded_train(a_model, a_manager, 2, start=3)
    b_losses, _ = oc.sharded_train(b_model, b_manager, 2, start=3)
    equal = all(torch.equal(x, y) for x, y in zip(a_model.parameters(), b_model.parameters()))
    return dict(equal=equal and a_losses == b_losses, masters_fp32=masters_fp32)


def _suite():
    out = dict(
        parity=_parity(),
        bf16=_half(torch.bfloat16),
        fp16=_half(torch.float16),
        clip2=_clip(2.0),
        clipinf=_clip(math.inf),
        recorded_norm=_recorded_norm(),
        accum=_accumulate(),
        overflow=_overflow(),
        resume=_manager_state_dict(),
    )
    if nbt.rank() != 0:  # only the per-rank overflow verdicts matter beyond rank 0
        return dict(overflow=out["overflow"])
    return out


def _assert_state_close(state, ref, atol, rtol, what):
    assert list(state) == list(ref), what
    for name, v in ref.items():
        torch.testing.assert_close(
            state[name].float(),
            v,
            atol=atol,
            rtol=rtol,
            msg=lambda m, name=name: f"{what} {name}: {m}",
        )


@pytest.fixture(scope="module")
def references():
    return dict(
        plain=oc.plain_train(STEPS),
        plain_decoupled=oc.plain_train(STEPS, decoupled=True),
        clip2=oc.plain_train(3, clip=0.05),
        clipinf=oc.plain_train(3, clip=0.05, norm_type=math.inf),
        unclipped=oc.plain_train(3, clip=math.inf),  # the norm, nothing clipped
        accum=oc.plain_train(3, rows=oc.GLOBAL_BATCH * ACCUM),
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_optimizer_manager_on_ranks(world_size, references):
    results = run_ranks(_suite, world_size, timeout_s=300)
    res = results[0]
    ref_losses, _, ref_state = references["plain"]

    # fp32: equals torch.optim.Adam in one process, 20 steps, with loss scaling.
    par = res["parity"]
    assert par["losses"] == pytest.approx(ref_losses, abs=1e-5)
    _assert_state_close(par["state"], ref_state, 1e-5, 1e-5, "fp32")
    assert par["padding_zero"] and par["skipped"] == 0 and par["loss_scale"] == 2.0**10
    assert par["offload_equal"], "AdamOffloadOptimizer differs from AdamOptimizer on CPU"

    # bf16 parameters, fp32 master and fp32 gradient reduction; weight decay decoupled
    # for half parameters (BMTrain's kernels): the fp32 reference is AdamW's.
    ref_losses, _, ref_state = references["plain_decoupled"]
    bf = res["bf16"]
    assert bf["masters_ok"] and bf["flat_main_grad_fp32"]
    # The bf16 loss itself is rounded to 8 bits of mantissa (steps of 1/32 near 5.5).
    assert bf["losses"] == pytest.approx(ref_losses, rel=2e-2)
    _assert_state_close(bf["state"], ref_state, 2e-2, 2e-2, "bf16")
    mean_err = torch.cat(
        [(bf["state"][k].float() - v).abs().flatten() for k, v in ref_state.items()]
    ).mean()
    print(f"bf16 vs fp32 after {STEPS} steps: mean |dparam| {mean_err:.2e}")
    assert mean_err < 2e-3, mean_err

    # fp16 parameters (10 mantissa bits), same master/reduction scheme, loss-scaled.
    fp = res["fp16"]
    assert fp["masters_ok"] and fp["flat_main_grad_fp32"]
    assert fp["losses"] == pytest.approx(ref_losses, rel=5e-3)
    _assert_state_close(fp["state"], ref_state, 5e-3, 5e-3, "fp16")

    # clip_grad_norm equals torch.nn.utils.clip_grad_norm_ on the plain model.
    for key in ("clip2", "clipinf"):
        _, ref_norms, ref_clip_state = references[key]
        assert res[key]["norms"] == pytest.approx(ref_norms, rel=1e-5), key
        _assert_state_close(res[key]["state"], ref_clip_state, 1e-5, 1e-5, key)

    # Without clipping, the norm the manager records (for the dashboard) is torch's.
    assert res["recorded_norm"] == pytest.approx(references["unclipped"][1], rel=1e-5)

    # Four accumulated micro-batches equal one batch of four times the size.
    _assert_state_close(res["accum"], references["accum"][2], 1e-5, 1e-5, "accum")

    assert res["resume"] == dict(equal=True, masters_fp32=True)

    # inf on one rank: every rank skips, nothing changes, the scale halves then grows.
    for rank, r in enumerate(results):
        ov = r["overflow"]
        assert ov["applied"] is False and ov["unchanged"], rank
        assert ov["scale_after_skip"] == 2.0**9, rank
        assert ov["scales"] == [2.0**9, 2.0**9, 2.0**10], rank
        assert ov["skipped"] == 1, rank
        assert ov["metric_skipped"] == [True, False, False, False], rank
        assert ov["metric_scales"] == [2.0**10, 2.0**9, 2.0**9, 2.0**9], rank
        assert {"loss", "lr", "loss_scale", "grad_norm", "skipped", "step_time_s"} <= ov[
            "metric_keys"
        ], rank


def _float64_norm():
    model, opt, manager = oc.sharded_setup(dtype=torch.float64, loss_scale=None)
    oc.sharded_train(model, manager, 1)
    return nbt.telemetry.RECORDER.last_metric("grad_norm")


def test_a_float64_model_steps_and_records_its_norm():
    # torch refuses a float32 norm of float64 gradients: every step of such a model
    # raised once the manager computed the norm at each step.
    model = oc.cases.plain_model().double()
    xs, ys = oc.global_batches(1)
    model.loss(xs[0], ys[0]).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
    (got,) = run_ranks(_float64_norm, 1)
    assert got == pytest.approx(want, rel=1e-6)
