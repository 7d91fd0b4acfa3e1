"""`nbtrain.progress(iterable)`: a tqdm bar for training loops, on rank 0 only.

In a terminal (torchrun) rank 0 draws an ordinary tqdm bar; in a plain Jupyter
kernel, tqdm's widget. On an nbtrain engine rank 0 prints a text bar at most
every `print_s` seconds (one line each, labelled `[rank 0]`): the notebook's one
progress display (the dashboard draws none). The other ranks iterate silently.
Each iteration closes a telemetry step if the loop body did not (OptimManager.step
does), and the bar shows the last recorded loss. The first interrupt (Ctrl-C, the
notebook's stop button) ends the loop on every rank at the same step boundary; a
second one interrupts at once.
"""

from __future__ import annotations

import sys
import time

from .. import telemetry
from ..comm import recovery


def _rank() -> int:
    from .sinks import current_rank

    return current_rank()


def _on_engine() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    return getattr(kernel, "engine_id", None) is not None


class _Lines:
    """A file for tqdm that turns each redraw into a line (engine output is by line)."""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            sys.stdout.write(text + "\n")

    def flush(self) -> None:
        sys.stdout.flush()


def progress(
    iterable=None,
    total: int | None = None,
    desc: str = "train",
    rank: int = 0,
    print_s: float = 5.0,
    **tqdm_kwargs,
):
    """Iterate `iterable` with a progress bar on `rank`; yields its items unchanged.

    Args:
        iterable: the loop's iterable (e.g. `range(steps)` or a DataLoader).
        total: number of items when `len(iterable)` is not defined.
        desc: the bar's label.
        rank: the rank that draws the bar (the others draw nothing).
        print_s: on engines, seconds between text lines of the bar.
        **tqdm_kwargs: passed to tqdm.
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if _rank() != rank:
        yield from _steps(iterable, None)
        return
    lines = _on_engine()
    if lines:
        from tqdm import tqdm

        bar = tqdm(
            total=total, desc=desc, file=_Lines(), mininterval=print_s, ascii=True, **tqdm_kwargs
        )
    else:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, **tqdm_kwargs)
    start = time.monotonic()
    try:
        for n, item in enumerate(_steps(_counted(iterable, bar), bar)):
            telemetry.RECORDER.progress = {
                "n": n,
                "total": total,
                "desc": desc,
                "rate": n / max(time.monotonic() - start, 1e-9),
            }
            yield item
        telemetry.RECORDER.progress = {
            "n": bar.n,
            "total": total,
            "desc": desc,
            "rate": bar.n / max(time.monotonic() - start, 1e-9),
        }
    finally:
        _close(bar, lines)


def _counted(iterable, bar):
    """Yield items, counting each on `bar` after its loop body. (A bar that iterates
    closes itself when the iterable ends, before `_close` can decide how.)"""
    for item in iterable:
        yield item
        bar.update(1)


def _close(bar, lines: bool) -> None:
    """Close `bar`. A text bar (`lines`) whose last line already shows the final count
    would print that count again, a second "16/16" line: it closes without one."""
    if lines and bar.last_print_n == bar.n:
        bar.leave = False
    bar.close()


def _steps(iterable, bar):
    """Yield items; after each loop body, close the telemetry step if nobody did.

    Honours a graceful stop (nbtrain.comm.recovery): the first interrupt ends the
    loop on every rank at the same step boundary, the second interrupts at once.
    """
    with recovery.graceful_stop():
        for n, item in enumerate(iterable):
            if recovery.stop_requested(n):
                print(f"nbtrain: stopped before step {n} (graceful stop)", flush=True)
                return
            yield from _one_step(item, bar)


def _one_step(item, bar):
    step = telemetry.RECORDER.step
    yield item
    if telemetry.RECORDER.step == step:
        telemetry.next_step()
    if bar is not None:
        losses = telemetry.RECORDER.log.metrics
        if losses and losses[-1].get("loss") is not None:
            bar.set_postfix(loss=f"{losses[-1]['loss']:.4f}", refresh=False)
