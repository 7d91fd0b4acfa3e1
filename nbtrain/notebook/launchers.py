"""How engines are launched: ipyparallel configuration for local, MPI and Slurm.

nbtrain does not launch processes itself: it configures ipyparallel's own
launchers. What it adds is the engine environment (one OpenMP thread per rank,
nbtrain importable, inline figures) and, for Slurm, a batch script that places
`ntasks_per_node` ranks on each of `nodes` nodes (see `nbtrain.notebook.slurm` for the
job itself: its options, its wait in the queue, its end).
"""

from __future__ import annotations

import functools
import os

LAUNCHERS = ("local", "mpi", "slurm")

_ENGINE_SET_CLASSES = {
    "local": "LocalEngineSetLauncher",
    "mpi": "MPIEngineSetLauncher",
    "slurm": "SlurmEngineSetLauncher",
}

# {cluster_id}, {output_file} and {program_and_args} are filled in by ipyparallel; the
# rest by nbtrain. The output file holds the engines' own errors, shown if the job ends.
SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=nbtrain-{{cluster_id}}
#SBATCH --nodes={nodes}
#SBATCH --ntasks={ntasks}
#SBATCH --ntasks-per-node={ntasks_per_node}
#SBATCH --output={{output_file}}
{extra}export OMP_NUM_THREADS=1
srun {{program_and_args}}
"""


def engine_environment(launcher: str) -> dict[str, str]:
    """Variables every engine starts with (the launcher adds its own)."""
    # The folder holding the nbtrain package (this file is nbtrain/notebook/launchers.py).
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    env = {
        # N ranks on a few cores: one thread each, or they oversubscribe the CPUs.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": package_parent + (os.pathsep + path if path else ""),
        # Figures made on a rank display in the notebook as they would locally.
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    if launcher == "mpi" and hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI refuses root without these (containers, CI); harmless for MPICH.
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def slurm_template(
    nodes: int = 1,
    ntasks_per_node: int = 1,
    gpus_per_node: int = 0,
    gpus_per_task: int = 0,
    partition: str = "",
    account: str = "",
    time: str = "",
    options: str | list = "",
) -> str:
    """The sbatch script for the engines, before ipyparallel fills in its fields.

    ipyparallel adds partition/account/time lines only to its own default template,
    so nbtrain writes them here. `options` is extra sbatch lines (a string of lines
    or a list): "--qos=high" becomes "#SBATCH --qos=high"; a line that starts with
    "#" is kept as it is.
    """
    extra = [
        f"#SBATCH --{flag}={value}"
        for flag, value in (
            ("gpus-per-node", gpus_per_node),
            ("gpus-per-task", gpus_per_task),
            ("partition", partition),
            ("account", account),
            ("time", time),
        )
        if value
    ]
    lines = options.splitlines() if isinstance(options, str) else list(options)
    extra += [
        line.strip() if line.strip().startswith("#") else f"#SBATCH {line.strip()}"
        for line in lines
        if line.strip()
    ]
    return SLURM_TEMPLATE.format(
        nodes=nodes,
        ntasks=nodes * ntasks_per_node,
        ntasks_per_node=ntasks_per_node,
        extra="".join(line + "\n" for line in extra),
    )


@functools.lru_cache(maxsize=None)  # once a process: every start and restart asks
def mpi_flavour(mpiexec: str = "mpiexec") -> str | None:
    """Which MPI `mpiexec` is: "openmpi", "hydra" (MPICH, Intel MPI) or None (unknown)."""
    import subprocess

    try:
        done = subprocess.run(
            [mpiexec, "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = done.stdout + done.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return "hydra"
    return None


def mpi_env_args(names, flavour: str | None) -> list[str]:
    """mpiexec arguments that pass the variables `names` to ranks on other hosts.

    mpiexec starts a remote rank with the remote login's environment (ssh): the
    engine's variables must be named to reach it. Open MPI: `-x NAME` each; Hydra:
    `-genvlist A,B`; an unknown mpiexec gets none (its ranks get what its launcher gives).
    """
    names = sorted(names)
    if flavour == "openmpi":
        return [arg for name in names for arg in ("-x", name)]
    if flavour == "hydra":
        return ["-genvlist", ",".join(names)]
    return []


# Variables of the notebook's process that remote engines need too: where IPython finds
# the cluster's profile and connection files, and nbtrain's own settings.
_FORWARDED_PREFIXES = ("IPYTHONDIR", "JUPYTER_", "MPLCONFIGDIR", "NBTRAIN_", "GLOO_", "NCCL_")
# What ipyparallel gives an engine set when it starts it: the controller's address and key
# (passed by name, so the key is not on mpiexec's command line), the cluster and profile.
_IPP_VARIABLES = ("IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR")


def mpi_engine_launcher_class():
    """ipyparallel's MPIEngineSetLauncher, without MPI in the engines.

    ipyparallel starts each engine with `--mpi`: it imports mpi4py, so MPI_Init runs at
    boot, and Open MPI then listens on every interface (its TCP transport, ports from
    1024) on every rank, while nbtrain's ranks talk through torch.distributed and read
    their MPI ranks from the environment (engine_boot). Without the flag an engine
    needs no mpi4py; a cell that imports mpi4py still gets MPI as before.
    """
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher

    class NbtrainMPIEngineSetLauncher(MPIEngineSetLauncher):
        entrypoint_name = "mpi"  # cluster files name it so; ipyparallel's own can stop it

        @property
        def program(self):
            return self.engine_cmd

    return NbtrainMPIEngineSetLauncher


def engine_launcher(launcher: str):
    """What `ipyparallel.Cluster(engines=...)` gets for `launcher`."""
    if launcher == "slurm":
        from .slurm import engine_launcher_class

        return engine_launcher_class()
    if launcher == "mpi":
        return mpi_engine_launcher_class()
    return launcher


def engine_config(launcher: str, slurm: dict | None = None, mpi_args: list | None = None):
    """traitlets Config for ipyparallel's engine launcher of kind `launcher`.

    `mpi_args`: extra mpiexec arguments (hosts, a remote agent); the engine
    environment is passed on to remote ranks by name (`mpi_env_args`).
    """
    from traitlets.config import Config

    cfg = Config()
    section = cfg[_ENGINE_SET_CLASSES[launcher]]
    section.environment = engine_environment(launcher)
    if launcher == "mpi":
        names = set(section.environment) | set(_IPP_VARIABLES)
        names |= {name for name in os.environ if name.startswith(_FORWARDED_PREFIXES)}
        section.mpi_args = mpi_env_args(names, mpi_flavour()) + list(mpi_args or [])
    if launcher == "slurm":
        from .slurm import resolve_layout

        _, slurm = resolve_layout(None, slurm or {})  # checks the names, fills the defaults
        section.batch_template = slurm_template(**slurm)
    return cfg


def slurm_script(n: int, cluster_id: str, profile_dir: str, slurm: dict | None = None) -> str:
    """The batch script `%nbtrain start --launcher slurm` submits, rendered without sbatch.

    Written by ipyparallel's SlurmEngineSetLauncher from nbtrain's configuration, so
    what this returns is what sbatch would get (the file lands in `profile_dir`).
    """
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    from .slurm import resolve_layout

    n, slurm = resolve_layout(n, slurm or {})
    launcher = SlurmEngineSetLauncher(
        config=engine_config("slurm", slurm),
        work_dir=profile_dir,
        profile_dir=profile_dir,
        cluster_id=cluster_id,
    )
    launcher.write_batch_script(n)
    with open(launcher.batch_file) as f:
        return f.read()
