"""The routing panel: how evenly each mixture-of-experts layer spreads its tokens.

A training forward of `nbtrain.moe.MoE` records "<label>.balance" (max / mean expert
load, 1.0 is perfect) and "<label>.dropped" (share of the assignments dropped by the
capacity limit) as telemetry metrics, labels "moe.0", "moe.1", ... in the MoE GPT.
Those names get this panel (balance per layer on the left axis, dropped share on a
twin axis) instead of the loss panel's user metrics. Up to `MAX_LAYERS_SHOWN` layers
get a line each; above that the balance is a min-max band across layers around
their median, and the dropped share the layers' worst.
"""

from __future__ import annotations

import re

from .panels_base import BAND_COLOR, SKEW_COLOR, by_step, empty, metric_by_rank, step_axis

# "moe.<i>.balance" / "moe.<i>.dropped" (a lone MoE layer's default label: "moe").
ROUTING_METRIC = re.compile(r"^(moe(?:\.\d+)?)\.(balance|dropped)$")
MAX_LAYERS_SHOWN = 8


def is_routing_metric(name: str) -> bool:
    return ROUTING_METRIC.match(name) is not None


def routing_layers(summaries: dict) -> list[str]:
    """The MoE layer labels that recorded a balance, in layer order ("moe" first)."""
    labels = set()
    for s in summaries.values():
        for row in s.get("metrics", []):
            for name in row:
                m = ROUTING_METRIC.match(name)
                if m and m.group(2) == "balance":
                    labels.add(m.group(1))
    return sorted(labels, key=lambda label: int(label.rsplit(".", 1)[1]) if label != "moe" else -1)


def _median_by_step(summaries: dict, name: str) -> dict:
    """{step: median over the ranks that recorded `name`} (ep groups may differ)."""
    steps = by_step(metric_by_rank(summaries, name))
    return {x: sorted(v)[(len(v) - 1) // 2] for x, v in steps.items()}


def draw_routing(ax, summaries: dict) -> None:
    """Balance per MoE layer over the steps, dropped share (%) on a twin axis."""
    ax.set_title("expert routing")
    labels = routing_layers(summaries)
    if not labels:
        return empty(ax, "no MoE layer recorded its routing")
    balance = {label: _median_by_step(summaries, f"{label}.balance") for label in labels}
    dropped = {label: _median_by_step(summaries, f"{label}.dropped") for label in labels}
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="even load")
    if len(labels) <= MAX_LAYERS_SHOWN:
        for i, label in enumerate(labels):
            xs = sorted(balance[label])
            ax.plot(
                xs,
                [balance[label][x] for x in xs],
                "-",
                lw=1.2,
                color=f"C{i % 10}",
                label=f"{label} balance",
            )
    else:
        import numpy as np

        steps = by_step(balance)
        xs = sorted(steps)
        lo, mid, hi = (np.array([np.percentile(steps[x], q) for x in xs]) for q in (0, 50, 100))
        ax.fill_between(
            xs,
            lo,
            hi,
            color=BAND_COLOR,
            alpha=0.25,
            lw=0,
            label=f"balance: min-max of {len(labels)} layers",
        )
        ax.plot(xs, mid, color=BAND_COLOR, lw=1.2, label="balance: median of the layers")
    ax.set_ylabel("max / mean expert load")
    step_axis(ax)
    twin = ax.twinx()
    if len(labels) <= MAX_LAYERS_SHOWN:
        for i, label in enumerate(labels):
            xs = sorted(dropped[label])
            twin.plot(
                xs,
                [100 * dropped[label][x] for x in xs],
                ":",
                lw=1.2,
                color=f"C{i % 10}",
                label=f"{label} dropped",
            )
    else:
        worst = {x: max(v) for x, v in by_step(dropped).items()}
        xs = sorted(worst)
        twin.plot(
            xs,
            [100 * worst[x] for x in xs],
            ":",
            lw=1.2,
            color=SKEW_COLOR,
            label="dropped: worst layer",
        )
    top = max((v for d in dropped.values() for v in d.values()), default=0.0)
    twin.set_ylim(0.0, max(5.0, 110 * top))
    twin.set_ylabel("assignments dropped (%)")
    last = {label: (max(b), b[max(b)]) for label, b in balance.items() if b}
    if last:
        label, (step, value) = max(last.items(), key=lambda kv: kv[1][1])
        ax.set_title(f"expert routing (step {step}: worst balance {value:.2f}x in {label})")
    ax.legend(loc="upper left", fontsize="x-small")
    twin.legend(loc="upper right", fontsize="x-small")
