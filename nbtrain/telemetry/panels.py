"""The three telemetry panels, drawn with matplotlib from per-rank summaries.

Shared by the live dashboard (`nbtrain.notebook.dashboard`) and `nbtrain report`, so the
notebook and a torchrun run show the same pictures. Input: {rank: summary} as
made by `StepLog.summary()`. Above `MAX_RANKS_SHOWN` ranks, memory and timelines
show the min / median / max ranks and the loss a median with a min-max band.
"""
from __future__ import annotations

import io
import statistics

MAX_RANKS_SHOWN = 8
COMPUTE_COLOR, COMM_COLOR, STATE_COLOR, OTHER_COLOR = "#4c72b0", "#dd8452", "#2a9d8f", "#b8c4d0"


def figure(summaries: dict, width_in: float = 13.0, height_in: float = 3.6):
    """A matplotlib Figure (no pyplot state) with memory, timeline and loss panels."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    ax_mem, ax_time, ax_loss = fig.subplots(1, 3, width_ratios=[1, 1.5, 1.3])
    summaries = {int(r): s for r, s in summaries.items() if s}
    draw_memory(ax_mem, summaries)
    draw_timeline(ax_time, summaries)
    draw_loss(ax_loss, summaries)
    return fig


def png_bytes(summaries: dict, dpi: int = 80, **kwargs) -> bytes:
    buf = io.BytesIO()
    figure(summaries, **kwargs).savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def shown_ranks(values: dict) -> list[tuple[str, int]]:
    """(label, rank) pairs to draw: every rank, or min/median/max by value above 8."""
    ranks = sorted(values)
    if len(ranks) <= MAX_RANKS_SHOWN:
        return [(f"rank {r}", r) for r in ranks]
    order = sorted(ranks, key=lambda r: (values[r] is None, values[r] or 0.0, r))
    picks = [("min", order[0]), ("median", order[(len(order) - 1) // 2]), ("max", order[-1])]
    return [(f"{name} (rank {r})", r) for name, r in picks]


def _memory_bytes(summary: dict) -> tuple[int, int, int, str]:
    """(total, model-state part, peak, what total measures) of one rank."""
    mem, peak = summary.get("memory") or {}, summary.get("peak_memory") or {}
    state = mem.get("model_state_bytes") or 0
    if "cuda_allocated_bytes" in mem:
        return (mem["cuda_allocated_bytes"], state,
                mem.get("cuda_peak_bytes", mem["cuda_allocated_bytes"]), "CUDA allocated")
    rss = mem.get("rss_bytes", 0)
    return rss, state, peak.get("rss_bytes", rss), "process RSS"


def draw_memory(ax, summaries: dict) -> None:
    mib = 2.0 ** 20
    totals = {r: _memory_bytes(s) for r, s in summaries.items() if s.get("memory")}
    ax.set_title("memory per rank")
    if not totals:
        ax.text(0.5, 0.5, "no memory samples yet", ha="center", va="center",
                transform=ax.transAxes)
        return
    rows = shown_ranks({r: t[0] for r, t in totals.items()})
    labels = [label for label, _ in rows]
    state = [totals[r][1] / mib for _, r in rows]
    other = [max(totals[r][0] - totals[r][1], 0) / mib for _, r in rows]
    ax.barh(labels, state, color=STATE_COLOR, label="model state")
    ax.barh(labels, other, left=state, color=OTHER_COLOR, label="other")
    ax.scatter([totals[r][2] / mib for _, r in rows], labels, marker="|", s=200,
               color="black", label="peak", zorder=3)
    for y, (_, r) in enumerate(rows):
        # On CPU the state of a small model is a sliver of RSS: say its size in words.
        share = totals[r][1] / max(totals[r][0], 1)
        ax.text(0.02, y, f"model state {totals[r][1] / mib:.1f} MiB ({100 * share:.0f}%)",
                transform=ax.get_yaxis_transform(), va="center", fontsize="small")
    ax.set_xlabel(f"MiB ({totals[rows[0][1]][3]})")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")


def draw_timeline(ax, summaries: dict) -> None:
    steps = {r: s["last_step"] for r, s in summaries.items() if s.get("last_step")}
    ax.set_title("last step: communication vs compute")
    if not steps:
        ax.text(0.5, 0.5, "no finished step yet", ha="center", va="center",
                transform=ax.transAxes)
        return
    rows = shown_ranks({r: st["overlap"] for r, st in steps.items()})
    for y, (label, r) in enumerate(rows):
        st = steps[r]
        ax.broken_barh([(s, e - s) for s, e, *_ in st["compute"]], (y - 0.4, 0.38),
                       color=COMPUTE_COLOR)
        ax.broken_barh([(s, e - s) for s, e, *_ in st["comm"]], (y + 0.02, 0.38),
                       color=COMM_COLOR, alpha=0.7)
        hidden = "n/a" if st["overlap"] is None else f"{100 * st['overlap']:.0f}%"
        ax.text(1.0, y, f" {hidden} hidden", transform=ax.get_yaxis_transform(),
                va="center", fontsize="small")
    ax.set_yticks(range(len(rows)), [f"{label}\nstep {steps[r]['step']}" for label, r in rows],
                  fontsize="small")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("seconds since step start (blue: compute, orange: comm)")


def _series(summary: dict, key: str):
    rows = [m for m in summary.get("metrics", []) if m.get(key) is not None]
    return [m["step"] for m in rows], [m[key] for m in rows]


def draw_loss(ax, summaries: dict) -> None:
    ax.set_title("loss")
    ax.set_xlabel("step")
    ranks = sorted(r for r, s in summaries.items() if _series(s, "loss")[0])
    if not ranks:
        ax.text(0.5, 0.5, "no loss yet", ha="center", va="center", transform=ax.transAxes)
        return
    if len(ranks) <= MAX_RANKS_SHOWN:
        for r in ranks:
            ax.plot(*_series(summaries[r], "loss"), lw=1.2, label=f"rank {r}")
    else:
        by_step: dict = {}
        for r in ranks:
            for step, v in zip(*_series(summaries[r], "loss")):
                by_step.setdefault(step, []).append(v)
        xs = sorted(by_step)
        ax.fill_between(xs, [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs],
                        alpha=0.3, label="min-max")
        ax.plot(xs, [statistics.median(by_step[x]) for x in xs], lw=1.2, label="median")
    lead = summaries[ranks[0]]
    twin = ax.twinx()
    for key, style in (("lr", "--"), ("loss_scale", ":")):
        xs, ys = _series(lead, key)
        if xs:
            twin.plot(xs, ys, style, color="gray", lw=1, label=key)
    if twin.lines:
        twin.set_yscale("log")
        twin.legend(loc="upper center", fontsize="small")
    else:
        twin.set_axis_off()
    ax.legend(loc="upper right", fontsize="small")
