"""Multi-node launchers: MPI for real on this machine; Slurm by its generated script and
its checks here (test_slurm.py runs it for real)."""

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from IPython.core.error import UsageError
from procs import wait_gone

from nbtrain.notebook import slurm
from nbtrain.notebook.cluster import Cluster
from nbtrain.notebook.launchers import slurm_script
from nbtrain.notebook.watchdog import Watchdog

TRAIN = """
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.full((2, 4), float(nbt.rank() + step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
    opt.step()
print("trained", model.weight.sum().item())
"""


def _mpi_missing():
    if shutil.which("mpiexec") is None:
        return "mpiexec not found (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (pip install mpi4py)"
    return None


@pytest.mark.timeout(180)
@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_mpi_launcher_ranks_equal_mpi_ranks(ipython):
    ipython.run_line_magic("nbtrain", "start -n 2 --launcher mpi --start-timeout-s 90")
    from nbtrain.notebook import magics

    cluster = magics.current_cluster()
    pids = cluster.pids()
    try:
        assert cluster.launcher == "mpi" and cluster.world_size == 2
        cluster.execute(
            "from mpi4py import MPI\nmpi_rank = MPI.COMM_WORLD.Get_rank()\n"
            "mpi_size = MPI.COMM_WORLD.Get_size()\ndist_rank = nbt.rank()"
        )
        assert cluster.pull("mpi_rank") == [0, 1] == cluster.pull("dist_rank")
        assert cluster.pull("mpi_size") == [2, 2]
        ar = cluster.execute(TRAIN)
        weights = [line.split()[-1] for line in ar.stdout]
        assert len(weights) == 2 and weights[0] == weights[1]  # gradients were averaged
    finally:
        ipython.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []


def test_slurm_script_places_ranks_on_two_nodes(tmp_path):
    text = slurm_script(
        n=8,
        cluster_id="nbtrain-test",
        profile_dir=str(tmp_path),
        slurm={
            "nodes": 2,
            "gpus_per_node": 4,
            "partition": "gpu",
            "account": "proj42",
            "time": "02:00:00",
            "options": ["--qos=high", "#SBATCH --exclusive"],
        },
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    for expected in (
        "#SBATCH --job-name=nbtrain-nbtrain-test",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks=8",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --time=02:00:00",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
        "export OMP_NUM_THREADS=1",
    ):
        assert expected in lines, expected
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    assert output.startswith(f"#SBATCH --output={tmp_path}")  # the engines' errors land there
    srun = next(line for line in lines if line.startswith("srun "))
    assert "ipyparallel.engine" in srun or "ipengine" in srun
    # sbatch runs with the cluster id and connection info in its environment
    # (IPP_CLUSTER_ID, IPP_CONNECTION_INFO): --export=ALL hands them to every task.
    assert "#SBATCH --export=ALL" in lines
    assert lines.index(srun) > max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))


def test_slurm_options_are_checked_before_anything_is_submitted(ipython):
    with pytest.raises(ValueError, match="unknown slurm option"):
        slurm_script(n=2, cluster_id="x", profile_dir="/tmp", slurm={"gpu": 1})
    with pytest.raises(ValueError, match=r"-n 8 does not match .* \(2 x 3 = 6\)"):
        Cluster(n=8, launcher="slurm", slurm={"nodes": 2, "ntasks_per_node": 3})
    assert Cluster(launcher="slurm", slurm={"nodes": 2, "ntasks_per_node": 3}).n == 6
    with pytest.raises(ValueError, match="need launcher='slurm'"):
        Cluster(n=2, slurm={"partition": "gpu"})
    with pytest.raises(UsageError, match="--partition: Slurm options"):
        ipython.run_line_magic("nbtrain", "start -n 2 --partition gpu")
    with pytest.raises(UsageError, match="-n 3 ranks do not divide over 2 nodes"):
        ipython.run_line_magic("nbtrain", "start -n 3 --launcher slurm --nodes 2")
    with pytest.raises(ValueError, match="launcher="):
        Cluster(launcher="pbs")


