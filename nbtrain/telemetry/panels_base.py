"""What every telemetry panel shares: colours, the many-ranks rule, step axes, series.

Up to `MAX_RANKS_SHOWN` ranks get a line each; above that a curve is a median line
in a min-max band across ranks, so 64 ranks read as one. Every step axis has
integer ticks. Inputs are {rank: StepLog summary}.
"""

from __future__ import annotations

MAX_RANKS_SHOWN = 8
COMPUTE_COLOR, COMM_COLOR, STATE_COLOR = "#4c72b0", "#dd8452", "#2a9d8f"
BAND_COLOR, SKEW_COLOR = "#4c72b0", "#c44e52"  # the many-ranks band; the skew line


def shown_ranks(values: dict) -> list[tuple[str, int]]:
    """(label, rank) pairs to draw: every rank, or min/median/max by value above 8."""
    ranks = sorted(values)
    if len(ranks) <= MAX_RANKS_SHOWN:
        return [(f"rank {r}", r) for r in ranks]
    order = sorted(ranks, key=lambda r: (values[r] is None, values[r] or 0.0, r))
    picks = [("min", order[0]), ("median", order[(len(order) - 1) // 2]), ("max", order[-1])]
    return [(f"{name} (rank {r})", r) for name, r in picks]


def empty(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize="small",
        color="gray",
        wrap=True,
    )


def step_axis(ax) -> None:
    """Label the x axis "step" with integer ticks only."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))


def warm_up_range(per_rank: dict, scale: float = 1.0):
    """(lo, hi) from every step but each rank's first (compilation, allocation, the
    first gathers: often several times the rest, it flattened the other steps), when
    that first step is far above the rest; else None. Positive values stay above 0."""
    first = {rank: min(values) for rank, values in per_rank.items() if values}
    rest = [v * scale for r, values in per_rank.items() for x, v in values.items() if x != first[r]]
    firsts = [per_rank[r][x] * scale for r, x in first.items()]
    if len(rest) < 2 or max(firsts, default=0) <= max(rest) * 1.25:
        return None
    lo, hi = min(rest), max(rest)
    pad = 0.1 * (hi - lo or abs(hi) or 1.0)
    return (max(lo - pad, 0.0) if lo >= 0 else lo - pad, hi + pad)


def ignore_warm_up(ax, per_rank: dict, scale: float = 1.0) -> None:
    """Y limits of warm_up_range; the first step's point is still drawn, off the top
    when it is that far out."""
    limits = warm_up_range(per_rank, scale)
    if limits is not None:
        ax.set_ylim(*limits)


def no_offset(ax) -> None:
    """Plain tick labels (370, 371, ...), never an offset ("+3.701e2") above the axis."""
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")


def by_step(per_rank: dict) -> dict:
    """{step: [value of each rank]} from {rank: {step: value}}."""
    out: dict = {}
    for values in per_rank.values():
        for step, v in values.items():
            out.setdefault(step, []).append(v)
    return out


def draw_series(ax, per_rank: dict, scale: float = 1.0, name: str = "", **style) -> None:
    """One line per rank from {rank: {step: value}}, or a min/median/max band above 8.

    `name` prefixes the legend labels (two series on one axis); `style` goes to `plot`.
    """
    prefix = f"{name}: " if name else ""
    per_rank = {r: v for r, v in per_rank.items() if v}
    style = {"lw": 1.2, **style}
    if len(per_rank) <= MAX_RANKS_SHOWN:
        for r in sorted(per_rank):
            xs = sorted(per_rank[r])
            ax.plot(xs, [per_rank[r][x] * scale for x in xs], label=f"{prefix}rank {r}", **style)
        return
    import numpy as np

    steps = by_step(per_rank)
    xs = sorted(steps)
    lo, mid, hi = (np.array([np.percentile(steps[x], q) for x in xs]) * scale for q in (0, 50, 100))
    color = style.pop("color", BAND_COLOR)
    ax.fill_between(
        xs, lo, hi, color=color, alpha=0.25, lw=0, label=f"{prefix}min-max of {len(per_rank)} ranks"
    )
    ax.plot(xs, mid, color=color, label=f"{prefix}median of the ranks", **style)


def metric_by_rank(summaries: dict, key: str) -> dict:
    """{rank: {step: value}} of one metric name."""
    return {
        r: {m["step"]: m[key] for m in s.get("metrics", []) if m.get(key) is not None}
        for r, s in summaries.items()
    }


def lead_rank(summaries: dict) -> int:
    return min(summaries)


def step_times(summary: dict) -> dict:
    """{step: seconds}: the `step_time_s` metric where recorded, else step_end to step_end."""
    out = {row["step"]: row["duration_s"] for row in summary.get("steps", [])}
    out.update(
        {m["step"]: m["step_time_s"] for m in summary.get("metrics", []) if m.get("step_time_s")}
    )
    return out


def skew(per_rank: dict) -> dict:
    """{step: slowest / fastest} over the ranks that timed the step (two or more)."""
    return {
        step: max(v) / min(v) for step, v in by_step(per_rank).items() if len(v) > 1 and min(v) > 0
    }
