"""The pieces of running on several hosts that need no second host: which interface gloo
binds to, how mpiexec passes the engines' environment on, a dead rank's host in its error.
Across real separate network stacks: tests/notebook/test_three_machines.py."""

import os
import socket
import sys

import pytest

from nbtrain.comm.store import interface_of, use_interface_toward
from nbtrain.notebook.errors import RankDiedError
from nbtrain.notebook.launchers import engine_config, mpi_env_args

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")


@linux_only
def test_the_interface_holding_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: no interface here holds it


@linux_only
def test_gloo_is_pointed_at_the_interface_toward_the_master(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # unset, and put back afterwards
    assert use_interface_toward("127.0.0.1") == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_users_own_gloo_interface_wins(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert use_interface_toward("127.0.0.1") is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_an_unresolvable_master_leaves_gloo_to_its_default(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    assert use_interface_toward("no-such-host.invalid") is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == ""


def test_mpiexec_passes_variables_by_name():
    assert mpi_env_args({"B", "A"}, "openmpi") == ["-x", "A", "-x", "B"]
    assert mpi_env_args({"B", "A"}, "hydra") == ["-genvlist", "A,B"]
    assert mpi_env_args({"A"}, None) == []


def test_the_mpi_engines_get_the_connection_by_name_and_the_users_arguments_last():
    cfg = engine_config("mpi", mpi_args=["--host", "node1:2,node2:2"])
    args = list(cfg.MPIEngineSetLauncher.mpi_args)
    assert args[-2:] == ["--host", "node1:2,node2:2"]
    flags = args[:-2]
    if flags:  # an mpiexec this machine knows (Open MPI or Hydra)
        named = " ".join(flags)
        for var in ("IPP_CONNECTION_INFO", "PYTHONPATH", "OMP_NUM_THREADS"):
            assert var in named, flags
        assert "{" not in named  # names only: the controller's key is not on the command line


def test_a_dead_rank_is_named_with_its_host_when_the_ranks_span_hosts():
    err = RankDiedError([3, 1], {1: "node1", 3: "node2"})
    assert str(err).startswith("rank 1 on node1, rank 3 on node2 died while the cell ran")
    assert str(RankDiedError([0])).startswith("rank 0 died while the cell ran")


def test_this_hosts_name_is_what_the_telemetry_reports(monkeypatch):
    from nbtrain.telemetry import sinks

    monkeypatch.delenv("NBTRAIN_HOST", raising=False)
    assert sinks.host_name() == socket.gethostname()
    monkeypatch.setenv("NBTRAIN_HOST", "node7")
    assert sinks.meta()["host"] == "node7"
