"""Multi-node launchers: MPI for real on this machine, Slurm by its generated script."""
import shutil

import pytest

from nbtrain.notebook.launchers import slurm_script
from nbtrain.notebook.cluster import Cluster

from procs import wait_gone

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
    ipython.run_line_magic("nbtrain", "start -n 2 --launcher mpi --timeout 90")
    from nbtrain.notebook import magics

    cluster = magics.current_cluster()
    pids = cluster.pids()
    try:
        assert cluster.launcher == "mpi" and cluster.world_size == 2
        cluster.execute("from mpi4py import MPI\nmpi_rank = MPI.COMM_WORLD.Get_rank()\n"
                        "mpi_size = MPI.COMM_WORLD.Get_size()\ndist_rank = nbt.rank()")
        assert cluster.pull("mpi_rank") == [0, 1] == cluster.pull("dist_rank")
        assert cluster.pull("mpi_size") == [2, 2]
        ar = cluster.execute(TRAIN)
        weights = [line.split()[-1] for line in ar.stdout]
        assert len(weights) == 2 and weights[0] == weights[1]  # gradients were averaged
    finally:
        ipython.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []


def test_slurm_script_places_ranks_on_two_nodes(tmp_path):
    text = slurm_script(n=8, cluster_id="nbtrain-test", profile_dir=str(tmp_path),
                        slurm={"nodes": 2, "ntasks_per_node": 4, "gpus_per_task": 1,
                               "partition": "gpu", "account": "proj42", "time": "02:00:00"})
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    for expected in ("#SBATCH --job-name=nbtrain-nbtrain-test", "#SBATCH --nodes=2",
                     "#SBATCH --ntasks=8", "#SBATCH --ntasks-per-node=4",
                     "#SBATCH --gpus-per-task=1", "#SBATCH --partition=gpu",
                     "#SBATCH --account=proj42", "#SBATCH --time=02:00:00",
                     "export OMP_NUM_THREADS=1"):
        assert expected in lines, expected
    srun = next(line for line in lines if line.startswith("srun "))
    assert "ipyparallel.engine" in srun or "ipengine" in srun
    # sbatch runs with the cluster id and connection info in its environment
    # (IPP_CLUSTER_ID, IPP_CONNECTION_INFO): --export=ALL hands them to every task.
    assert "#SBATCH --export=ALL" in lines
    assert lines.index(srun) > max(i for i, l in enumerate(lines) if l.startswith("#SBATCH"))


def test_slurm_rejects_unknown_options_and_loopback_is_default():
    with pytest.raises(ValueError, match="unknown slurm option"):
        slurm_script(n=2, cluster_id="x", profile_dir="/tmp", slurm={"gpu": 1})
    assert Cluster(launcher="slurm").controller_ip == "127.0.0.1"
    with pytest.raises(ValueError, match="cannot reach a controller on 127.0.0.1"):
        Cluster(launcher="slurm").start()  # refused before anything is launched
    with pytest.raises(ValueError, match="launcher="):
        Cluster(launcher="pbs")
