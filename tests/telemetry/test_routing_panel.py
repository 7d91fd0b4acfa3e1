"""The expert-routing panel: the MoE layers' "moe.<i>.balance" / "moe.<i>.dropped" metrics
get a panel of their own (balance per layer, dropped share on a twin axis) and leave
the loss panel's user metrics; without them the figure is the usual 3 x 3 grid."""

import pytest
import synthetic

from nbtrain.telemetry import panels
from nbtrain.telemetry.panels_moe import MAX_LAYERS_SHOWN
from nbtrain.telemetry.panels_train import user_metrics
from nbtrain.telemetry.steplog import StepLog

STEPS = 10


def _with_routing(world: int, layers: int, steps: int = STEPS) -> dict:
    """Synthetic summaries whose ranks also record each MoE layer's routing per step:
    layer i's balance falls from 2 + i/4 towards 1.1, layer 1 drops 5% of assignments."""
    out = {}
    for rank in range(world):
        log = StepLog()
        for event in synthetic.rank_events(rank, world, steps):
            if event["type"] == "step_end":
                step = event["step"]
                routing = {}
                for i in range(layers):
                    routing[f"moe.{i}.balance"] = 1.1 + (0.9 + i / 4) * 0.7**step
                    routing[f"moe.{i}.dropped"] = 0.05 if i == 1 else 0.0
                log.feed({"type": "metric", "t": event["t"], "step": step, **routing})
            log.feed(event)
        out[rank] = log.summary()
    return out


def _drawn(summaries):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = panels.figure(summaries)
    FigureCanvasAgg(fig).draw()
    titled = {ax.get_title().split(" (")[0]: ax for ax in fig.axes if ax.get_title()}
    return fig, titled


def _twin(fig, ax):
    twins = [o for o in fig.axes if o is not ax and ax.get_shared_x_axes().joined(ax, o)]
    assert len(twins) == 1, f"{ax.get_title()}: {len(twins)} twin axes"
    return twins[0]


def test_routing_metrics_get_their_own_panel():
    summaries = _with_routing(2, layers=2)
    assert user_metrics(summaries) == ["accuracy", "val_loss"]
    fig, ax = _drawn(summaries)
    routing = ax["expert routing"]
    # one balance line per layer (the median over the ranks), plus the even-load line
    labels = [line.get_label() for line in routing.lines]
    assert labels == ["even load", "moe.0 balance", "moe.1 balance"], labels
    assert len(routing.lines[1].get_xdata()) == STEPS
    assert routing.lines[2].get_ydata()[0] == pytest.approx(1.1 + 0.9 + 0.25)
    assert routing.get_ylabel() == "max / mean expert load"
    assert routing.get_xlabel() == "step"
    assert "worst balance" in routing.get_title() and "moe.1" in routing.get_title()
    twin = _twin(fig, routing)
    assert twin.get_ylabel() == "assignments dropped (%)"
    assert [line.get_label() for line in twin.lines] == ["moe.0 dropped", "moe.1 dropped"]
    assert list(twin.lines[1].get_ydata()) == [pytest.approx(5.0)] * STEPS
    # The loss panel lists the user metrics only; its twin axis is accuracy's.
    loss = ax["loss and metrics"]
    assert [line.get_label() for line in loss.lines] == [
        "rank 0",
        "rank 1",
        "mean, smoothed",
        "val_loss",
    ]
    assert _twin(fig, loss).get_ylabel() == "accuracy"
    assert not any(
        "moe." in line.get_label()
        for a in fig.axes
        for line in a.lines
        if a is not routing and a is not twin
    )
    # The other panels keep their places, the timeline still at the bottom.
    assert "learning rate" in ax and "last step: communication vs compute" in ax
    plain = panels.figure(synthetic.summaries(2, STEPS))
    assert fig.get_figheight() > plain.get_figheight()
    assert "expert routing" not in {a.get_title().split(" (")[0] for a in plain.axes}


def test_many_layers_draw_a_band_and_the_worst_drop():
    fig, ax = _drawn(_with_routing(2, layers=MAX_LAYERS_SHOWN + 4))
    routing = ax["expert routing"]
    assert [line.get_label() for line in routing.lines] == [
        "even load",
        "balance: median of the layers",
    ]
    assert routing.collections, "no min-max band"
    assert [line.get_label() for line in _twin(fig, routing).lines] == ["dropped: worst layer"]


def test_lone_moe_label_counts_and_look_alikes_do_not():
    summaries = {
        0: {
            "metrics": [
                {
                    "step": 0,
                    "loss": 3.0,
                    "moe.balance": 1.3,
                    "moe.dropped": 0.0,
                    "data.balance": 0.5,
                    "moe.x.balance": 2.0,
                }
            ],
            "steps": [],
            "overlap": [],
            "memory_history": [],
        }
    }
    assert user_metrics(summaries) == ["data.balance", "moe.x.balance"]
    _, ax = _drawn(summaries)
    assert [line.get_label() for line in ax["expert routing"].lines] == ["even load", "moe balance"]
