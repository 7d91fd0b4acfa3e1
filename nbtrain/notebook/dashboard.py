"""The live dashboard: a table of numbers per rank above the telemetry panels.

The panels (`nbtrain.telemetry.panels`, the same as `nbtrain report`): step time
per rank with the skew between ranks, tokens/s, loss with user metrics, grad norm,
learning rate, hidden-comm share per step, memory per rank over time, the model
state split into parameters, gradients and optimizer state, bytes and bandwidth by
collective kind, and the last step's comm-vs-compute timeline. The time series are
live curves (`live_panels`, bqplot: each update sends the lines' new data, the
browser draws them, they pan, zoom and name the line under the pointer); the last
step's panels are a picture beside them. Without bqplot the picture holds them all.

Progress is not drawn here: the cell's output has one progress bar that rank 0's
`nbtrain.progress` moves (`progress_bar`), and a second bar in the dashboard showed
the same thing twice.

It observes and owns no training state: it reads what the engines publish with
ipyparallel's data publication (`telemetry.publish_to_notebook`, a few times a
second at most) from the running cell's AsyncResult, while `%%distributed` waits.
The picture is redrawn at most once per `redraw_s` (matplotlib, same panels as
`nbtrain report`); the header table of numbers and the curves update on every poll.
"""

from __future__ import annotations

import html
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..telemetry.panels import LAST_STEP, MAX_RANKS_SHOWN, png_bytes, step_times
from ..telemetry.steplog import DEFAULT_HISTORY, thin

# Points kept per rank and per history in the notebook: as many steps as each rank
# keeps itself, thinned as the ranks thin theirs. (5000 made ~1.3M rows at 64 ranks,
# deep-copied at every redraw.)
MAX_HISTORY = DEFAULT_HISTORY

# 960 x 680 px: with the table above it, the dashboard fits a 1400 x 1000 browser
# window's notebook at 100% zoom (13 x 11 in at 72 dpi was 920 px tall with the table
# in 879 px of notebook, and its legends were 6 px; at 80 dpi they are 7.7).
PICTURE = {"dpi": 80, "width_in": 12.0, "height_in": 8.5}
# Beside the live curves (live_panels, 410 px tall) the picture is the last step's
# panels in one row: 960 x 240 px, redrawn at most every LAST_STEP_EVERY_S (a picture
# takes the kernel 0.5-1.5 s on 2 busy cores; the curves carry the news meanwhile).
LAST_STEP_PICTURE = {"dpi": 80, "width_in": 12.0, "height_in": 3.0, "grid": LAST_STEP}
LAST_STEP_EVERY_S = 5.0
# The curves move at most this often (the table on every poll): each move is the
# browser's work too, and a browser on the ranks' cores slows them.
LIVE_EVERY_S = 0.3

_CURRENT: "Dashboard | None" = None
_RETIRING: list = []  # dashboards a newer one replaced, retired after its first cell


def current() -> "Dashboard | None":
    """The dashboard that `%nbtrain dashboard` or `--dashboard` last displayed."""
    return _CURRENT


# How long a new dashboard or `%nbtrain stop` waits for the last one's picture.
SETTLE_S = 30.0


def settle(timeout_s: float = SETTLE_S) -> None:
    """Let the current dashboard finish the pictures asked for so far.

    A cell's last picture is drawn after the cell returns (it never holds the
    notebook up); `%nbtrain stop` and a new dashboard wait for it here, or the
    notebook's saved state (and a kernel shut down next) kept an empty picture.
    A drawing error is printed, not raised: the cluster's work is not the picture's.
    """
    board = _CURRENT
    if board is None:
        return
    try:
        board.wait_drawn(timeout_s)
    except FutureTimeout:
        print(f"nbtrain: the dashboard's last picture is not drawn after {timeout_s:g} s")
    except Exception as err:  # shown, never lost, never fatal
        print(f"nbtrain: the dashboard could not draw its picture: {err!r}")


