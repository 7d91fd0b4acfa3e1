"""nbtrain.plan's arithmetic (one process): the ZeRO terms against the ZeRO paper's
formulas (nbtrain/planner/estimate.py writes them out), what each option moves, the
verdict, the command line. Its accuracy against measured peaks is
tests/multirank/test_plan_accuracy.py."""

import pytest
import torch

import nbtrain
from nbtrain.models.gpt import GPT, GPTConfig
from nbtrain.planner import parse_bytes
from nbtrain.planner.cli import main

CFG = GPTConfig(vocab_size=512, hidden=128, heads=4, layers=4, seq_len=64)


def _numel():
    return sum(p.numel() for p in GPT(CFG).parameters())


def test_zero3_state_is_16_bytes_per_parameter_over_ranks():
    p = nbtrain.plan(CFG, {"zero_level": 3}, batch=8, world_size=4)
    (rank,) = p.ranks
    shard = _numel() / 4
    assert rank.parameters == pytest.approx(4 * shard, abs=4)
    assert rank.gradients == pytest.approx(4 * shard, abs=4)
    assert rank.optimizer == pytest.approx(8 * shard, abs=8)
    zero2 = nbtrain.plan(CFG, {"zero_level": 2}, batch=8, world_size=4).ranks[0]
    assert zero2.parameters > 3 * rank.parameters  # the gathered blocks kept for backward


def test_meta_model_plans_like_its_config():
    with torch.device("meta"):
        model = GPT(CFG)
    a = nbtrain.plan(model, {"tp_size": 2}, batch=4, world_size=2)
    b = nbtrain.plan(CFG, {"tp_size": 2}, batch=4, world_size=2)
    assert a.ranks == b.ranks


def test_offload_checkpointing_and_pipeline_move_the_right_terms():
    base = nbtrain.plan(CFG, batch=8, world_size=2).ranks[0]
    off = nbtrain.plan(CFG, batch=8, world_size=2, offload=True).ranks[0]
    assert off.optimizer == 0 and off.host == base.optimizer
    ckpt = nbtrain.plan(CFG, batch=8, world_size=2, checkpointing=True).ranks[0]
    assert ckpt.activations < base.activations / 2
    pp = nbtrain.plan(CFG, batch=8, world_size=2, pipe_size=2, num_micro_batches=4)
    assert [r.role for r in pp.ranks] == ["stage 0", "stage 1"]
    # 1F1B: stage 0 holds 2 micro-batches in flight, the last stage 1 (and the logits).
    assert pp.ranks[0].activations != pp.ranks[1].activations


def test_fits_and_the_layouts_listing():
    p = nbtrain.plan(CFG, batch=8, world_size=2, device_memory="1GiB")
    assert p.fits and "fits in 1024 MiB" in p.table()
    assert not nbtrain.plan(CFG, batch=8, world_size=2, device_memory=1 << 20).fits
    plans = nbtrain.plan_layouts(CFG, 4, batch=8, device_memory="8MiB")
    assert [p.peak for p in plans] == sorted(p.peak for p in plans)
    assert any(p.fits for p in plans) and not all(p.fits for p in plans)
    with pytest.raises(ValueError, match="80 gigs"):
        parse_bytes("80 gigs")
    with pytest.raises(ValueError, match="tp_size 3"):
        nbtrain.plan(CFG, world_size=4, tp_size=3)


def test_command_line_prints_the_table_and_the_layouts(capsys):
    main(["--model", "gpt", "--model-size", "tiny", "--ranks", "2", "--device-memory", "80GiB"])
    out = capsys.readouterr().out
    assert "every rank" in out and "layouts over 2 ranks" in out and "yes" in out


def test_the_memory_panel_draws_a_published_plan():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nbtrain.telemetry.panels_system import draw_memory

    planned = nbtrain.plan(CFG, batch=8, world_size=2).peak
    summaries = {
        r: {
            "memory_history": [{"step": s, "rss_bytes": (300 + s) << 20} for s in range(3)],
            "metrics": [{"step": 0, "memory_planned_bytes": float(planned)}],
        }
        for r in range(2)
    }
    fig, ax = plt.subplots()
    draw_memory(ax, summaries)
    assert f"planned {planned / 2**20:,.0f} MiB" in ax.get_title()
    assert "planned" in [line.get_label() for line in ax.get_lines()]
    plt.close(fig)


def test_publish_sends_the_planned_peak_as_a_metric():
    from nbtrain.comm import events

    seen = []
    events.subscribe(seen.append)
    try:
        p = nbtrain.plan(CFG, batch=8, world_size=2)
        p.publish()
    finally:
        events.unsubscribe(seen.append)
    metrics = [e for e in seen if e["type"] == "metric"]
    assert [m["memory_planned_bytes"] for m in metrics] == [float(p.peak)]
