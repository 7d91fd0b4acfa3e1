"""Who arrived at a collective that does not complete: a hang is never silent.

A rank that skips a collective, or calls another one, leaves its peers waiting in
C++ until the process-group timeout, and then gloo says only "Timed out waiting for
recv". Here every collective that `comm.collectives` issues gets a number per group
(the same on every rank while they call the same collectives in the same order),
and a rank blocked in one tells the others, through the group's c10d store (torchrun's
TCPStore, run_ranks' FileStore), which one it waits in. When the wait fails, the error
(`CollectiveError`) names the collective, its label and number, the ranks that arrived
and what each missing rank was doing instead. Half way to the timeout (at most a
minute in), a line on stderr says the same, so a run that is killed from outside
before the timeout (a test runner's limit) still says where it stood.

The fast path stays local: a counter and a dict entry per blocking wait (about 1 us,
measured in tests/multirank/test_hang_report.py). Nothing touches the store unless a
wait lasts past a grace period (5% of the timeout, 0.2 to 5 s), checked by one
daemon thread four times a second, which ends once no wait blocks.

Not covered: under NCCL a wait returns at once (the stream waits, not the host), so
nothing here sees a hang; torch's NCCL watchdog reports the stuck collective by its
sequence number. Direct torch.distributed calls (which nbtrain's users may make) are
not numbered.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

POLL_S = 0.25
_NOWHERE = "in no nbtrain collective (computing, blocked elsewhere, or gone)"
_KEY = "nbtrain/waits/"


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says who arrived.

    Attributes:
        kind, label, seq: the collective ("all_reduce"), its label, its number in its
            group (1 for the group's first).
        arrived: global ranks seen waiting in this same collective (this one included).
        missing: {global rank: what it was doing instead, in words}.
        backend_error: the backend's own exception (gloo's "Timed out waiting ...").
    """

    def __init__(self, message, kind, label, seq, arrived, missing, backend_error=None):
        super().__init__(message)
        self.kind, self.label, self.seq = kind, label, seq
        self.arrived, self.missing = arrived, missing
        self.backend_error = backend_error


class Wait:
    """One collective of this rank: what it is, and since when the rank blocks on it."""

    __slots__ = ("kind", "label", "group", "seq", "since", "published", "warned")

    def __init__(self, kind: str, label: str, group, seq: int):
        self.kind, self.label, self.group, self.seq = kind, label, group, seq
        self.since = 0.0
        self.published = self.warned = False

    def describe(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"{self.kind}{label} (collective #{self.seq} of {_group_words(self.group)})"


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group or dist.distributed_c10d._get_default_group())


def _group_words(group) -> str:
    ranks = _group_ranks(group)
    if group is None or len(ranks) == dist.get_world_size():
        return f"the world, ranks 0-{len(ranks) - 1}"
    return f"the group of ranks {ranks}"


def _timeout_s(group) -> float:
    pg = group or dist.distributed_c10d._get_default_group()
    try:
        timeout = pg._get_backend(torch.device("cpu")).options._timeout
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    except Exception:  # a backend without options (a fake group): torch's default
        return 600.0