def _merge_by_step(old: list, new: list) -> list:
    """Union of two step-sorted point lists, newer points winning; bounded."""
    if new and old and _step(new[-1]) < _step(old[-1]):
        return list(new)  # the step counter went back: fresh ranks, fresh history
    first = _step(new[0]) if new else None
    kept = [p for p in old if first is None or _step(p) < first]
    return thin(kept + list(new), MAX_HISTORY)  # the whole run, sparser where older


def _step(point):
    return point["step"] if isinstance(point, dict) else point[0]


class Dashboard:
    """An ipywidgets dashboard fed with per-rank telemetry summaries."""

    def __init__(self, redraw_s: float | None = None, since_cell: bool = False):
        """`since_cell`: show only the steps of the cell it was made for (a re-run of a
        training cell starts from its own data, not the previous run's tail)."""
        import ipywidgets as w

        self.redraw_s = redraw_s
        self.since_cell = since_cell
        self._first_step: dict[int, int] = {}
        self.summaries: dict[int, dict] = {}
        self.header = w.HTML(value="<i>waiting for telemetry from the ranks...</i>")
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.live = _live_panels()  # None without bqplot: the picture holds every panel
        # After a cell the picture holds every panel (what a saved or exported notebook
        # shows); this button brings the curves back, to zoom and hover.
        self.toggle = w.ToggleButton(
            description="interactive curves",
            tooltip="the live curves (pan, zoom, hover) instead of the picture",
            layout=w.Layout(display="none", width="160px"),
        )
        self.toggle.observe(self._on_toggle, "value")
        if redraw_s is None:  # the picture's default pace: once a second without curves
            self.redraw_s = 1.0 if self.live is None else LAST_STEP_EVERY_S
        parts = (
            [self.header] + ([self.toggle, self.live.widget] if self.live else []) + [self.image]
        )
        self.widget = w.VBox(parts)
        self.redraws = 0
        self.draw_seconds: deque = deque(maxlen=100)  # what each picture cost the kernel
        self.live_seconds: deque = deque(maxlen=100)  # what each live update cost it
        self._last_live = 0.0
        self.live_every_s = LIVE_EVERY_S
        self._static = False  # the picture of every panel shown, the curves hidden
        self._last_redraw = 0.0
        self._dirty = False
        self._seen: dict[int, int] = {}
        # Drawing takes 0.1-1 s (and importing matplotlib seconds): a thread draws so
        # the numbers and the cell's output keep flowing meanwhile. One short-lived
        # thread per drawing (at most one a second), not a pool: a pool's idle worker
        # outlived every dashboard of an hours-long session.
        self._drawing = _in_thread(_warm_up)
        self._lock = threading.Lock()
        self._queued: dict | None = None  # the last cell's summaries, to draw next
        self._busy = False  # a drawing thread runs (set and cleared under _lock)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def show(self) -> "Dashboard":
        """Display it and make it the one `%%distributed` cells feed."""
        global _CURRENT
        if _CURRENT is not self:
            settle()
            if _CURRENT is not None:  # retired once this one's first cell is done
                _RETIRING.append(_CURRENT)
        _CURRENT = self
        self._ipython_display_()
        return self

    def retire(self) -> None:
        """A newer dashboard took over (retired when the newer one's first cell ends):
        this one keeps its numbers and its last picture in the notebook, and lets go of
        its ranks' histories and its live curves. Each
        `%%distributed --dashboard` cell shows a new dashboard, and every old one kept
        its histories (5 MB at 3 ranks) and its curves' widgets (63) for the session."""
        self.summaries, self._queued, self._first_step, self._seen = {}, None, {}, {}
        if self.live is None:
            return
        live, self.live = self.live, None
        self.widget.children = (self.header, self.image)
        self.image.layout.display = None
        for part in (self.toggle.layout, self.toggle.style, self.toggle):
            part.close()
        live.close()

    # -- feeding ----------------------------------------------------------------
    def update(self, by_rank: dict, final: bool = False) -> None:
        """Merge new summaries {rank: summary}; redraw if due (or `final`)."""
        for rank, new in by_rank.items():
            if not new or self._seen.get(rank) == new.get("seq"):
                continue
            self._seen[rank] = new.get("seq")
            old = self.summaries.get(rank, {})
            merged = dict(new)
            first = self._first_step.setdefault(rank, self._cell_start(new))
            for key in ("metrics", "overlap", "steps", "memory_history"):
                merged[key] = _merge_by_step(old.get(key, []), new.get(key, []))
                if first:
                    merged[key] = [p for p in merged[key] if _step(p) >= first]
            if first and (merged.get("last_step") or {}).get("step", first) < first:
                merged["last_step"] = None  # the previous cell's
            self.summaries[rank] = merged
            self._dirty = True
        if final:
            while _RETIRING:  # after the cell: closing its widgets held up the first frame
                _RETIRING.pop().retire()
        if not self._dirty:
            return
        self._update_numbers()
        if self.live is not None and not final and self._static:
            self._show(static=False)  # a cell runs again: the curves come back
        if self.live is not None and (
            final or time.monotonic() - self._last_live >= self.live_every_s
        ):
            began = time.perf_counter()
            self.live.update(self.summaries)
            self._last_live = time.monotonic()
            self.live_seconds.append(time.perf_counter() - began)
        if not final and not any(s.get("metrics") for s in self.summaries.values()):
            return  # a picture of empty panels took a draw's seconds from the first real one
        now = time.monotonic()
        if final or now - self._last_redraw >= self.redraw_s:
            self._request_draw(final)

    def _cell_start(self, summary: dict) -> int:
        """The first step to show of a rank: its cell's first, with `since_cell`."""
        return (summary.get("cell_first_step") or 0) if self.since_cell else 0

    def _request_draw(self, final: bool) -> None:
        """Draw the summaries in a thread; a cell's last picture waits for the current one.

        Never blocks: drawing takes 0.1-1 s (2-5 s on a loaded 2-core machine), and a
        cell that waited for its final picture took seconds longer with the dashboard
        shown than without it (a 0.5 s cell took 5.5 s).

        The drawing gets a shallow copy: `update` replaces a rank's summary and its
        lists, never changes them in place. (A deep copy per picture was 5 MB at 3
        ranks, made and dropped every few seconds by the kernel, which kept growing.)
        """
        with self._lock:
            if self._busy:
                if final:  # drawn when the current picture is done
                    self._queued = (dict(self.summaries), final)
                return
            self._busy, self._queued = True, None
            self._drawing = _in_thread(self._draw_queue, (dict(self.summaries), final))

    def _draw_queue(self, job: tuple | None) -> None:
        try:
            while job is not None:
                self._draw(*job)
                with self._lock:
                    job, self._queued = self._queued, None
                    self._busy = job is not None
        except BaseException:
            with self._lock:
                self._busy = False
            raise

    def wait_drawn(self, timeout_s: float | None = None) -> None:
        """Wait until the pictures asked for so far are drawn."""
        self._drawing.result(timeout_s)

    def _draw(self, summaries: dict, final: bool = False) -> None:
        """The picture: beside the curves the last step's panels; a cell's last (or
        without bqplot every) picture every panel, shown instead of the curves."""
        began = time.perf_counter()
        self._dirty = False
        whole = self.live is None or final
        png = png_bytes(summaries, **(PICTURE if whole else LAST_STEP_PICTURE))
        steps = [s.get("step", 0) for s in summaries.values() if s]
        with self.image.hold_sync():  # one message: the picture and the step it shows
            self.image.value = png
            self.image._dom_classes = (f"nbtrain-step-{max(steps, default=0)}",)
        if self.live is not None and final:
            self._show(static=True)
        self.redraws += 1
        self._last_redraw = time.monotonic()
        self.draw_seconds.append(time.perf_counter() - began)

    def _show(self, static: bool) -> None:
        """The picture of every panel (after a cell) or the live curves with the last
        step's picture (while one runs)."""
        self._static = static
        self.toggle.layout.display = None if static else "none"
        with self.toggle.hold_trait_notifications():
            self.toggle.value = False
        self.live.widget.layout.display = "none" if static else None
        self.image.layout.display = None

    def _on_toggle(self, change) -> None:
        """After a cell: the curves (to zoom and hover) or the picture of every panel."""
        if not self._static:
            return
        curves = bool(change["new"])
        self.live.widget.layout.display = None if curves else "none"
        self.image.layout.display = "none" if curves else None

    def poll(self, ranks: list[int], metadata: list[dict], final: bool = False) -> None:
        """Read what each rank published into its AsyncResult metadata (`md["data"]`)."""
        self.update(
            {r: (md.get("data") or {}).get("nbtrain") for r, md in zip(ranks, metadata)},
            final=final,
        )

    def refresh(self, cluster) -> None:
        """Ask every rank for its summary now (only while no cell is running) and wait
        for the picture: `%nbtrain dashboard` asked to see it."""
        from .. import telemetry

        view = cluster.client[[cluster.engine_id(r) for r in range(cluster.world_size)]]
        summaries = view.apply_sync(telemetry.summary)
        self.update(dict(enumerate(summaries)), final=True)
        self.wait_drawn()

    # -- drawing ----------------------------------------------------------------
    def _update_numbers(self) -> None:
        rows = []
        for rank, s in sorted(self.summaries.items()):
            last = s.get("last_step") or {}
            losses = [m["loss"] for m in s.get("metrics", []) if m.get("loss") is not None]
            times = step_times(s)
            mem = s.get("memory") or {}
            rows.append(
                (
                    rank,
                    s.get("step", 0),
                    losses[-1] if losses else None,
                    times[max(times)] * 1e3 if times else None,
                    last.get("overlap"),
                    mem.get("cuda_allocated_bytes", mem.get("rss_bytes")),
                )
            )
        # A host column once the ranks span several hosts (a rank's host, or how many
        # hosts an aggregated row covers).
        hosts = {rank: s.get("host") for rank, s in self.summaries.items() if s.get("host")}
        several = len(set(hosts.values())) > 1
        if len(rows) > MAX_RANKS_SHOWN:
            rows = _aggregate(rows)
            where = {row[0]: f"{len(set(hosts.values()))} hosts" for row in rows}
        else:
            where = {row[0]: html.escape(hosts.get(row[0], "-")) for row in rows}
        cells = "".join(
            f"<tr><td>{r}</td>"
            + (f"<td>{where[r]}</td>" if several else "")
            + f"<td>{step}</td><td>{_fmt(loss, '.4f')}</td>"
            f"<td>{_fmt(ms, '.1f')} ms</td>"
            f"<td>{_fmt(None if ov is None else 100 * ov, '.0f')}%</td>"
            f"<td>{_fmt(None if mem is None else mem / 2**20, '.0f')} MiB</td></tr>"
            for r, step, loss, ms, ov, mem in rows
        )
        self.header.value = (
            "<table style='font-family:monospace'><tr><th>rank</th>"
            + ("<th>host</th>" if several else "")
            + "<th>step</th><th>loss</th><th>step time</th>"
            "<th>hidden comm</th><th>memory</th>"
            f"</tr>{cells}</table>"
        )


