"""Running one cell on the ranks: live output by rank, errors, deaths, timeouts.

`run_cell` (`submit_cell`, then `follow_cell`) owns the wait loop of
`Cluster.execute`; `Cluster.wait` runs the same loop for a --noblock cell. It polls the output that
ipyparallel collects per engine (rather than printing from ipyparallel's IO thread),
so output appears in order, labelled by rank, in the cell that asked for it.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
import time

from .errors import RESTART_HINT, CellTimeoutError, RankError
from .progress_bar import CellProgress
from .recover import abort_from_notebook, recover_group

_POLL_S = 0.05  # output latency; an empty cell returns as soon as it is done
_DEATH_CHECK_S = 0.5  # how often engine processes are checked while a cell runs
_INTERRUPT_GRACE_S = 3.0  # how long interrupted ranks get to raise KeyboardInterrupt
_INTERNAL_FRAME = re.compile(
    r"site-packages/(ipyparallel|ipykernel|IPython)/|/nbtrain/notebook/engine_boot"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def trim_traceback(lines: list[str]) -> list[str]:
    """Keep the user's frames of a remote IPython traceback; drop engine machinery."""
    text = "\n".join(lines)
    frames = text.split("\n\n")
    kept = [f for f in frames if not _INTERNAL_FRAME.search(_ANSI.sub("", f))]
    out = "\n\n".join(kept).splitlines()
    if out and set(_ANSI.sub("", out[0]).strip()) == {"-"}:
        out = out[1:]  # the banner line of dashes
    return out


class RankOutput:
    """Prints what each rank has produced so far, once, labelled by rank, and moves
    the cell's progress bar (`progress_bar.CellProgress`)."""

    def __init__(
        self,
        ranks: list[int],
        metadata: list[dict],
        stream: bool,
        labels: dict[int, str] | None = None,
    ):
        self.ranks, self.metadata, self.stream = ranks, metadata, stream
        self.labels = labels or {}
        self.offsets = {(r, name): 0 for r in ranks for name in ("stdout", "stderr")}
        self.partial = {(r, name): "" for r in ranks for name in ("stdout", "stderr")}
        self.shown_outputs = {r: 0 for r in ranks}
        self.progress = CellProgress(metadata)

    def flush(self, final: bool = False) -> None:
        self.progress.update(final)
        if not (self.stream or final):
            return
        for r, md in zip(self.ranks, self.metadata):
            for name in ("stdout", "stderr"):
                self._print_stream(r, name, md.get(name) or "", final)
            outputs = md.get("outputs") or []
            for item in outputs[self.shown_outputs[r] :]:
                _publish(item.get("data", {}), item.get("metadata") or {}, r)
            self.shown_outputs[r] = len(outputs)
        if final:
            for r, md in zip(self.ranks, self.metadata):
                result = md.get("execute_result")
                if result:
                    _publish(result.get("data", {}), result.get("metadata") or {}, r)

    def _print_stream(self, r: int, name: str, text: str, final: bool) -> None:
        key = (r, name)
        new = self.partial[key] + text[self.offsets[key] :]
        self.offsets[key] = len(text)
        lines = new.split("\n")
        self.partial[key] = "" if final else lines.pop()
        if final and lines and lines[-1] == "":
            lines.pop()
        if lines:
            out = sys.stdout if name == "stdout" else sys.stderr
            label = self.labels.get(r, f"rank {r}")
            out.write("".join(f"[{label}] {line}\n" for line in lines))
            out.flush()


