"""The dashboard's live curves: bqplot figures whose lines take each new point as the
ranks publish it.

The browser draws them (d3, in the bqplot widget): an update sends the lines' new
values, a few kilobytes, and no picture, so the curves keep up with the table above
them and cost the notebook's kernel milliseconds, not the seconds a PNG of the whole
history took. Each panel pans and zooms (drag, wheel; double-click resets) and names
the line under the pointer.

The panels are the time series of `nbtrain.telemetry.panels` (step time, tokens/s,
loss, gradient norm, learning rate, hidden communication, memory), fed by the same
helpers, so the live view and `nbtrain report`'s picture agree; the last step's panels
(model state, communication by kind, the timeline) stay a picture beside them.
"""

from __future__ import annotations

import numpy as np

from ..telemetry.panels_base import (
    MAX_RANKS_SHOWN,
    by_step,
    metric_by_rank,
    step_times,
    warm_up_range,
)
from ..telemetry.panels_system import MIB, memory_series
from ..telemetry.panels_train import smoothed, throughput_total

# 4 x 2 panels of 235 x 205 px: with the table and the last step's picture the
# dashboard fits a 1400 x 1000 window's notebook at 100% zoom.
PANEL_PX = (235, 205)
COLUMNS = 4
# Points sent per line: above this the older points are thinned to every k-th (the
# newest TAIL kept whole), so an update stays a few kilobytes however long the run
# (2000 steps x 21 lines, five times a second, kept Chromium busy on 2 cores).
MAX_POINTS = 400
TAIL = 100
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
MEAN_COLOR = "black"


def _per_rank_lines(per_rank: dict, scale: float = 1.0) -> dict:
    """{label: (steps, values)}: a line per rank, or min / median / max of the ranks
    above MAX_RANKS_SHOWN."""
    per_rank = {r: v for r, v in per_rank.items() if v}
    if len(per_rank) <= MAX_RANKS_SHOWN:
        out = {}
        for r in sorted(per_rank):
            xs = sorted(per_rank[r])
            out[f"rank {r}"] = (xs, [per_rank[r][x] * scale for x in xs])
        return out
    steps = by_step(per_rank)
    xs = sorted(steps)
    return {
        name: (xs, [float(np.percentile(steps[x], q)) * scale for x in xs])
        for name, q in (("min of the ranks", 0), ("median of the ranks", 50), ("max", 100))
    }


