"""The cell's progress bar in the notebook: one tqdm bar that the ranks' loop moves.

On an engine, `nbtrain.progress` draws nothing: the rank that owns the bar publishes
its count with the telemetry (`summary["progress"]`, a few times a second), and
`%%distributed` (the wait loop in `cell_run`) moves one tqdm bar here, in the cell's
output: tqdm's widget in Jupyter, a text bar in a terminal. A new loop (another
`nbtrain.progress` in the same cell) closes the bar and opens the next.

A finished widget bar becomes its last line of text in the cell's output, and its
widgets are closed: each bar is 11 widgets (a box, a progress bar, two labels, their
layouts and styles) that the kernel would otherwise keep for the rest of the session
(~11 widgets a training cell). The text is also what a saved notebook shows.
"""

from __future__ import annotations

import weakref

# widget bar -> the display handle of its output (a text bar has none)
_DISPLAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CellProgress:
    """The bar of the newest `nbtrain.progress` loop that a rank of the cell publishes."""

    def __init__(self, metadata: list[dict]):
        self.metadata = metadata  # the cell's per-rank metadata, filled as it runs
        self.bar = None
        self.loop = None  # the id of the loop the bar shows

    def update(self, final: bool = False) -> None:
        """Move the bar to the published count; at `final` (or a loop's end) close it."""
        published = self._published()
        if published is not None and published.get("id") != self.loop:
            self.close()
            self.bar = _new_bar(published)
            self.loop = published.get("id")
        if published is not None and self.bar is not None:  # None: that loop is done
            n = int(published.get("n") or 0)
            if published.get("loss") is not None:
                self.bar.set_postfix(loss=f"{published['loss']:.4f}", refresh=False)
            if n > self.bar.n:
                self.bar.update(n - self.bar.n)  # tqdm's own rate and redraw interval
            if published.get("done"):
                self.close()
        if final:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.refresh()
            self.bar.close()
            _to_text(self.bar)
            self.bar = None

    def _published(self) -> dict | None:
        for md in self.metadata:
            summary = (md.get("data") or {}).get("nbtrain") or {}
            if summary.get("progress"):
                return summary["progress"]
        return None


def _new_bar(published: dict):
    from tqdm.auto import tqdm

    kwargs = {
        "total": published.get("total"),
        "desc": published.get("desc"),
        "unit": published.get("unit") or "it",
    }
    from tqdm.notebook import tqdm as widget_tqdm

    if not issubclass(tqdm, widget_tqdm):  # a terminal's text bar
        return tqdm(**kwargs)
    from IPython.display import display

    bar = tqdm(**kwargs, display=False)  # tqdm's widget, shown where it can be replaced
    _DISPLAYS[bar] = display(bar.container, display_id=True)
    return bar


def _to_text(bar) -> None:
    """A closed widget bar: its output becomes its last line, its widgets are closed."""
    handle = _DISPLAYS.get(bar)
    if handle is None:
        return
    handle.update({"text/plain": str(bar)}, raw=True)
    for widget in [bar.container, *bar.container.children]:
        for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
            if part is not None:
                part.close()
        widget.close()
