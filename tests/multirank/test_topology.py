"""init_distributed(tp_size=...): the rank layout, the named groups, BMTrain's config keys."""

import pytest
import torch
import torch.distributed as dist
from support.ranks import run_ranks

from nbtrain.comm import topology


def test_layout_is_pipeline_then_data_then_tensor():
    # world 8, tp 2, pipe 2 -> dp 2; rank = (pipe * dp + dp_rank) * tp + tp_rank
    assert [topology.coordinates(r, 2, 2) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ]
    assert topology.group_ranks("tp", 8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology.group_ranks("dp", 8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.group_ranks("zero", 8, 2, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology.group_ranks("pipe", 8, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for name in topology.GROUPS:  # every rank in exactly one group of each kind
        groups = topology.group_ranks(name, 12, 3, 2)
        assert sorted(r for g in groups for r in g) == list(range(12)), name


def test_sizes_that_do_not_divide_name_all_three_numbers():
    with pytest.raises(
        ValueError,
        match=r"world size 6 is not divisible by tp_size 4 x "
        r"pipe_size 1 = 4",
    ):
        topology.check_sizes(6, 4, 1)
    with pytest.raises(ValueError, match="tp_size=0"):
        topology.check_sizes(4, 0, 1)


def _at_tp2():
    import nbtrain

    ctx = nbtrain.init_distributed(tp_size=2)  # the harness made a plain world first
    topo, cfg = ctx.topology, nbtrain.config
    keys = {
        k: cfg[k]
        for k in (
            "tp_size",
            "tp_rank",
            "tp_zero_size",
            "tp_zero_rank",
            "zero_rank",
            "zero_size",
            "pipe_size",
        )
    }
    sums = {}
    for name in ("tp", "dp"):
        x = torch.ones(1) * (ctx.rank + 1)
        dist.all_reduce(x, group=topo.group(name))
        sums[name] = x.item()
    return {
        "keys": keys,
        "sums": sums,
        "tp": topo.ranks("tp"),
        "dp": topo.ranks("dp"),
        "label": topo.label(),
        "tp_id": cfg["topology"].tp_id,
        "zero_is_world": topo.group("zero") is None,
    }


def test_tp2_at_world4_groups_and_config():
    out = run_ranks(_at_tp2, 4, timeout_s=120)
    assert [o["tp"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["dp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # all_reduce over the group sums (rank + 1) over exactly its members
    assert [o["sums"]["tp"] for o in out] == [3.0, 3.0, 7.0, 7.0]
    assert [o["sums"]["dp"] for o in out] == [4.0, 6.0, 4.0, 6.0]
    assert out[3]["keys"] == {
        "tp_size": 2,
        "tp_rank": 1,
        "tp_zero_size": 2,
        "tp_zero_rank": 1,
        "zero_rank": 3,
        "zero_size": 4,
        "pipe_size": 1,
    }
    assert out[3]["label"] == "rank 3 tp1 dp1" and out[3]["tp_id"] == 1
    assert all(o["zero_is_world"] for o in out)


def _refused(tp, pipe):
    import nbtrain

    try:
        nbtrain.init_distributed(tp_size=tp, pipe_size=pipe)
    except ValueError as exc:
        return str(exc)
    return None


def test_bad_sizes_are_refused_on_every_rank():
    assert (
        run_ranks(_refused, 2, 4, 1, timeout_s=60)
        == [
            "world size 2 is not divisible by tp_size 4 x pipe_size 1 = 4: choose sizes whose "
            "product divides the number of ranks"
        ]
        * 2
    )
    assert (
        run_ranks(_refused, 2, 1, 3, timeout_s=60)
        == [
            "world size 2 is not divisible by tp_size 1 x pipe_size 3 = 3: choose sizes whose "
            "product divides the number of ranks"
        ]
        * 2
    )


def test_expert_and_context_groups_are_carved_from_data_parallel_ranks():
    # world 8, pipe 2 -> dp 4; ep 2: pairs of neighbouring dp ranks hold every expert,
    # edp: the ranks holding the same experts; cp 2 likewise splits each sequence.
    assert topology.group_ranks("ep", 8, 1, 2, ep_size=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology.group_ranks("edp", 8, 1, 2, ep_size=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.group_ranks("cp", 8, 2, 1, cp_size=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topology.group_ranks("edp", 4, 1, 1) == topology.group_ranks("dp", 4, 1, 1)
    for name in topology.GROUPS:
        groups = topology.group_ranks(name, 12, 1, 2, ep_size=3, cp_size=2)
        assert sorted(r for g in groups for r in g) == list(range(12)), name
    topo = topology.Topology(rank=5, world_size=8, dp_size=4, pipe_size=2, ep_size=2, cp_size=2)
    assert (topo.dp_rank, topo.ep_rank, topo.edp_rank, topo.cp_rank) == (1, 1, 0, 1)
    assert (topo.data_size, topo.data_rank) == (2, 0)
    assert topo.label() == "rank 5 pp1 dp1 ep1 cp1"
    with pytest.raises(
        ValueError,
        match=r"ep_size=3 does not divide the data-parallel "
        r"size 4 \(world 8 / tp_size 1 / pipe_size 2\)",
    ):
        topology.check_sizes(8, 1, 2, ep_size=3)
    with pytest.raises(ValueError, match="cp_size=0"):
        topology.check_sizes(4, 1, 1, cp_size=0)
    with pytest.raises(ValueError, match="use tp_size=1 with expert parallelism"):
        topology.check_sizes(4, 2, 1, ep_size=2)


def _ep_cp_sums():
    import nbtrain

    topo = nbtrain.init_distributed(ep_size=2, cp_size=2).topology
    sums = {}
    for name in ("ep", "edp", "cp", "dp"):
        x = torch.ones(1) * (topo.rank + 1)
        if topo.group(name) is not topology.ALONE:
            dist.all_reduce(x, group=topo.group(name))
        sums[name] = x.item()
    return sums, topo.ranks("edp"), topo.group("edp") is topo.group("dp")


def test_ep_and_cp_groups_at_world4():
    out = run_ranks(_ep_cp_sums, 4, timeout_s=120)
    assert [o[0]["ep"] for o in out] == [3.0, 3.0, 7.0, 7.0]
    assert [o[0]["cp"] for o in out] == [3.0, 3.0, 7.0, 7.0]
    assert [o[0]["edp"] for o in out] == [4.0, 6.0, 4.0, 6.0]
    assert [o[0]["dp"] for o in out] == [10.0] * 4
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert not any(o[2] for o in out)
