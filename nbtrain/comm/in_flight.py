"""Collectives in flight: their handles, the registry teardown drains, their generation.

Every asynchronous collective that nbtrain.comm.collectives issues is in `IN_FLIGHT`
until it is waited on (or seen completed), so `wait_in_flight` (what shutdown and the
exit hook call) lets all of them finish before the process group is destroyed: a
collective's handle (`CommHandle`) and a point-to-point batch's works (`_Posted`) alike.
Blocking collectives complete before they return and never stay registered.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from . import events
from .accounting import CommKind
from .hang_report import WATCH, Wait


class InFlight:
    """Async collectives issued and not yet waited on: what teardown must let finish.

    `CommHandle` adds itself when issued and leaves on `wait()`. A handle dropped
    without a wait stays until it is seen completed (pruned as new ones come), so
    the set stays small. Thread-safe.
    """

    _PRUNE_AT = 64

    def __init__(self):
        self._lock = threading.Lock()
        self._handles: set = set()

    def add(self, handle: CommHandle | _Posted) -> None:
        with self._lock:
            if len(self._handles) >= self._PRUNE_AT:
                self._handles = {h for h in self._handles if not h._work.is_completed()}
            self._handles.add(handle)

    def discard(self, handle: CommHandle | _Posted) -> None:
        with self._lock:
            self._handles.discard(handle)

    def discard_works(self, works) -> None:
        """Drops the entries of these works (point-to-point works, waited on)."""
        ids = {id(w) for w in works}
        with self._lock:
            self._handles = {h for h in self._handles if id(h._work) not in ids}

    def handles(self) -> list:
        with self._lock:
            return list(self._handles)

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)


IN_FLIGHT = InFlight()


class _Posted:
    """One work of a point-to-point batch (`send_recv`, `post_p2p`) in the in-flight
    registry, so that teardown waits for a ring's or a pipeline's transfers as it does for
    the collectives' handles; it leaves once seen completed (or on `wait_send_recv`).

    The owner waits on the work itself, never through this entry: gloo's point-to-point
    works must not be waited on twice, so `wait_send_recv` drops the entries
    (`InFlight.discard_works`) once it has waited."""

    __slots__ = ("_work",)

    def __init__(self, work):
        self._work = work


def posted(works: list) -> list:
    """Registers a point-to-point batch's works in flight; returns them."""
    for work in works:
        IN_FLIGHT.add(_Posted(work))
    return works


# The generation of the process groups: one more each time they are made again after
# a failure (nbtrain.comm.recovery.rebuild). A handle issued in an older generation
# belongs to an aborted group: its owner drops it (`CommHandle.stale`), never waits on
# it, and issues the collective again; a prefetch kept from a failed step otherwise
# left one rank a collective behind the others (gloo then aborts the process).
_GENERATION = [0]


def generation() -> int:
    return _GENERATION[0]


def new_generation() -> None:
    """The process groups were made again: every handle issued before is stale."""
    _GENERATION[0] += 1
    IN_FLIGHT.clear()


def wait_in_flight(timeout_s: float | None = None) -> bool:
    """Blocks until every async collective issued through nbtrain.comm has completed.

    Only waits for the backend: results are not applied (no `on_done`), the
    handles' owners still do that with `wait()`. With a timeout it polls,
    giving up the GIL between polls (a backend thread may need it to finish),
    and returns False if something is still in flight when the timeout passes.

    Raises what a failed collective raises (timeout None only).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for handle in IN_FLIGHT.handles():
        work = handle._work
        if deadline is None:
            work.wait()
            continue
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
    return True


def watched(watch: Wait, call: Callable):
    """`call()`, a blocking wait on a collective, with this rank's wait on record: a
    failure (a timeout, a peer gone) raises `CollectiveError` naming who arrived."""
    WATCH.enter(watch)
    try:
        out = call()
    except RuntimeError as err:  # gloo's timeouts and closed connections
        # The report quotes the backend's line; its traceback would come first and
        # bury the report (`backend_error` keeps it).
        raise WATCH.failed(watch, err) from None
    WATCH.leave(watch)
    return out


class CommHandle:
    """A collective in flight. `wait()` blocks until its result may be read.

    On CUDA the wait makes the current stream wait for the collective (no host
    sync); on gloo it blocks the calling thread, and a collective that fails or
    times out raises `hang_report.CollectiveError` naming the ranks that arrived.

    `kind` is the kind the caller named (telemetry shows `event_kind`, its value).
    A handle without a work (a group of this rank alone) is done from the start.
    """

    def __init__(
        self,
        work,
        kind: CommKind,
        nbytes: int,
        label: str,
        on_done: Callable[[], None] | None = None,
        watch: Wait | None = None,
    ):
        self._work = work
        self._watch = watch
        self._on_done = on_done
        self._done = work is None
        self.kind, self.nbytes, self.label = kind, nbytes, label
        self.event_kind = kind.value
        self.issued_at = time.perf_counter()
        self.finished_at: float | None = None
        self.generation = _GENERATION[0]
        self._stamp_at_wait = False
        if work is not None and events.active():
            self._record_completion()
        if self._done:
            self._finish()
        else:
            IN_FLIGHT.add(self)

    def _record_completion(self):
        # The future's callback fires when the backend finishes, on its own
        # thread; it timestamps the end of the span without blocking anyone.
        try:
            fut = self._work.get_future()
        except (RuntimeError, AttributeError):
            # gloo's reduce_scatter has no future: wait() stamps the end instead,
            # an upper bound on the completion time.
            self._stamp_at_wait = True
            return

        step = events.HUB.step  # the callback may run after the step ended

        def _stamp(_):
            self._finished(step=step)

        fut.then(_stamp)

    def _finished(self, **how) -> None:
        """Stamps the end now and publishes the span from issue to it."""
        self.finished_at = time.perf_counter()
        events.comm_span(
            self.event_kind, self.label, self.issued_at, self.finished_at, self.nbytes, **how
        )

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    @property
    def stale(self) -> bool:
        """Issued on a process group that a failure has since replaced: drop it."""
        return self.generation != _GENERATION[0]

    def wait(self) -> None:
        if self._done:
            return
        if self._watch is None:
            self._work.wait()
        else:
            watched(self._watch, self._work.wait)
        IN_FLIGHT.discard(self)
        if self._stamp_at_wait:
            self._finished(end_at_wait=True)
        events.instant("comm_wait", self.label, kind=self.event_kind)
        self._done = True
        self._finish()

    def _finish(self):
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb()
