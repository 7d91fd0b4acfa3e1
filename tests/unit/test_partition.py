"""Partition maths: offsets, padding, shard ranges (one process, no torch.distributed)."""

import math

import pytest

from nbtrain.zero.partition import FlatLayout, padded_numel, shard_numel, shard_range


@pytest.mark.parametrize("numel,world", [(1, 1), (1, 3), (50, 2), (257, 3), (12850, 3), (6, 3)])
def test_padding_and_shard_sizes(numel, world):
    assert shard_numel(numel, world) == math.ceil(numel / world)
    assert padded_numel(numel, world) == math.ceil(numel / world) * world
    ranges = [shard_range(numel, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded_numel(numel, world)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_layout_offsets_are_back_to_back():
    layout = FlatLayout.build([("w", (5, 10)), ("b", (5,)), ("g", (7,))], world_size=3)
    assert [(s.offset, s.numel) for s in layout.slots] == [(0, 50), (50, 5), (55, 7)]
    assert layout.numel == 62 and layout.padded_numel == 63 and layout.shard_numel == 21


def test_local_parts_cover_each_parameter_exactly_once():
    layout = FlatLayout.build([("a", (13,)), ("b", (4, 4)), ("c", (1,))], world_size=4)
    for slot in layout.slots:
        covered = 0
        for rank in range(4):
            part = slot.local_part(*layout.shard_range(rank))
            if part is not None:
                lo, hi = part
                assert slot.offset <= lo < hi <= slot.end
                covered += hi - lo
        assert covered == slot.numel


def test_small_parameter_absent_from_some_ranks():
    layout = FlatLayout.build([("big", (30,)), ("tiny", (1,))], world_size=4)
    tiny = layout.slots[1]
    owners = [r for r in range(4) if tiny.local_part(*layout.shard_range(r))]
    assert owners == [3]


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(10, bad)


def test_bad_rank():
    with pytest.raises(ValueError, match="rank=5"):
        shard_range(10, 2, 5)