class CollectiveWatch:
    """Numbers this rank's collectives and reports the ones that do not complete.

    One per process (`collectives.WATCH`); `reset()` when the groups are made again
    (recovery's rebuild, shutdown), since the numbers count from there.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._seqs: dict[int, list] = {}  # id(group) -> [group (kept alive), count]
        self._active: dict[int, Wait] = {}  # id(wait) -> blocking wait in progress
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def reset(self) -> None:
        """Forgets every number and ends the watching thread (it starts again with
        the next blocking wait)."""
        with self._lock:
            self._seqs.clear()
            self._active.clear()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._stop.set()
            thread.join()
            self._stop.clear()

    def issued(self, kind: str, label: str, group) -> Wait:
        """The next collective of `group` on this rank. Local, cheap."""
        entry = self._seqs.get(id(group))
        if entry is None:
            entry = self._seqs[id(group)] = [group, 0]
        entry[1] += 1
        return Wait(kind, label, group, entry[1])

    def enter(self, wait: Wait) -> None:
        """This thread now blocks until `wait`'s collective completes. Local."""
        wait.since = time.monotonic()
        self._active[id(wait)] = wait
        if self._thread is None:
            self._start()

    def leave(self, wait: Wait) -> None:
        """`wait`'s collective completed. Local (a store write only after a long wait)."""
        self._active.pop(id(wait), None)
        if wait.published:
            self._publish()

    def failed(self, wait: Wait, err: BaseException) -> CollectiveError:
        """The error to raise for `wait`'s failed collective, naming who arrived. Its
        record stays in the store, so peers failing a moment later count this rank as
        arrived."""
        what, me = f"{wait.kind} {wait.label!r} (collective #{wait.seq})", "?"
        try:
            what, me = wait.describe(), dist.get_rank()
            self._publish()  # a failure before the grace period: peers learn of it now
            arrived, missing = self.arrivals(wait)
        except Exception:  # the group or its store is gone (an aborted group): say less
            arrived, missing = [], {}
        self._active.pop(id(wait), None)
        elapsed = time.monotonic() - wait.since
        how = "timed out" if "timed out" in str(err).lower() else "failed"
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        message = (
            f"{what} {how} after {elapsed:.1f} s on rank {me}: "
            f"{_arrival_words(arrived, missing)}. Every rank of a group must call the same "
            f"collectives in the same order. The backend said: {first}"
        )
        return CollectiveError(message, wait.kind, wait.label, wait.seq, arrived, missing, err)

    def arrivals(self, wait: Wait) -> tuple[list[int], dict[int, str]]:
        """(ranks waiting in `wait`'s collective, {other rank: what it waits in}), read
        from the peers' records. Collective reads of the store; never blocks on a peer."""
        ranks = _group_ranks(wait.group)
        mine = dist.get_rank()
        store = _store()
        arrived, missing = [mine], {}
        for rank in ranks:
            if rank == mine:
                continue
            records = _read(store, rank)
            same = [r for r in records if r["group"] == ranks and r["seq"] == wait.seq]
            if same and (same[0]["kind"], same[0]["label"]) == (wait.kind, wait.label):
                arrived.append(rank)
            elif same:
                missing[rank] = f"in {_record_words(same[0])} instead"
            elif records:
                missing[rank] = f"in {_record_words(records[0])}"
            else:
                missing[rank] = _NOWHERE
        return sorted(arrived), missing

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="nbtrain-collective-watch", daemon=True
                )
                self._thread.start()

    def _watch(self) -> None:
        # The thread lives only while some wait blocks: no thread outlives the run.
        while not self._stop.wait(POLL_S):
            try:
                self._check(time.monotonic())
            except Exception:  # the group went away under us (teardown): nothing to say
                pass
            with self._lock:
                if self._active:
                    continue
                self._thread = None
            if self._active:  # a wait entered between the check and the line above
                self._start()
            return
        with self._lock:
            self._thread = None

    def _check(self, now: float) -> None:
        waits = list(self._active.values())
        if not waits:
            return
        timeout = _timeout_s(waits[0].group)
        grace_s = min(max(0.05 * timeout, 0.2), 5.0)
        warn_s = min(0.5 * timeout, 60.0)
        if any(not w.published and now - w.since > grace_s for w in waits):
            self._publish()
        for w in waits:
            if not w.warned and now - w.since > warn_s and id(w) in self._active:
                w.warned = True
                arrived, missing = self.arrivals(w)
                sys.stderr.write(  # one write: ranks' lines do not interleave
                    f"nbtrain: rank {dist.get_rank()} has waited {now - w.since:.0f} s "
                    f"(of a {timeout:.0f} s timeout) in {w.describe()}: "
                    f"{_arrival_words(arrived, missing)}\n"
                )
                sys.stderr.flush()

    def _publish(self) -> None:
        """Writes this rank's blocking waits to the store (an empty list: none)."""
        waits = sorted(self._active.values(), key=lambda w: w.since)
        for w in waits:
            w.published = True
        records = [
            {"group": _group_ranks(w.group), "seq": w.seq, "kind": w.kind, "label": w.label}
            for w in waits
        ]
        store = _store()
        if store is not None:
            store.set(_KEY + str(dist.get_rank()), json.dumps(records))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _read(store, rank: int) -> list[dict]:
    key = _KEY + str(rank)
    if store is None or not store.check([key]):
        return []
    try:
        return json.loads(store.get(key).decode())
    except (ValueError, RuntimeError):
        return []


def _record_words(record: dict) -> str:
    label = f" {record['label']!r}" if record["label"] else ""
    return f"{record['kind']}{label} (#{record['seq']})"


def _ranks_words(ranks) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _arrival_words(arrived: list[int], missing: dict[int, str]) -> str:
    if not arrived:
        return "who arrived is unknown (the group's store could not be read)"
    if not missing:
        return f"every rank arrived ({_ranks_words(arrived)})"
    others = "; ".join(f"rank {r} {why}" for r, why in sorted(missing.items()))
    return f"arrived: {_ranks_words(arrived)}; missing: {others}"


WATCH = CollectiveWatch()
