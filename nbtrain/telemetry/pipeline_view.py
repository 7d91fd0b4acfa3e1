"""The pipeline's last step: each stage's micro-batches on one time axis, and its bubble.

`nbtrain.pipeline.run` records each micro-batch's forward and backward as a compute
span labelled "stage{s}.mb{i}" ("stage{s}.v{v}.mb{i}" for chunk v of an interleaved
schedule). From the last step's spans of every rank (`StepLog.summary()`), `analyse`
finds the stages, the micro-batch count M and the chunks V, and measures the bubble:
the share of the schedule's window (first forward on any stage to last backward) in
which a stage computes nothing. The theory's bubble, for equal stages and free
transfers, is (P - 1) / (V * M + P - 1); the measured one also counts the transfers
and unequal stages. `draw` makes the dashboard's and `nbtrain report`'s panel.
"""

from __future__ import annotations

import re
import statistics

from .panels_base import empty

LABEL = re.compile(r"^stage(\d+)(?:\.v(\d+))?\.mb(\d+)$")
FORWARD_COLOR, BACKWARD_COLOR, P2P_COLOR = "tab:blue", "tab:green", "tab:orange"


def theory(stages: int, micro: int, virtual: int = 1) -> float:
    """The bubble of a schedule with equal stages and free transfers."""
    return (stages - 1) / (virtual * micro + stages - 1)


def analyse(summaries: dict) -> dict | None:
    """The pipeline in the ranks' last steps, or None if no rank ran one.

    Returns:
        {"ranks": {rank: {"stage", "spans": [(start, end, mb, chunk, phase)],
                          "p2p": [(start, end)], "bubble", "step"}},
         "stages" (P), "micro" (M), "virtual" (V), "window": (start, end),
         "bubble": the mean over ranks, "theory"}
    """
    ranks = {}
    for r, summary in sorted(summaries.items()):
        step = (summary or {}).get("last_step")
        if not step:
            continue
        spans, stage = [], None
        for start, end, label, phase in step["compute"]:
            match = LABEL.match(label)
            if match:
                stage = int(match.group(1))
                spans.append((start, end, int(match.group(3)), int(match.group(2) or 0), phase))
        if spans:
            p2p = [(s, e) for s, e, kind, *_ in step["comm"] if kind == "p2p"]
            ranks[r] = {"stage": stage, "spans": spans, "p2p": p2p, "step": step["step"]}
    if not ranks:
        return None
    every = [s for info in ranks.values() for s in info["spans"]]
    window = (min(s[0] for s in every), max(s[1] for s in every))
    length = window[1] - window[0]
    for info in ranks.values():
        busy = sum(e - s for s, e, *_ in info["spans"])
        info["bubble"] = max(0.0, 1.0 - busy / length) if length > 0 else 0.0
    stages = 1 + max(info["stage"] for info in ranks.values())
    micro = 1 + max(s[2] for s in every)
    virtual = 1 + max(s[3] for s in every)
    return {
        "ranks": ranks,
        "stages": stages,
        "micro": micro,
        "virtual": virtual,
        "window": window,
        "bubble": statistics.mean(i["bubble"] for i in ranks.values()),
        "theory": theory(stages, micro, virtual),
    }


def describe(info: dict) -> str:
    """One line: the layout, the measured bubble beside the theory's, per stage."""
    v = f" x {info['virtual']} chunks" if info["virtual"] > 1 else ""
    per_stage: dict = {}
    for r in info["ranks"].values():
        per_stage.setdefault(r["stage"], []).append(r["bubble"])
    stages = ", ".join(
        f"stage {s} {100 * statistics.mean(b):.0f}%" for s, b in sorted(per_stage.items())
    )
    formula = f"(P-1)/({'V*' if info['virtual'] > 1 else ''}M+P-1)"
    return (
        f"pipeline: {info['stages']} stages{v}, {info['micro']} micro-batches; "
        f"bubble {100 * info['bubble']:.1f}% measured ({stages}), "
        f"{100 * info['theory']:.1f}% in theory {formula}"
    )


def draw(ax, summaries: dict, info: dict | None = None) -> None:
    """Each rank's micro-batches in the last step: forward blue, backward green, the
    transfers thin orange below; the gaps are the bubble."""
    info = analyse(summaries) if info is None else info
    ax.set_title("last step: pipeline stages and their bubble")
    if info is None:
        return empty(ax, "no pipeline step yet")
    rows = sorted(info["ranks"].items(), key=lambda kv: (kv[1]["stage"], kv[0]))
    start, end = info["window"]
    for y, (_r, rank) in enumerate(rows):
        for phase, color in (("forward", FORWARD_COLOR), ("backward", BACKWARD_COLOR)):
            bars = [(s, e - s) for s, e, _, _, p in rank["spans"] if p == phase]
            ax.broken_barh(bars, (y - 0.4, 0.6), color=color)
        ax.broken_barh(
            [(s, e - s) for s, e in rank["p2p"]], (y + 0.25, 0.15), color=P2P_COLOR, alpha=0.8
        )
        if len(rank["spans"]) <= 64:  # the micro-batch in each bar, while they fit
            for s, e, mb, chunk, _ in rank["spans"]:
                text = f"{mb}" if info["virtual"] == 1 else f"{mb}.{chunk}"
                ax.text(
                    (s + e) / 2,
                    y - 0.1,
                    text,
                    ha="center",
                    va="center",
                    fontsize="x-small",
                    color="white",
                    clip_on=True,
                )
        ax.text(
            1.0,
            y,
            f" {100 * rank['bubble']:.0f}% idle",
            transform=ax.get_yaxis_transform(),
            va="center",
            fontsize="small",
        )
    ax.set_yticks(
        range(len(rows)), [f"rank {r}\nstage {rank['stage']}" for r, rank in rows], fontsize="small"
    )
    ax.set_ylim(len(rows) - 0.5, -0.5)
    margin = 0.02 * (end - start)
    ax.set_xlim(start - margin, end + margin)
    ax.set_xlabel(
        f"seconds since step start (forward blue, backward green, transfers orange); "
        f"bubble {100 * info['bubble']:.0f}% measured, {100 * info['theory']:.0f}% "
        f"in theory"
    )