def thinned(xs, ys):
    """(xs, ys) as float32 arrays of at most MAX_POINTS points: the last TAIL whole,
    the older ones every k-th."""
    xs, ys = np.asarray(xs, dtype=np.float32), np.asarray(ys, dtype=np.float32)
    if len(xs) <= MAX_POINTS:
        return xs, ys
    old = len(xs) - TAIL
    keep = np.r_[np.arange(0, old, -(-old // (MAX_POINTS - TAIL))), np.arange(old, len(xs))]
    return xs[keep], ys[keep]


def step_time(summaries: dict):
    times = {r: step_times(s) for r, s in summaries.items()}
    lines = _per_rank_lines(times, 1e3)
    ratio = {x: max(v) / min(v) for x, v in by_step(times).items() if len(v) > 1 and min(v) > 0}
    title = "step time per rank (ms)"
    if ratio:
        last = max(ratio)
        title = f"step time, ms (skew {ratio[last]:.2f}x at step {last})"
    return title, lines, warm_up_range(times, 1e3)


def throughput(summaries: dict):
    tokens = metric_by_rank(summaries, "tokens")
    if not any(any(v.values()) for v in tokens.values()):
        tokens = metric_by_rank(summaries, "batch_tokens")
    has_tokens = any(any(v.values()) for v in tokens.values())
    per_rank, times_of = {}, {}
    for r, s in summaries.items():
        times = times_of[r] = step_times(s)
        if has_tokens:
            per_rank[r] = {x: n / times[x] for x, n in tokens[r].items() if times.get(x)}
        else:
            per_rank[r] = {x: 1.0 / t for x, t in times.items() if t > 0}
    unit = "tokens/s" if has_tokens else "steps/s"
    title = f"{unit} per rank"
    if any(per_rank.values()):
        title = f"{unit} ({throughput_total(times_of, tokens, has_tokens)})"
    return title, _per_rank_lines(per_rank), warm_up_range(per_rank)


def loss(summaries: dict):
    per_rank = metric_by_rank(summaries, "loss")
    lines = _per_rank_lines(per_rank)
    mean = {x: sum(v) / len(v) for x, v in by_step(per_rank).items()}
    if len(mean) > 1:
        xs = sorted(mean)
        lines["mean, smoothed"] = (xs, smoothed([mean[x] for x in xs]))
    title = "loss"
    if mean:
        title = f"loss (mean {mean[max(mean)]:.4f} at step {max(mean)})"
    return title, lines, None


def grad_norm(summaries: dict):
    return "gradient norm (L2)", _per_rank_lines(metric_by_rank(summaries, "grad_norm")), None


def learning_rate(summaries: dict):
    if not summaries:
        return "learning rate", {}, None
    lead = summaries[min(summaries)]
    lr = metric_by_rank({0: lead}, "lr")[0]
    xs = sorted(lr)
    if not xs:
        return "learning rate", {}, None
    ys = [lr[x] for x in xs]
    # From 0: a constant rate is a line at its height, not two ticks of one value at
    # the bottom of a zero-height range; a warm-up starts at the floor.
    top = max(ys)
    y_range = (0.0, 1.1 * top) if top > 0 else None
    return f"learning rate ({ys[-1]:.3g})", {"lr": (xs, ys)}, y_range


def hidden_share(summaries: dict):
    shares = {
        r: {x: 100 * v for x, v in s.get("overlap", []) if v is not None}
        for r, s in summaries.items()
    }
    return "comm hidden behind compute (%)", _per_rank_lines(shares), (0.0, 100.0)


def memory(summaries: dict):
    series = memory_series(summaries, "cuda_allocated_bytes")
    what = "CUDA allocated"
    if not any(series.values()):
        series, what = memory_series(summaries, "rss_bytes"), "process RSS"
    return f"memory per rank, MiB ({what})", _per_rank_lines(series, 1 / MIB), None


PANELS = (step_time, throughput, loss, grad_norm, learning_rate, hidden_share, memory)
EMPTY = {
    "step_time": "no finished step yet",
    "throughput": "no finished step yet",
    "loss": "no loss yet",
    "grad_norm": "no grad_norm recorded (OptimManager.step records it)",
    "learning_rate": "no lr recorded",
    "hidden_share": "no step with communication yet",
    "memory": "no memory samples yet",
}


class LivePanels:
    """The grid of live curves; `update(summaries)` moves every line to the new data."""

    def __init__(self):
        import bqplot as bq
        import ipywidgets as w

        self._bq = bq
        self._widget_type = w.Widget
        self._tooltip = bq.Tooltip(fields=["name"], labels=["line"])  # shared by every line
        self.figures, self._lines, self._scales = [], [], []
        width, height = PANEL_PX
        for panel in PANELS:
            x, y = bq.LinearScale(), bq.LinearScale()
            axes = [
                bq.Axis(scale=x, label="step", tick_format="d", num_ticks=4),
                # Plain numbers (10,780, 0.003), never an exponent or an offset.
                bq.Axis(scale=y, orientation="vertical", tick_format=",.4~r", num_ticks=4),
            ]
            fig = bq.Figure(
                marks=[],
                axes=axes,
                title=EMPTY[panel.__name__],
                fig_margin={"top": 30, "bottom": 32, "left": 56, "right": 14},
                layout=w.Layout(width=f"{width}px", height=f"{height}px"),
                title_style={"font-size": "11px"},
                interaction=bq.interacts.PanZoom(scales={"x": [x], "y": [y]}),
                animation_duration=0,
            )
            self.figures.append(fig)
            self._lines.append({})
            self._scales.append((x, y))
        # One legend for every panel (a line's colour is its rank's everywhere); a
        # legend in each panel covered its curves.
        self.legend = w.HTML()
        self._colors: dict[str, str] = {}
        grid = w.GridBox(
            self.figures,
            layout=w.Layout(grid_template_columns=f"repeat({COLUMNS}, {width}px)"),
        )
        # A Box, not a VBox: the dashboard is the page's last VBox with a table in it.
        self.widget = w.Box([self.legend, grid], layout=w.Layout(flex_flow="column"))
        self.widget.add_class("nbtrain-live")
        self.step = 0

    def close(self) -> None:
        """Close every widget of the curves (figures, their marks, axes, scales and
        interactions, the legend): their models leave the kernel and the page."""
        parts = [self.widget, self.legend, self._tooltip, *self.widget.children[1:]]
        for fig in self.figures:
            parts += [fig, fig.interaction, fig.scale_x, fig.scale_y, *fig.marks, *fig.axes]
        parts += [scale for pair in self._scales for scale in pair]
        parts += [getattr(part, k, None) for part in parts for k in ("layout", "style")]
        for part in parts:
            if isinstance(part, self._widget_type):
                part.close()
        self.figures, self._lines, self._scales = [], [], []

    def update(self, summaries: dict) -> None:
        """New data to every panel's lines (a line per new rank is added once)."""
        steps = [s.get("step", 0) for s in summaries.values() if s]
        for i, panel in enumerate(PANELS):
            title, lines, y_range = panel(summaries)
            self._update_panel(i, panel.__name__, title, lines, y_range)
        self.step = max(steps, default=0)
        # After the lines' data: the browser reads this class once they are drawn.
        self.widget._dom_classes = ("nbtrain-live", f"nbtrain-live-step-{self.step}")

    def _color(self, label: str) -> str:
        if label.startswith("mean"):
            return MEAN_COLOR
        if label == "lr":  # the lead rank's: not a rank line of its own
            return COLORS[0]
        if label not in self._colors:
            self._colors[label] = COLORS[len(self._colors) % len(COLORS)]
            self.legend.value = "&nbsp;&nbsp;".join(
                f"<span style='color:{c}'>&#9473;&#9473;</span> {name}"
                for name, c in [*self._colors.items(), ("mean, smoothed (loss)", MEAN_COLOR)]
            )
        return self._colors[label]

    def _update_panel(self, i: int, name: str, title: str, lines: dict, y_range) -> None:
        fig, marks = self.figures[i], self._lines[i]
        x_scale, y_scale = self._scales[i]
        added = False
        for label, (xs, ys) in lines.items():
            xs, ys = thinned(xs, ys)
            mark = marks.get(label)
            if mark is None:
                mean = label.startswith("mean")
                mark = marks[label] = self._bq.Lines(
                    x=xs,
                    y=ys,
                    scales={"x": x_scale, "y": y_scale},
                    labels=[label],
                    colors=[self._color(label)],
                    stroke_width=2.2 if mean else 1.3,
                    opacities=[1.0 if mean or len(lines) < 3 else 0.7],
                    tooltip=self._tooltip,
                )
                added = True
                continue
            with mark.hold_sync():
                mark.x, mark.y = xs, ys
        if added:
            fig.marks = list(marks.values())
        lo, hi = y_range if y_range else (None, None)
        if (y_scale.min, y_scale.max) != (lo, hi):
            with y_scale.hold_sync():
                y_scale.min, y_scale.max = lo, hi
                y_scale.allow_padding = y_range is None  # a set range is the range
        title = title if lines else EMPTY[name]
        if fig.title != title:
            fig.title = title
