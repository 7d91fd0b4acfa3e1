"""The system panels: memory over time, model-state split, communication by kind,
hidden-comm share per step and the last step's comm-vs-compute timeline.

Same input as `panels` ({rank: StepLog summary}), same rule for many ranks: a
line per rank up to `MAX_RANKS_SHOWN`, a min/median/max band (or the min, median
and max ranks) above it.
"""

from __future__ import annotations

from .panels_base import (
    COMM_COLOR,
    COMPUTE_COLOR,
    MAX_RANKS_SHOWN,
    STATE_COLOR,
    draw_series,
    empty,
    metric_by_rank,
    no_offset,
    shown_ranks,
    step_axis,
)

MIB = 2.0**20
COMM_WINDOW_STEPS = 50  # the comm panel averages the last this many steps of each rank
SPLIT = (
    ("param_bytes", "parameters", STATE_COLOR),
    ("grad_bytes", "gradients", "#e9c46a"),
    ("optimizer_bytes", "optimizer state", "#8172b3"),
)


def memory_series(summaries: dict, key: str) -> dict:
    return {
        r: {m["step"]: m[key] for m in s.get("memory_history", []) if m.get(key) is not None}
        for r, s in summaries.items()
    }


def draw_memory(ax, summaries: dict) -> None:
    """Per rank over steps: CUDA allocated (solid) and reserved (dashed), or the RSS."""
    allocated = memory_series(summaries, "cuda_allocated_bytes")
    ax.set_title("memory per rank")
    if any(allocated.values()):
        draw_series(ax, allocated, scale=1 / MIB, name="allocated")
        ax.set_prop_cycle(None)  # reserved in the same colour as its rank's allocated
        reserved = memory_series(summaries, "cuda_reserved_bytes")
        draw_series(
            ax,
            reserved,
            scale=1 / MIB,
            name="reserved",
            ls="--",
            lw=1,
            **({"color": "#55a868"} if len(reserved) > MAX_RANKS_SHOWN else {}),
        )
        ax.set_ylabel("MiB: CUDA allocated, - - reserved")
        peak_key = "cuda_peak_bytes"
    else:
        rss = memory_series(summaries, "rss_bytes")
        if not any(rss.values()):
            return empty(ax, "no memory samples yet")
        draw_series(ax, rss, scale=1 / MIB)
        ax.set_ylabel("MiB (process RSS)")
        peak_key = "rss_bytes"
    no_offset(ax)
    peaks = [s.get("peak_memory", {}).get(peak_key) or 0 for s in summaries.values()]
    title = f"memory per rank (peak {max(peaks) / MIB:,.0f} MiB"
    by_rank = metric_by_rank(summaries, "memory_planned_bytes")
    planned = [v for per in by_rank.values() for v in per.values()]
    if planned:  # nbtrain.plan(...).publish(): the prediction beside the measured peak
        ax.axhline(max(planned) / MIB, ls=":", color="k", lw=1, label="planned")
        title += f", planned {max(planned) / MIB:,.0f} MiB"
    ax.set_title(title + ")")
    step_axis(ax)
    ax.legend(loc="best", fontsize="x-small")