def test_start_flags_reach_the_cluster(ipython, monkeypatch):
    seen = []

    class Started(Exception):
        pass

    def start(self):
        seen.append(self)
        raise Started

    monkeypatch.setattr(Cluster, "start", start)
    with pytest.raises(Started):
        ipython.run_line_magic(
            "nbtrain",
            "start --launcher slurm --nodes 2 --gpus-per-node 4 "
            "--partition gpu --time 02:00:00 --account proj "
            "--controller-ip 10.1.0.1 --master-addr 10.2.0.5 "
            "--sbatch=--qos=high --sbatch=--exclusive",
        )
    cluster = seen[0]
    assert (cluster.n, cluster.controller_ip, cluster.master_addr_override) == (
        8,
        "10.1.0.1",
        "10.2.0.5",
    )
    assert cluster.slurm == {
        "nodes": 2,
        "ntasks_per_node": 4,
        "gpus_per_node": 4,
        "partition": "gpu",
        "time": "02:00:00",
        "account": "proj",
        "options": ["--qos=high", "--exclusive"],
    }


@pytest.mark.parametrize(
    "where, refused",
    [
        ({"gpu1": ("gpu1", "10.0.0.11"), "gpu2": ("gpu2", "10.0.0.12")}, True),
        ({"here": (socket.gethostname(), "10.0.0.1")}, False),
        ({"n1": ("n1", "127.0.0.1")}, False),  # a node that is this host by address
        ({}, False),  # sinfo not there or says nothing: sbatch will tell
    ],
    ids=["other-hosts", "this-host", "loopback-node", "unknown"],
)
def test_a_loopback_controller_is_refused_only_for_nodes_on_other_hosts(
    monkeypatch, where, refused
):
    monkeypatch.setattr(slurm, "node_hosts", lambda nodes="", partition="": where)
    if refused:
        with pytest.raises(
            ValueError,
            match="gpu1, gpu2 are other hosts and cannot reach a controller on 127.0.0.1",
        ):
            slurm.refuse_loopback("127.0.0.1", partition="gpu")
    else:
        slurm.refuse_loopback("127.0.0.1", partition="gpu")
    slurm.refuse_loopback("10.0.0.1", nodes="gpu[1-2]")  # a routable controller: never refused
    assert Cluster(launcher="slurm").controller_ip == "127.0.0.1"  # loopback stays the default


def test_a_loopback_controller_is_refused_once_the_job_landed_elsewhere(monkeypatch):
    hosts = {"here": (socket.gethostname(), "10.0.0.1"), "gpu2": ("gpu2", "10.0.0.12")}
    monkeypatch.setattr(
        slurm,
        "node_hosts",
        lambda nodes="", partition="": {k: v for k, v in hosts.items() if not nodes or k in nodes},
    )
    slurm.refuse_loopback("127.0.0.1", partition="all")  # it might land here: submit
    slurm.refuse_loopback("127.0.0.1", nodes="here")
    with pytest.raises(ValueError, match="gpu2 are other hosts"):
        slurm.refuse_loopback("127.0.0.1", nodes="here,gpu2")


def test_a_job_that_ended_early_shows_the_end_of_its_output(tmp_path):
    log = tmp_path / "engines.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)) + "ModuleNotFoundError: torch\n")
    job = slurm.SlurmJob("77", str(log))
    job.state, job.reason = "FAILED", "NonZeroExitCode"
    message = str(job.ended_error("before its engines started"))
    assert message.startswith("Slurm job 77 FAILED (NonZeroExitCode): the job ended before")
    assert message.endswith("line 29\nModuleNotFoundError: torch") and "line 17" not in message
    assert not job.running()


LAUNCHER = """
import subprocess, sys, time
sys.stdin.readline()  # started: now the child that will outlive us
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_the_watchdog_ends_children_a_launcher_started_after_it_was_watched():
    # ipyparallel starts the controller in a session of its own; its schedulers start a
    # moment later. A stop in between orphaned them: the watchdog ends the whole group.
    leader = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER],
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    dog, child = Watchdog(), None
    try:
        dog.watch_launcher(leader.pid)
        leader.stdin.write("go\n")
        leader.stdin.flush()
        child = int(leader.stdout.readline())
        assert child not in dog.pids()  # started after the watch
        leader.kill()
        leader.wait()
        dog.proc.stdin.close()  # the notebook's kernel dies
        dog.proc.wait(timeout=30)
        assert wait_gone([child], timeout_s=10) == []
    finally:
        leader.kill()
        if child is not None and wait_gone([child], timeout_s=0):
            os.kill(child, signal.SIGKILL)  # only if the test failed: our own child
