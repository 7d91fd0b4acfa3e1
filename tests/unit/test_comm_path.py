"""Every collective of nbtrain.comm.collectives takes one path: its kind named, its call
counted, its `comm_issue` event published, and what is still in flight registered.

A world of one runs the group collectives for real (gloo over one rank); the
multi-rank behaviour (bytes, spans, point-to-point works) is in
tests/multirank/test_collectives.py and tests/telemetry/test_telemetry_events.py.
"""

import pytest
import torch

from nbtrain.comm import collectives as C
from nbtrain.comm import events
from nbtrain.comm.accounting import CommCounters, CommKind

pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/unit/conftest.py


@pytest.fixture
def published():
    """The events published while the test runs (the counters start from zero)."""
    got = []
    events.subscribe(got.append)
    C.COUNTERS.reset()
    try:
        yield got
    finally:
        events.unsubscribe(got.append)
        C.COUNTERS.reset()


def test_tensor_parallel_kinds_count_as_their_operation():
    counters = CommCounters()
    counters.add(CommKind.TP_ALL_GATHER, 10)
    counters.add(CommKind.ALL_GATHER, 5)
    counters.add(CommKind.TP_ALL_REDUCE, 7)
    assert counters.snapshot()["bytes"] == {"all_gather": 15, "all_reduce": 7}
    assert CommKind.TP_REDUCE_SCATTER.collective is CommKind.REDUCE_SCATTER
    assert CommKind.P2P.collective is CommKind.P2P
    assert CommKind.ALL_REDUCE.variants() == (CommKind.ALL_REDUCE, CommKind.TP_ALL_REDUCE)


def test_the_caller_names_the_kind_and_a_wrong_one_is_refused(published):
    x = torch.ones(3)
    C.all_reduce(x, label="tp loss max", kind=CommKind.ALL_REDUCE)  # named: no guess
    C.all_reduce(x, label="grad norm", kind=CommKind.TP_ALL_REDUCE)
    C.all_reduce(x, label="tp all-reduce output")  # no kind named: the operation's, never
    C.all_reduce(x, label="grad norm")  # one read from the label
    kinds = [e["kind"] for e in published if e["type"] == "comm_issue"]
    assert kinds == ["all_reduce", "tp_all_reduce", "all_reduce", "all_reduce"]
    assert C.COUNTERS.snapshot()["calls"] == {"all_reduce": 4}
    with pytest.raises(ValueError, match=r"kind=.*ALL_GATHER.*pass CommKind.ALL_REDUCE or"):
        C.all_reduce(x, kind=CommKind.ALL_GATHER)
    assert C.COUNTERS.snapshot()["calls"] == {"all_reduce": 4}  # refused before issuing


def test_every_collective_is_counted_and_published(published):
    full, shard = torch.empty(4), torch.arange(4.0)
    C.all_gather(full, shard, label="gather")
    C.reduce_scatter(torch.empty(4), full, label="scatter")
    C.all_reduce(torch.ones(2), label="reduce")
    C.all_to_all_single(torch.empty(4), shard, None, None, label="exchange")
    C.broadcast(torch.ones(2), 0, label="bcast")
    C.barrier(label="fence")
    assert C.all_gather_object({"a": 1}, label="meta") == [{"a": 1}]
    issued = [(e["kind"], e["label"]) for e in published if e["type"] == "comm_issue"]
    assert issued == [
        ("all_gather", "gather"),
        ("reduce_scatter", "scatter"),
        ("all_reduce", "reduce"),
        ("all_to_all", "exchange"),
        ("broadcast", "bcast"),
        ("barrier", "fence"),
        ("all_gather_object", "meta"),
    ]
    snap = C.COUNTERS.snapshot()
    assert set(snap["calls"]) == {kind for kind, _ in issued}
    assert snap["bytes"]["broadcast"] == 8  # a broadcast counts its tensor on every rank
    assert snap["bytes"]["barrier"] == snap["bytes"]["all_gather_object"] == 0
    # The blocking tensor collectives are exposed comm (a span); a broadcast, a barrier
    # and an object gather mostly wait for a peer's compute: no span.
    spans = [e["kind"] for e in published if e["type"] == "comm"]
    assert spans == ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
    assert len(C.IN_FLIGHT) == 0  # blocking: never left registered


def test_an_async_collective_is_in_flight_until_waited(published):
    C.IN_FLIGHT.clear()
    x = torch.ones(2)
    handle = C.all_reduce(x, async_op=True, label="async", kind=CommKind.TP_ALL_REDUCE)
    assert handle.kind is CommKind.TP_ALL_REDUCE and handle.event_kind == "tp_all_reduce"
    assert len(C.IN_FLIGHT) == 1
    assert C.wait_in_flight(timeout_s=30)
    handle.wait()
    assert len(C.IN_FLIGHT) == 0
    waits = [e for e in published if e["type"] == "comm_wait"]
    assert [(e["kind"], e["label"]) for e in waits] == [("tp_all_reduce", "async")]


def test_a_group_of_one_rank_alone_copies_and_counts_nothing(published):
    from nbtrain.comm.topology import ALONE

    out, shard = torch.empty(3), torch.arange(3.0)
    done = []
    handle = C.reduce_scatter(
        out, shard, group=ALONE, async_op=True, on_done=lambda: done.append(1), label="alone"
    )
    assert handle.is_completed() and done == [1] and torch.equal(out, shard)
    assert C.all_gather(torch.empty(3), shard, group=ALONE) is None
    assert C.COUNTERS.snapshot()["calls"] == {} and published == []
