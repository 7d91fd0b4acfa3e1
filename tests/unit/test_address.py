"""Where a rank says it is, and where the ranks meet (nbtrain.notebook.address, rendezvous).

No network: name resolution and the kernel's route lookup are replaced, so each case
is a host as it would be configured (a stock Ubuntu /etc/hosts maps the host's own
name to 127.0.1.1, which no other host can reach).
"""

import pytest

from nbtrain.notebook import address, rendezvous
from nbtrain.notebook.slurm import resolve_layout


@pytest.fixture
def ubuntu_host(monkeypatch):
    """A host named "gpu17" whose name resolves to 127.0.1.1 and whose route to
    anything but loopback goes out of 10.1.2.3; `routes` can be emptied (no network)."""
    routes = {"default": "10.1.2.3"}
    names = {"gpu17": ["127.0.1.1"], "login1": ["10.1.0.1"], "localhost": ["127.0.0.1"]}

    def resolve(name):
        if name[0].isdigit():
            return [name]
        return list(names.get(name, []))

    def source_address(ip):
        if ip.startswith("127."):
            return "127.0.0.1"
        return routes.get("default")

    monkeypatch.setattr(address.socket, "gethostname", lambda: "gpu17")
    monkeypatch.setattr(address, "resolve", resolve)
    monkeypatch.setattr(address, "source_address", source_address)
    monkeypatch.delenv("NBTRAIN_ADDRESS", raising=False)
    monkeypatch.delenv("NBTRAIN_HOST", raising=False)
    return routes


def test_a_host_named_127_0_1_1_reports_its_network_address(ubuntu_host):
    assert address.host_address() == "10.1.2.3"  # not gethostbyname(gethostname())


def test_the_address_toward_the_controller_is_preferred(ubuntu_host):
    assert address.host_address("login1") == "10.1.2.3"  # the interface toward login1
    assert address.host_address("127.0.0.1") == "127.0.0.1"  # all on this host: loopback


def test_without_any_route_it_falls_back_to_loopback_not_127_0_1_1(ubuntu_host):
    ubuntu_host.clear()
    assert address.host_address("login1") == "127.0.0.1"
    assert address.host_address() == "127.0.0.1"


def test_overrides_name_the_host_and_its_address(ubuntu_host, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOST", "node-b")
    monkeypatch.setenv("NBTRAIN_ADDRESS", "127.0.0.3")
    assert address.host_name() == "node-b"
    assert address.host_address("login1") == "127.0.0.3"
    assert address.machine_id().startswith("gpu17/")  # the real machine, for pid checks


def _info(eid, host, addr, launcher_rank=None, launcher_local_rank=None):
    return {
        "engine_id": eid,
        "host": host,
        "address": addr,
        "launcher_rank": launcher_rank,
        "launcher_local_rank": launcher_local_rank,
    }


def test_local_rank_counts_per_host_and_rank_0_hosts_the_rendezvous():
    # Engine ids interleave the hosts, as engines on two hosts register.
    infos = [
        _info(3, "node-b", "127.0.0.3"),
        _info(0, "node-a", "127.0.0.2"),
        _info(2, "node-a", "127.0.0.2"),
        _info(1, "node-b", "127.0.0.3"),
    ]
    ranks = rendezvous.assign_ranks(infos)
    master = rendezvous.master_address(ranks)
    envs = rendezvous.rank_envs(ranks, master, 29500)
    assert master == "127.0.0.2"  # engine 0 is rank 0, on node-a
    got = {
        eid: (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) for eid, env in envs.items()
    }
    assert got == {0: ("0", "0", "2"), 1: ("1", "0", "2"), 2: ("2", "1", "2"), 3: ("3", "1", "2")}
    assert {env["MASTER_ADDR"] for env in envs.values()} == {"127.0.0.2"}
    assert rendezvous.master_address(ranks, "10.9.9.9") == "10.9.9.9"  # --master-addr


def test_launcher_ranks_and_local_ranks_win():
    infos = [
        _info(0, "n2", "10.0.0.2", 2, 0),
        _info(1, "n1", "10.0.0.1", 1, 1),
        _info(2, "n1", "10.0.0.1", 0, 0),
        _info(3, "n2", "10.0.0.2", 3, 1),
    ]
    ranks = rendezvous.assign_ranks(infos)
    assert [r["engine_id"] for r in ranks] == [2, 1, 0, 3]
    envs = rendezvous.rank_envs(ranks, rendezvous.master_address(ranks), 1)
    assert envs[2]["MASTER_ADDR"] == "10.0.0.1"
    assert [envs[e]["LOCAL_RANK"] for e in (2, 1, 0, 3)] == ["0", "1", "0", "1"]


@pytest.mark.parametrize(
    "n, options, expected",
    [
        (8, {"nodes": 2}, (8, 2, 4)),
        (None, {"nodes": 2, "ntasks_per_node": 4}, (8, 2, 4)),
        (None, {"nodes": 3, "gpus_per_node": 8}, (24, 3, 8)),
        (2, {}, (2, 1, 2)),
    ],
)
def test_slurm_layout_fills_in_what_is_left_out(n, options, expected):
    n, slurm = resolve_layout(n, options)
    assert (n, slurm["nodes"], slurm["ntasks_per_node"]) == expected


@pytest.mark.parametrize(
    "n, options, message",
    [
        (8, {"nodes": 2, "ntasks_per_node": 3}, r"-n 8 does not match .* \(2 x 3 = 6\)"),
        (7, {"nodes": 2}, "do not divide over 2 nodes"),
        (2, {"gpus": 1}, "unknown slurm option"),
    ],
)
def test_slurm_layout_refuses_a_mismatch(n, options, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(n, options)
