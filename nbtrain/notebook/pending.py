"""The one non-blocking cell a cluster may have in flight (`%%distributed --noblock`).

`Cluster.submit` sends a cell and returns at once; `Cluster.wait` and
`Cluster.result` collect it later through the same wait loop as a blocking cell
(`cell_run.follow_cell`), so output and errors look exactly the same.
"""

from __future__ import annotations

import threading
import time

from .cell_run import RankOutput, busy_ranks, follow_cell
from .errors import DistributedError


class PendingCell:
    """A submitted cell: its AsyncResult, ranks, timeout and what was shown of it."""

    def __init__(
        self,
        ar,
        ranks: list[int],
        timeout_s: float | None,
        stream: bool,
        labels: dict[int, str] | None = None,
    ):
        self.ar, self.ranks, self.timeout_s = ar, ranks, timeout_s
        self.started = time.monotonic()
        self.printer = RankOutput(ranks, ar._metadata, stream, labels)

    def done(self) -> bool:
        return self.ar.done()

    def busy(self) -> list[int]:
        """Ranks still running the cell."""
        return busy_ranks(self.ar, self.ranks)

    def follow(self, cluster, patience_s: float | None, on_poll=None):
        """`follow_cell` on this cell; None while it is still running."""
        return follow_cell(
            cluster,
            self.ar,
            self.ranks,
            self.timeout_s,
            True,
            on_poll,
            printer=self.printer,
            started=self.started,
            patience_s=patience_s,
        )


def feed_dashboard(pending: PendingCell, board, interval_s: float = 0.5) -> threading.Thread:
    """Keep `board` (a Dashboard) updated from `pending`'s ranks while the notebook is
    free; the thread ends when the cell does."""

    def feed():
        while not pending.done():
            board.poll(pending.ranks, pending.ar._metadata, False)
            time.sleep(interval_s)
        board.poll(pending.ranks, pending.ar._metadata, True)

    thread = threading.Thread(target=feed, name="nbtrain-dashboard-feed", daemon=True)
    thread.start()
    return thread


def refuse_while_pending(pending: PendingCell | None, what: str) -> None:
    """Raise DistributedError if a non-blocking cell has not been collected yet."""
    if pending is None:
        return
    if pending.done():
        raise DistributedError(
            f"{what}: the non-blocking cell has finished but its output "
            "was not collected; run `%nbtrain wait` first"
        )
    ranks = ", ".join(map(str, pending.busy())) or "-"
    raise DistributedError(
        f"{what}: a non-blocking cell is still running on ranks {ranks}; "
        "run `%nbtrain wait` first (or `%nbtrain result` to check on it)"
    )