def rank_labels(cluster) -> dict[int, str]:
    """'rank 3 tp1 dp1' style labels when the ranks are tensor-parallel, else none."""
    tp = getattr(cluster, "tp_size", 1)
    if tp == 1:
        return {}
    from ..comm.topology import Topology

    world = cluster.world_size
    return {
        r: Topology(rank=r, world_size=world, tp_size=tp, dp_size=world // tp).label()
        for r in range(world)
    }


def _publish(data: dict, metadata: dict, r: int) -> None:
    """Show a rank's rich output (figure, table) as it would show locally."""
    try:
        from IPython import get_ipython
        from IPython.display import publish_display_data
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        publish_display_data(data, metadata={**metadata, "nbtrain_rank": r})
    elif "text/plain" in data:
        print(f"[rank {r}] {data['text/plain']}")


def run_cell(
    cluster, code: str, ranks: list[int], timeout_s: float | None, stream: bool, on_poll=None
):
    """Execute `code` on `ranks` of `cluster`, streaming output; raise on any failure.

    `on_poll(ranks, metadata, final)`, if given, sees each rank's metadata (with the
    telemetry the ranks publish, `md["data"]`) at every poll and once at the end.

    Returns:
        The ipyparallel AsyncResult (done and successful).
    """
    ar = submit_cell(cluster, code, ranks)
    return follow_cell(cluster, ar, ranks, timeout_s, stream, on_poll)


def submit_cell(cluster, code: str, ranks: list[int]):
    """Send `code` to `ranks` and return its AsyncResult at once."""
    engine_ids = [cluster.engine_id(r) for r in ranks]
    return cluster.client.direct_view(engine_ids).execute(code, silent=False, block=False)


def follow_cell(
    cluster,
    ar,
    ranks: list[int],
    timeout_s: float | None,
    stream: bool,
    on_poll=None,
    printer: "RankOutput | None" = None,
    started: float | None = None,
    patience_s: float | None = None,
):
    """Wait for the submitted cell `ar`: stream its output, raise its failures.

    `timeout_s` is the cell's own timeout, counted from `started` (a
    `time.monotonic()`; default now). `patience_s` bounds this wait only: when it
    runs out the cell keeps running and None is returned (0 checks once). Pass the
    same `printer` to later calls so that output already shown is not repeated.

    Returns:
        The AsyncResult, done and successful; None if `patience_s` ran out first.
    """
    if printer is None:
        printer = RankOutput(ranks, ar._metadata, stream, rank_labels(cluster))
    now = time.monotonic()
    start = now if started is None else started
    give_up = None if patience_s is None else now + patience_s
    next_check = now + _DEATH_CHECK_S
    interrupted = False
    with counted_interrupts() as pressed:
        while True:
            try:
                if pressed():
                    raise KeyboardInterrupt  # here, where it is handled
                if ar.wait(0 if patience_s == 0 else _POLL_S):
                    break
                printer.flush()
                if on_poll is not None:
                    on_poll(ranks, ar._metadata, False)
                now = time.monotonic()
                if now >= next_check or give_up is not None and now >= give_up:
                    next_check = now + _DEATH_CHECK_S
                    _raise_if_dead(cluster, ranks, printer)
                if timeout_s is not None and now - start > timeout_s:
                    _on_timeout(cluster, ar, ranks, timeout_s, printer)
                if give_up is not None and now >= give_up:
                    return None
            except KeyboardInterrupt:
                if not interrupted:
                    # First stop: a loop in nbtrain.progress ends at a step boundary every
                    # rank agrees on; other code raises KeyboardInterrupt, and recovery
                    # makes the ranks waiting on it fail too. Keep following the cell.
                    interrupted = True
                    cluster.interrupt(_busy(ar, ranks))
                    print(
                        "nbtrain: interrupting the ranks (training loops in nbtrain.progress stop "
                        "at the next agreed step; interrupt again to stop at once)",
                        flush=True,  # information, not an error: stdout
                    )
                    continue
                _on_interrupt(cluster, ar, ranks, printer)
                if not _busy(ar, ranks):
                    _finish_failed(cluster, ar, ranks)
                raise
    ar.wait_for_output(1.0)
    printer.flush(final=True)
    if on_poll is not None:
        on_poll(ranks, ar._metadata, True)
    _raise_if_dead(cluster, ranks, printer)
    _finish_failed(cluster, ar, ranks)
    if interrupted:
        print("nbtrain: every rank stopped cleanly; the cell finished", flush=True)
    return ar


@contextlib.contextmanager
def counted_interrupts():
    """While a cell is followed, SIGINT (the stop button) is counted, not raised: the
    wait loop takes each press (`pressed()` is true once per press) at its next poll.

    Raised by Python's default handler, a press landed wherever the kernel's main
    thread was, and when that was a weakref callback or a `__del__` (a collected
    widget or figure), Python printed "Exception ignored ... KeyboardInterrupt" and
    dropped it: the stop button did nothing and the loop ran on (seen once in a
    thousand-cell run). In a thread other than the main one, signals are not ours to
    handle: presses arrive as KeyboardInterrupt, as before.
    """
    presses = [0]

    def take() -> bool:
        if presses[0]:
            presses[0] -= 1
            return True
        return False

    if threading.current_thread() is not threading.main_thread():
        yield take
        return

    def count(signum, frame):
        presses[0] += 1

    previous = signal.signal(signal.SIGINT, count)
    try:
        yield take
    finally:
        signal.signal(signal.SIGINT, previous)


def _failed_ranks(ar, ranks: list[int]) -> list[int]:
    return [
        r
        for r, md in zip(ranks, ar._metadata)
        if md.get("status") not in (None, "ok") and md.get("error") is not None
    ]


def _finish_failed(cluster, ar, ranks: list[int]) -> None:
    """If any rank raised: rebuild the process group on every rank, then raise the
    ranks' errors, the rank that failed first leading."""
    if not _failed_ranks(ar, ranks):
        return
    origin = recover_group(cluster)
    _raise_rank_errors(ar, ranks, origin)


def busy_ranks(ar, ranks: list[int]) -> list[int]:
    """The ranks of `ranks` that have not finished `ar`."""
    return _busy(ar, ranks)


def _busy(ar, ranks: list[int]) -> list[int]:
    return [r for r, f in zip(ranks, ar._children) if not f.done()]


def _raise_if_dead(cluster, ranks: list[int], printer: RankOutput) -> None:
    dead = cluster.dead_ranks(ranks)
    if dead:
        printer.flush(final=True)
        raise cluster.died(dead)


def _on_timeout(cluster, ar, ranks, timeout_s, printer) -> None:
    busy = _busy(ar, ranks)
    stuck = _stop(cluster, ar, ranks, printer, f"the cell timed out after {timeout_s:g} s")
    if not stuck:
        recover_group(cluster)
    raise CellTimeoutError(timeout_s, busy, stuck)


def _on_interrupt(cluster, ar, ranks, printer) -> None:
    stuck = _stop(cluster, ar, ranks, printer, "interrupted from the notebook")
    if stuck:
        print(
            f"rank(s) {', '.join(map(str, stuck))} did not stop, even with their collectives "
            f"aborted. {RESTART_HINT}",
            file=sys.stderr,
        )


def _stop(cluster, ar, ranks, printer, reason: str) -> list[int]:
    """Interrupt the busy ranks; abort the collectives of any that stay blocked.

    Returns the ranks still running after both (only a restart frees those).
    """
    cluster.interrupt(_busy(ar, ranks))
    try:
        ar.wait(_INTERRUPT_GRACE_S)
        if _busy(ar, ranks) and abort_from_notebook(cluster, reason):
            ar.wait(_INTERRUPT_GRACE_S)  # blocked in a collective: SIGINT waits for it
    except KeyboardInterrupt:  # another Ctrl-C: stop waiting for the ranks
        pass
    printer.flush(final=True)
    stuck = _busy(ar, ranks)
    if stuck:
        cluster.mark_stuck(ar)
    return stuck


def _raise_rank_errors(ar, ranks: list[int], origin: int | None = None) -> None:
    tracebacks, summaries = {}, {}
    for r, md in zip(ranks, ar._metadata):
        err = md.get("error")
        if md.get("status") == "ok" or err is None:
            continue
        summaries[r] = f"{err.ename}: {err.evalue}"
        tracebacks[r] = trim_traceback((err.traceback or "").splitlines())
    if tracebacks:
        raise RankError(tracebacks, summaries, origin=origin)
