"""`nbtrain.progress(iterable)`: a tqdm bar for training loops, on rank 0 only.

In a terminal (torchrun) rank 0 draws an ordinary tqdm bar; in a plain Jupyter
kernel, tqdm's widget. On an nbtrain engine it draws nothing itself: rank 0 publishes
its count with the telemetry, and the notebook shows one tqdm bar in the cell's
output that moves as the ranks train (`nbtrain.notebook.progress_bar`). The other
ranks iterate silently. Each iteration closes a telemetry step if the loop body did
not (OptimManager.step does), and the bar shows the last recorded loss. The first
interrupt (Ctrl-C, the notebook's stop button) ends the loop on every rank at the
same step boundary; a second one interrupts at once.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

from .. import telemetry
from ..comm import recovery

_LOOPS = itertools.count(1)


def _rank() -> int:
    from .sinks import current_rank

    return current_rank()


def _on_engine() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    return getattr(kernel, "engine_id", None) is not None


def progress(
    iterable=None,
    total: int | None = None,
    desc: str = "train",
    rank: int = 0,
    print_s: float | None = None,
    **tqdm_kwargs,
):
    """Iterate `iterable` with a progress bar on `rank`; yields its items unchanged.

    Args:
        iterable: the loop's iterable (e.g. `range(steps)` or a DataLoader).
        total: number of items when `len(iterable)` is not defined.
        desc: the bar's label.
        rank: the rank that draws the bar (the others draw nothing).
        print_s: unused; engines once printed a text line every `print_s` seconds,
            and the notebook now draws one bar. Accepted so that such calls still run.
        **tqdm_kwargs: passed to tqdm (on an engine, `unit` reaches the notebook's bar).
    """
    del print_s
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if _rank() != rank:
        yield from _steps(iterable, None)
        return
    bar = None
    if not _on_engine():
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, **tqdm_kwargs)
    published = {
        "id": f"{os.getpid()}-{next(_LOOPS)}",  # a new loop, a new bar in the notebook
        "total": total,
        "desc": desc,
        "unit": tqdm_kwargs.get("unit"),
        "n": 0,
        "loss": None,
        "done": False,
        "started": time.monotonic(),
    }
    telemetry.RECORDER.progress = dict(published)
    try:
        yield from _steps(_counted(iterable, bar, published), bar)
    finally:
        published["done"] = True
        _publish(published)
        if bar is not None:
            bar.close()


def _publish(published: dict) -> None:
    """What the notebook's bar reads (summary["progress"]): the count of finished
    steps, the newest loss, the rate, and whether the loop is over."""
    published["loss"] = telemetry.RECORDER.last_metric("loss")
    elapsed = max(time.monotonic() - published["started"], 1e-9)
    telemetry.RECORDER.progress = {**published, "rate": published["n"] / elapsed}


def _counted(iterable, bar, published: dict):
    """Yield items, counting each (on `bar`, and in what is published) after its loop
    body. (A bar that iterates closes itself when the iterable ends.)"""
    for item in iterable:
        yield item
        published["n"] += 1
        _publish(published)
        if bar is not None:
            bar.update(1)


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
