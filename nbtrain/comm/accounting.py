"""What nbtrain's collectives are (`CommKind`) and how many bytes they moved (`COUNTERS`).

Every collective of nbtrain.comm.collectives names its kind explicitly; the kind is
what telemetry shows, and its `collective` (the torch operation underneath) is what
the byte counters and the hang reports key on. So a tensor-parallel all-gather shows
as "tp_all_gather" in telemetry while its bytes add to "all_gather", as the benchmarks
and the ZeRO arithmetic expect.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter


class CommKind(str, enum.Enum):
    """The kind of a collective, as telemetry shows it.

    The `TP_*` members are the same operations as their plain namesakes, issued by the
    tensor-parallel layers (nbtrain.nn): telemetry shows them apart from ZeRO's and
    data parallelism's, the byte counters add them to their namesakes.
    """

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    P2P = "p2p"  # point-to-point sends and receives: pipeline stages, the cp ring
    ALL_TO_ALL = "all_to_all"  # expert-parallel token exchange (nbtrain.moe)
    BARRIER = "barrier"  # numbered and watched (hang_report); moves no bytes
    ALL_GATHER_OBJECT = "all_gather_object"  # pickles, not tensors: counted as 0 bytes
    TP_ALL_GATHER = "tp_all_gather"
    TP_REDUCE_SCATTER = "tp_reduce_scatter"
    TP_ALL_REDUCE = "tp_all_reduce"

    @property
    def collective(self) -> CommKind:
        """The operation underneath: ALL_GATHER for TP_ALL_GATHER, itself otherwise."""
        return _COLLECTIVE.get(self, self)

    def variants(self) -> tuple[CommKind, ...]:
        """The kinds a call of this operation may be shown as (itself first)."""
        return (self, *(k for k, base in _COLLECTIVE.items() if base is self))


_COLLECTIVE = {
    CommKind.TP_ALL_GATHER: CommKind.ALL_GATHER,
    CommKind.TP_REDUCE_SCATTER: CommKind.REDUCE_SCATTER,
    CommKind.TP_ALL_REDUCE: CommKind.ALL_REDUCE,
}


class CommCounters:
    """Bytes and calls per collective operation, as seen by this rank (thread-safe).

    Keyed by the operation (`CommKind.collective`): a tensor-parallel all-reduce adds
    to "all_reduce".
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, kind: CommKind, nbytes: int) -> None:
        key = kind.collective.value
        with self._lock:
            self.bytes[key] += int(nbytes)
            self.calls[key] += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict:
        """{"bytes": {kind: n}, "calls": {kind: n}, "total_bytes": n}."""
        with self._lock:
            return {
                "bytes": dict(self.bytes),
                "calls": dict(self.calls),
                "total_bytes": sum(self.bytes.values()),
            }


COUNTERS = CommCounters()