def draw_model_state(ax, summaries: dict) -> None:
    """One rank's parameter shards, gradients and optimizer state, stacked, over steps;
    a line of each other rank's total (or the min-max band above 8 ranks), and a dashed
    line at the whole model's parameters (what one unsharded process would hold)."""
    totals = memory_series(summaries, "model_state_bytes")
    ax.set_title("model state per rank")
    if not any(totals.values()):
        return empty(ax, "no model state counted\n(telemetry.watch(model, optimizer))")
    last = {r: v[max(v)] for r, v in totals.items() if v}
    picks = shown_ranks(last)  # above 8 ranks: the min, median and max ranks
    lead = picks[len(picks) // 2][1] if len(last) > MAX_RANKS_SHOWN else min(last)
    rows = sorted(
        (m for m in summaries[lead]["memory_history"] if m.get("model_state_bytes") is not None),
        key=lambda m: m["step"],
    )
    xs = [m["step"] for m in rows]
    ax.stackplot(
        xs,
        *[[(m.get(k) or 0) / MIB for m in rows] for k, _, _ in SPLIT],
        labels=[f"rank {lead}: {name}" for _, name, _ in SPLIT],
        colors=[c for _, _, c in SPLIT],
        alpha=0.85,
    )
    others = {r: v for r, v in totals.items() if r != lead}
    if others:
        draw_series(ax, others, scale=1 / MIB, lw=1, color="black", alpha=0.6)
        if len(others) <= MAX_RANKS_SHOWN:
            for line in ax.lines[-len(others) :]:
                line.set_label(f"{line.get_label()} total")
    full = [m["full_param_bytes"] for m in rows if m.get("full_param_bytes")]
    if full:  # beside the rank's parameter shard, the whole model shows the sharding
        ax.axhline(
            full[-1] / MIB, color=STATE_COLOR, ls="--", lw=1.2, label="whole model's parameters"
        )
    ax.set_ylabel("MiB held by the rank")
    ax.set_ylim(bottom=0)
    step_axis(ax)
    ax.legend(loc="lower right", fontsize="x-small")


def draw_hidden_share(ax, summaries: dict) -> None:
    shares = {
        r: {step: 100 * v for step, v in s.get("overlap", []) if v is not None}
        for r, s in summaries.items()
    }
    ax.set_title("communication hidden behind compute")
    if not any(shares.values()):
        return empty(ax, "no step with communication yet")
    draw_series(ax, shares)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of comm time hidden")
    step_axis(ax)
    ax.legend(loc="lower right", fontsize="x-small")


def comm_by_kind(summary: dict, window: int = COMM_WINDOW_STEPS) -> dict:
    """{kind: (bytes per step, bytes per busy second)} over the last `window` steps."""
    rows = summary.get("steps", [])[-window:]
    sums: dict = {}
    for row in rows:
        for kind, (nbytes, busy_s) in row.get("comm", {}).items():
            acc = sums.setdefault(kind, [0, 0.0])
            acc[0] += nbytes
            acc[1] += busy_s
    return {k: (n / len(rows), n / s if s > 0 else 0.0) for k, (n, s) in sums.items()}


def _unit(values) -> tuple[float, str]:
    top = max(values, default=0)
    for div, name in ((2.0**30, "GiB"), (MIB, "MiB"), (2.0**10, "KiB")):
        if top >= div:
            return div, name
    return 1.0, "B"


def _human_bytes(n: float) -> str:
    div, unit = _unit([n])
    return f"{n / div:.3g} {unit}"


def draw_comm(ax, summaries: dict) -> None:
    """Bytes per step moved by each kind of collective, and the bandwidth it achieved
    (bytes over the seconds its collectives were in flight): median bar, min-max whisker."""
    import numpy as np

    per_rank = {r: comm_by_kind(s) for r, s in summaries.items()}
    # A kind that moved no bytes anywhere (an all-reduce of nothing) is no column.
    kinds = sorted({k for v in per_rank.values() for k, (n, _) in v.items() if n})
    ax.set_title(f"communication by kind (last {COMM_WINDOW_STEPS} steps)")
    if not kinds:
        if any(per_rank.values()):
            return empty(ax, "the collectives moved no bytes\n(one rank: nothing to exchange)")
        return empty(ax, "no communication yet")
    x = np.arange(len(kinds))
    twin = ax.twinx()
    for i, (target, offset, color) in enumerate(
        ((ax, -0.2, COMM_COLOR), (twin, 0.2, COMPUTE_COLOR))
    ):
        vals = [[v[k][i] for v in per_rank.values() if k in v] for k in kinds]
        div, unit = _unit([max(v) for v in vals])
        mid = np.array([np.median(v) for v in vals]) / div
        err = np.array(
            [
                [m - min(v) / div for m, v in zip(mid, vals)],
                [max(v) / div - m for m, v in zip(mid, vals)],
            ]
        )
        bars = target.bar(
            x + offset,
            mid,
            0.4,
            color=color,
            yerr=err if len(per_rank) > 1 else None,
            capsize=3,
            label=("per step" if i == 0 else "achieved bandwidth"),
        )
        if i == 0:  # a kind that moves a few bytes (the overflow flag) is no bare column
            target.bar_label(
                bars, [_human_bytes(np.median(v)) for v in vals], fontsize="xx-small", padding=2
            )
        # Head room: the legends sit above the bars, not over them.
        target.set_ylim(0, 1.35 * max(float(np.max(mid + err[1])), 1e-9))
        target.set_ylabel(
            f"{unit} per step (per rank)" if i == 0 else f"{unit}/s achieved", color=color
        )
    ax.set_xticks(x, [k.replace("_", "\n") for k in kinds], fontsize="small")
    ax.legend(loc="upper left", fontsize="x-small")
    twin.legend(loc="upper right", fontsize="x-small")


def draw_timeline(ax, summaries: dict) -> None:
    steps = {r: s["last_step"] for r, s in summaries.items() if s.get("last_step")}
    ax.set_title("last step: communication vs compute")
    if not steps:
        return empty(ax, "no finished step yet")
    rows = shown_ranks({r: st["overlap"] for r, st in steps.items()})
    for y, (_label, r) in enumerate(rows):
        st = steps[r]
        ax.broken_barh(
            [(s, e - s) for s, e, *_ in st["compute"]], (y - 0.4, 0.38), color=COMPUTE_COLOR
        )
        ax.broken_barh(
            [(s, e - s) for s, e, *_ in st["comm"]], (y + 0.02, 0.38), color=COMM_COLOR, alpha=0.7
        )
        hidden = "n/a" if st["overlap"] is None else f"{100 * st['overlap']:.0f}%"
        ax.text(
            1.0,
            y,
            f" {hidden} hidden",
            transform=ax.get_yaxis_transform(),
            va="center",
            fontsize="small",
        )
    spans = [span for _, r in rows for span in steps[r]["compute"] + steps[r]["comm"]]
    if spans:  # time before the first span (data loading, a sleep) would squeeze the bars
        first, last = min(s[0] for s in spans), max(s[1] for s in spans)
        ax.set_xlim(first - 0.02 * (last - first), last + 0.02 * (last - first))
    ax.set_yticks(
        range(len(rows)),
        [f"{label}\nstep {steps[r]['step']}" for label, r in rows],
        fontsize="small",
    )
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("seconds since step start (blue: compute, orange: comm)")
