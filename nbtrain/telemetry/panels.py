"""The telemetry panels, drawn with matplotlib from per-rank summaries.

Shared by the live dashboard (`nbtrain.notebook.dashboard`) and `nbtrain report`, so the
notebook and a torchrun run show the same pictures. Input: {rank: summary} as made
by `StepLog.summary()`. This file lays the figure out; `panels_train` draws the
training curves (step time with the skew between ranks, tokens/s, loss with user
metrics, grad norm, learning rate), `panels_system` memory, communication and the
last step's timeline (`pipeline_view` the pipeline's, when the ranks ran one), and
`panels_moe` the MoE layers' routing (a full-width row of its own, only when
some layer recorded it), and `panels_base` holds what they share (up to
`MAX_RANKS_SHOWN` ranks a line each, above that a min/median/max band; integer
step ticks).
"""

from __future__ import annotations

import io

from . import panels_moe as moe
from . import panels_system as system
from . import panels_train as train
from . import pipeline_view
from .panels_base import MAX_RANKS_SHOWN, shown_ranks, step_times  # noqa: F401 (public)

# Row by row, left to right; the last step's timeline takes the bottom row (the routing
# panel, when drawn, the row above it).
GRID = (
    (train.draw_step_time, train.draw_throughput, train.draw_loss),
    (train.draw_grad_norm, train.draw_lr, system.draw_hidden_share),
    (system.draw_memory, system.draw_model_state, system.draw_comm),
)


# The live dashboard draws the time series itself (nbtrain.notebook.live_panels); its
# picture holds the last step's panels only: the model state and the communication by
# kind beside the timeline.
LAST_STEP = ((system.draw_model_state, system.draw_comm),)


def figure(summaries: dict, width_in: float = 13.0, height_in: float = 11.0, grid=GRID):
    """A matplotlib Figure (no pyplot state): `grid`'s panels (3 x 3 by default) above
    the last step's timeline, with the expert-routing panel's row between them when a
    MoE layer recorded its routing (the figure then grows by that row's height, so no
    panel shrinks). With `grid=LAST_STEP` the timeline sits beside the two panels."""
    from matplotlib.figure import Figure

    summaries = {int(r): s for r, s in summaries.items() if s}
    routing = bool(moe.routing_layers(summaries))
    beside = grid is LAST_STEP
    rows = [1] * (0 if beside else len(grid)) + ([0.8] if routing else []) + [1.15]
    if routing:
        height_in *= 1 + 0.8 / (sum(rows) - 0.8)
    # Constrained layout costs ~20% of a draw (1.2 s at 2 ranks and 300 steps) but keeps
    # twin-axis labels from running into the next panel whatever the tick labels are.
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    columns = 4 if beside else 3
    spec = fig.add_gridspec(len(rows), columns, height_ratios=rows)
    if beside:
        for j, draw in enumerate(grid[0]):
            draw(fig.add_subplot(spec[len(rows) - 1, j]), summaries)
        bottom = fig.add_subplot(spec[len(rows) - 1, len(grid[0]) :])
    else:
        for i, row in enumerate(grid):
            for j, draw in enumerate(row):
                draw(fig.add_subplot(spec[i, j]), summaries)
        bottom = fig.add_subplot(spec[len(rows) - 1, :])
    if routing:
        moe.draw_routing(fig.add_subplot(spec[len(rows) - 2, :]), summaries)
    pipeline = pipeline_view.analyse(summaries)
    if pipeline is not None:  # stages and micro-batches say more than compute vs comm
        pipeline_view.draw(bottom, summaries, pipeline)
    else:
        system.draw_timeline(bottom, summaries)
    return fig


# Constrained layout is half of a picture's cost (about 1 s of 2 on a 2-core machine):
# the live dashboard draws the same panels again and again, so the positions it found
# are reused for figures of the same axes, and found afresh every LAYOUT_REUSES pictures
# (tick labels widen as numbers grow).
LAYOUT_REUSES = 20
_LAYOUTS: dict = {}


def _layout_key(fig, dpi) -> tuple:
    """The figure's shape: its size and each axes' grid cell (titles change every step)."""
    cells = tuple(
        ax.get_subplotspec().get_geometry() if ax.get_subplotspec() else None for ax in fig.axes
    )
    return (tuple(fig.get_size_inches()), dpi, cells)


# Titles one step smaller than matplotlib's "large": a title with its numbers ("step
# time per rank (skew 1.42x at step 39)") fits its panel at 80 dpi.
PANEL_RC = {"axes.titlesize": "medium"}


def png_bytes(summaries: dict, dpi: int = 80, reuse_layout: bool = True, **kwargs) -> bytes:
    """The panels as PNG; `reuse_layout` lays out like the last picture of these axes."""
    import matplotlib

    with matplotlib.rc_context(PANEL_RC):  # sizes resolve when drawn
        return _png_bytes(summaries, dpi, reuse_layout, **kwargs)


def _png_bytes(summaries: dict, dpi: int, reuse_layout: bool, **kwargs) -> bytes:
    fig = figure(summaries, **kwargs)
    key = _layout_key(fig, dpi) if reuse_layout else None
    cached = _LAYOUTS.get(key)
    if cached is not None and cached[1] < LAYOUT_REUSES:
        fig.set_layout_engine(None)
        for ax, position in zip(fig.axes, cached[0]):
            ax.set_position(position)
        _LAYOUTS[key] = (cached[0], cached[1] + 1)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    if key is not None and (cached is None or cached[1] >= LAYOUT_REUSES):
        if len(_LAYOUTS) > 16:  # a handful of panel sets per session
            _LAYOUTS.clear()
        _LAYOUTS[key] = ([ax.get_position() for ax in fig.axes], 0)
    return buf.getvalue()