def _live_panels():
    """The live curves, or None where bqplot is not installed (the picture then holds
    every panel, as `nbtrain report` draws them)."""
    try:
        from .live_panels import LivePanels

        return LivePanels()
    except ImportError:
        return None


_DRAWER: ThreadPoolExecutor | None = None


def _in_thread(fn, *args) -> Future:
    """Runs fn(*args) in the dashboard's drawing thread, one for the session; its
    Future. (A thread of its own per picture gave each picture its own malloc arena:
    the kernel's native heap grew with every picture drawn, 8-12 MiB a restart.)"""
    global _DRAWER
    if _DRAWER is None:
        _DRAWER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbtrain-dashboard-draw")
    return _DRAWER.submit(fn, *args)


def _warm_up() -> None:
    import matplotlib.figure  # noqa: F401  (the first import is the slow part)


def _fmt(v, spec) -> str:
    return "-" if v is None else format(v, spec)


def _aggregate(rows):
    """min / median / max of each column over ranks (above MAX_RANKS_SHOWN)."""
    out = []
    for name, pick in (("min", min), ("median", statistics.median_low), ("max", max)):
        cols = []
        for i in range(1, 6):
            vals = [row[i] for row in rows if row[i] is not None]
            cols.append(pick(vals) if vals else None)
        out.append((name, *cols))
    return out
