"""The errors a `%%distributed` cell (or `Cluster.execute`) raises; users catch these.

All are `DistributedError`s, which IPython shows without nbtrain's own frames.
"""

from __future__ import annotations

RESTART_HINT = "Run `%nbtrain restart` (or Cluster.restart()) for fresh ranks."


class DistributedError(RuntimeError):
    """A `%%distributed` cell failed; IPython shows `_render_traceback_`, not our frames."""

    def _render_traceback_(self):
        return str(self).splitlines()


class NoClusterError(DistributedError):
    """There is no running cluster to send a cell to."""


class RankError(DistributedError):
    """One or more ranks raised. `tracebacks` maps rank -> remote traceback lines.

    `origin` is the rank that failed first, when the others only stopped because of
    it (their collectives were aborted): its error is listed and shown first.
    """

    def __init__(
        self, tracebacks: dict[int, list[str]], summaries: dict[int, str], origin: int | None = None
    ):
        ranks = sorted(tracebacks)
        if origin in tracebacks:
            ranks.remove(origin)
            ranks.insert(0, origin)
        self.ranks, self.origin = ranks, origin
        self.tracebacks = tracebacks
        if origin in tracebacks and len(ranks) > 1:
            others = ", ".join(str(r) for r in ranks[1:])
            lines = [f"rank {origin} raised, and rank(s) {others} stopped because of it:"]
        else:
            names = ", ".join(str(r) for r in ranks)
            lines = [f"{'rank' if len(ranks) == 1 else 'ranks'} {names} raised:"]
        for r in ranks:
            summary = summaries[r]
            if origin in tracebacks and r != origin and len(summary) > 120:
                summary = summary[:117] + "..."  # a consequence: its traceback has it all
            lines.append(f"[rank {r}] {summary}")
        message = "\n".join(lines)
        super().__init__(message)

    def _render_traceback_(self):
        out = str(self).splitlines()[:1]
        for r in self.ranks:
            out.append(f"--- rank {r} ---")
            out.extend(self.tracebacks[r])
        return out


class RankDiedError(DistributedError):
    """A rank's engine process exited while a cell ran (OOM killer, SIGKILL, crash)."""

    def __init__(self, ranks: list[int], hosts: dict[int, str] | None = None):
        """`hosts`: each rank's host, named in the message (a cluster of several hosts)."""
        self.ranks = sorted(ranks)
        self.hosts = dict(hosts or {})
        who = ", ".join(
            f"rank {r}" + (f" on {self.hosts[r]}" if r in self.hosts else "") for r in self.ranks
        )
        super().__init__(
            f"{who} died while the cell ran (killed, out of memory or crashed). "
            f"The other ranks cannot finish a collective without it. {RESTART_HINT}"
        )


class CellTimeoutError(DistributedError, TimeoutError):
    """A cell outlived its timeout; `busy` are the ranks that were still running."""

    def __init__(self, timeout_s: float, busy: list[int], stuck: list[int]):
        self.busy, self.stuck = sorted(busy), sorted(stuck)
        names = ", ".join(str(r) for r in self.busy)
        msg = f"cell timed out after {timeout_s:g} s; still busy: rank(s) {names}."
        if self.stuck:
            msg += (
                f" Rank(s) {', '.join(map(str, self.stuck))} did not respond to an interrupt: "
                "a rank blocked in a collective (all_reduce, barrier, ...) cannot be "
                f"interrupted. {RESTART_HINT}"
            )
        else:
            msg += " They were interrupted and the cluster is usable."
        super().__init__(msg)
