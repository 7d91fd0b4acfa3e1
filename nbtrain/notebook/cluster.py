"""A persistent cluster of ranks that lives as long as the notebook.

`Cluster` starts N ipyparallel engines, gives each one its torchrun variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT; see
`nbtrain.notebook.rendezvous`) and runs `nbtrain.init_distributed()` on all of them, so
torch.distributed is ready before the first cell (`nbtrain.notebook.cluster_boot`;
`status()` is `nbtrain.notebook.cluster_status`). The magics in
`nbtrain.notebook.magics` are a thin layer over this class.

Nothing assumes one host: each engine reports its host and an address of it that
the others can reach (`nbtrain.notebook.address`); MASTER_ADDR is rank 0's address.
With the Slurm launcher the engines are one batch job (`nbtrain.notebook.slurm`).

Security: the controller listens on 127.0.0.1 unless `controller_ip` says
otherwise, and every message is signed with the key ipyparallel generates per
cluster (HMAC-SHA256); nbtrain opens no listener of its own.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time

from ..comm.layout import Layout
from . import cluster_boot as _boot
from . import engine_pull
from . import slurm as _slurm
from . import teardown as _teardown
from .cell_run import rank_labels, run_cell, submit_cell
from .cluster_status import rank_rows
from .errors import DistributedError, RankDiedError
from .launchers import LAUNCHERS
from .leftovers import _LIVE, live_clusters, stop_leftover_clusters  # noqa: F401 (API)
from .pending import PendingCell, refuse_while_pending
from .procs import pid_alive
from .targets import one_rank, select_ranks
from .watchdog import Watchdog

_STOP_GRACE_S = 5.0
# How long stop() waits for idle local engines to leave by themselves (exit_now)
# before ipyparallel signals whatever is left.
_EXIT_WAIT_S = 3.0
# Request ids the ipyparallel Client keeps (`client.history` gains one per rank per cell,
# status query or pull, for as long as the cluster runs): trimmed to this many.
HISTORY_KEPT = 1000
_JOB_END_S = 20.0  # a cancelled job's steps end within Slurm's KillWait (2 s in the tests)
# Message digests the client's session remembers (replay protection; jupyter_client keeps
# 65,536, ~10 MB): ~16 messages a cell at 3 ranks, so the last ~250 cells' (620 KB).
CLIENT_DIGESTS = 4096


class Cluster:
    """N ranks in ipyparallel engines, each with torch.distributed initialised.

    Args:
        n: number of ranks; default one per GPU, or 2 CPU ranks without CUDA.
        backend: "nccl", "gloo" or None (nccl with CUDA, else gloo).
        launcher: "local" (default), "mpi" (mpiexec) or "slurm" (sbatch + srun).
        controller_ip: address the controller listens on; loopback by default.
            Engines on other hosts need an address of this host they can reach;
            with "slurm", loopback is refused only when a node of the job is another host.
        start_timeout_s: how long to wait for engines to register and rendezvous,
            counted from when the engines start (time in Slurm's queue is not counted).
        pg_timeout_s: torch.distributed process-group timeout on the ranks.
        tp_size: tensor-parallel size given to `init_distributed` on every rank.
        slurm: options for the slurm launcher: nodes, ntasks_per_node, gpus_per_node,
            gpus_per_task, partition, account, time, options (extra sbatch lines,
            e.g. ["--qos=high"]). `n` must equal nodes x ntasks_per_node (refused
            before submitting); either may be left out and is then derived.
        master_addr: the rendezvous address (MASTER_ADDR); default rank 0's address.
        mpi_args: extra mpiexec arguments for launcher="mpi" (a list, or one string
            split like a shell line), e.g. "--host node1:2,node2:2" for ranks on two
            hosts; the engines' environment is passed to remote ranks by name.
        profile_dir: ipyparallel profile directory (default: ipyparallel's).
    """

    def __init__(
        self,
        n: int | None = None,
        backend: str | None = None,
        launcher: str = "local",
        controller_ip: str = "127.0.0.1",
        start_timeout_s: float = 120.0,
        pg_timeout_s: float = 600.0,
        slurm: dict | None = None,
        profile_dir: str | None = None,
        tp_size: int = 1,
        master_addr: str | None = None,
        mpi_args: list | str | None = None,
    ):
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher={launcher!r}: use one of {', '.join(LAUNCHERS)}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'gloo', 'nccl' or None to pick")
        if n is not None and n < 1:
            raise ValueError(f"n={n}: a cluster needs at least one rank")
        if slurm and launcher != "slurm":
            raise ValueError(
                f"slurm options {sorted(slurm)} need launcher='slurm', not {launcher!r}"
            )
        if mpi_args and launcher != "mpi":
            raise ValueError(f"mpi_args need launcher='mpi', not {launcher!r}")
        if isinstance(mpi_args, str):
            mpi_args = shlex.split(mpi_args)
        self.mpi_args = list(mpi_args or [])
        if launcher == "slurm":
            n, slurm = _slurm.resolve_layout(n, slurm or {})  # before anything is submitted
        self.n, self.backend, self.launcher, self.tp_size = n, backend, launcher, tp_size
        self.controller_ip, self.slurm = controller_ip, dict(slurm or {})
        self.master_addr_override = master_addr
        self.master_addr = self.master_port = None
        # Process-group rebuilds after failed cells since the ranks booted (recover.py):
        # the ranks' abort key for the current group carries it.
        self.recovery_generation = 0
        self.job: _slurm.SlurmJob | None = None  # the engines' Slurm job, if any
        self.start_s: float | None = None  # seconds from start() to ready ranks
        self.start_timeout_s, self.pg_timeout_s = start_timeout_s, pg_timeout_s
        self.profile_dir = profile_dir
        self.client = None
        self.ranks: list[dict] = []  # per rank: engine_id, pid, host, device, ...
        self._ipp = None
        self._nannies: dict[int, list] = {}  # local engine pid -> its nanny processes
        self._stuck = None  # the AsyncResult of a cell that would not stop
        self._pending: PendingCell | None = None  # a --noblock cell not yet collected
        self._watchdog: Watchdog | None = None  # what this cluster started, to end it

    # ----------------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def cluster_id(self) -> str | None:
        return self._ipp.cluster_id if self._ipp is not None else None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def start(self) -> "Cluster":
        """Start the engines and initialise torch.distributed on every rank.

        With the Slurm launcher this submits the job, shows its state while it waits
        in the queue, and raises `slurm.SlurmError` with Slurm's reason at once if the
        job is refused, can never start, or ends before its ranks are ready.
        """
        if self.running:
            return self
        started = time.monotonic()
        n = self.n if self.n is not None else _default_n()
        Layout(tp_size=self.tp_size).check(n, who="Cluster")  # before any engine starts
        if self.launcher == "slurm":
            _slurm.refuse_loopback(self.controller_ip, partition=self.slurm.get("partition", ""))
        self._ipp = _boot.ipp_cluster(self, n)
        _LIVE.add(self)
        self._watchdog = Watchdog()
        try:
            self._ipp.start_controller_sync()
            self._watchdog.watch_file(self._ipp.cluster_file)
            _boot.record_launcher_processes(self)
            self._start_engines(n)
            _boot.record_launcher_processes(self)
            self.client = self._ipp.connect_client_sync()
            # The digests of the messages received (replay protection): every cell brings
            # ~25 per rank; jupyter_client keeps 65,536 (~7 MB), this the last 16,384.
            self.client.session.digest_history_size = CLIENT_DIGESTS
            _boot.wait_for_engines(self, n)
            _boot.boot(self, n)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started
        return self

    def _start_engines(self, n: int) -> None:
        """Launch the engines; for Slurm, wait (untimed) until the job runs."""
        self._ipp.start_engines_sync(n)
        if self.launcher != "slurm":
            return
        launcher = next(iter(self._ipp.engines.values()))
        self.job = _slurm.SlurmJob(launcher.job_id, launcher.output_file)
        self._watchdog.watch_job(self.job.job_id)
        self.job.wait_running()
        _slurm.refuse_loopback(self.controller_ip, nodes=self.job.nodes)

    def stop(self) -> None:
        """Stop every engine and the controller; no process of the cluster remains."""
        if self._ipp is None:
            return
        ipp_cluster, client, self._ipp, self.client = self._ipp, self.client, None, None
        _LIVE.discard(self)
        if client is not None:
            self._exit_idle_engines(client, ipp_cluster)
            client.close()
        # The controller leaves by ipyparallel's signal: JupyterLab's ipyparallel
        # extension, watching this cluster from its file, reads no exit code and wrote
        # the controller's whole log as a warning into the server's terminal.
        _teardown.remove_logs([getattr(ipp_cluster.controller, "output_file", None)])
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception:  # a launcher already gone; the pids below still get checked
            pass
        _teardown.end_loop_thread(ipp_cluster, _STOP_GRACE_S)
        if self.job is not None:
            self.job.cancel()  # by id (ipyparallel's scancel may not have run)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:  # ipyparallel stops by signal and does not wait
            watchdog.reap(_STOP_GRACE_S)
        if self.job is not None and not self.job.wait_ended(_JOB_END_S):
            print(
                f"nbtrain: {self.job.describe()} after scancel; Slurm ends its "
                "processes after its KillWait",
                file=sys.stderr,
            )
        self.ranks, self._stuck, self._pending, self.job = [], None, None, None
        if watchdog is not None:
            watchdog.stop()

    def _exit_idle_engines(self, client, ipp_cluster) -> None:
        """Idle local engines leave at once (teardown.exit_engines); busy ones, and
        engines of other hosts, are left to ipyparallel's signal."""
        busy = self._pending is not None or (self._stuck is not None and not self._stuck.done())
        local = {info["engine_id"]: info["pid"] for info in self.ranks if info.get("local")}
        if self.launcher != "local" or busy or not local or len(local) != len(self.ranks):
            return
        logs = [
            launcher.output_file
            for engine_set in ipp_cluster.engines.values()
            for launcher in getattr(engine_set, "launchers", {}).values()
            if getattr(launcher, "output_file", None)
        ]
        _teardown.exit_engines(client, local, _EXIT_WAIT_S, logs, self._nannies)

    def restart(self, n: int | None = None) -> "Cluster":
        """Fresh engines and a fresh rendezvous port; rank namespaces start empty.

        Args:
            n: the new number of ranks; None keeps the current number.
        """
        if n is not None and n < 1:
            raise ValueError(f"n={n}: a cluster needs at least one rank")
        if n is not None:
            self.n = n
        elif self.ranks:
            self.n = self.world_size
        self.stop()
        return self.start()

    def pids(self) -> list[int]:
        """Pids of every process this cluster started (controller, launchers, engines)."""
        return self._watchdog.pids() if self._watchdog is not None else []

    # --------------------------------------------------------------- operations
    def _require_running(self) -> None:
        if not self.running:
            raise DistributedError(
                "no nbtrain cluster is running: start one with "
                "`%nbtrain start -n 2` (or nbtrain.Cluster(n=2).start())"
            )

    def targets(self, targets=None) -> list[int]:
        """Sorted ranks `targets` means (see `targets.select_ranks`: None, an int, a
        slice, a list, or "0,2", "0:2", "::2", "1:", "-1")."""
        self._require_running()
        return select_ranks(targets, self.world_size)

    def engine_id(self, rank: int) -> int:
        return self.ranks[rank]["engine_id"]

    def execute(
        self,
        code: str,
        targets=None,
        timeout: float | None = None,
        stream: bool = True,
        on_poll=None,
    ):
        """Run `code` on the target ranks, streaming each rank's output as it comes.

        `on_poll(ranks, metadata, final)` observes the ranks while the cell runs
        (the dashboard reads their published telemetry from `metadata`).

        Raises:
            RankError: a rank raised; names the rank(s), holds the remote tracebacks.
            RankDiedError: a rank's process exited; `restart()` gives fresh ranks.
            CellTimeoutError: the cell outlived `timeout` seconds.

        Returns:
            The finished ipyparallel AsyncResult (`.stdout`, `.outputs` per target).
        """
        ranks = self._ready_ranks(targets)
        return run_cell(self, code, ranks, timeout, stream, on_poll)

    def _ready_ranks(self, targets) -> list[int]:
        ranks = self.targets(targets)
        refuse_while_pending(self._pending, "cannot run another cell")
        if self._stuck is not None and not self._stuck.done():
            raise DistributedError(
                "an earlier cell is still running on some ranks and did not "
                "respond to an interrupt; run `%nbtrain restart`"
            )
        self._stuck = None
        self._forget_finished()
        dead = self.dead_ranks(range(self.world_size))
        if dead:
            raise self.died(dead)
        return ranks

    def died(self, dead: list[int]) -> RankDiedError:
        """The error for ranks `dead`, naming their hosts when the ranks span several."""
        hosts = {r: info["host"] for r, info in enumerate(self.ranks)}
        return RankDiedError(dead, hosts if len(set(hosts.values())) > 1 else None)

    def _forget_finished(self) -> None:
        """Bound what the client keeps per request: an hours-long session sends
        thousands. ipyparallel drops a finished request's result and metadata itself
        (since 9.0; `purge_local_results` does it for older versions) but keeps its id
        in `client.history` for good."""
        client = self.client
        if len(client.history) <= 2 * HISTORY_KEPT:
            return
        old = client.history[:-HISTORY_KEPT]
        finished = [msg_id for msg_id in old if msg_id not in client.outstanding]
        if finished:
            client.purge_local_results(jobs=finished)
        del client.history[:-HISTORY_KEPT]

    def submit(
        self, code: str, targets=None, timeout: float | None = None, stream: bool = True
    ) -> PendingCell:
        """Start `code` on the target ranks and return at once (`%%distributed --noblock`).

        Collect it with `wait()` or `result()`; until then other cells, push and
        pull are refused. `timeout` counts from now and is enforced while waiting.
        """
        ranks = self._ready_ranks(targets)
        self._pending = PendingCell(
            submit_cell(self, code, ranks), ranks, timeout, stream, rank_labels(self)
        )
        return self._pending

    def wait(self, timeout: float | None = None, on_poll=None):
        """Wait for the non-blocking cell: its output by rank, its errors as `execute`'s.

        Returns the finished AsyncResult, or None if `timeout` seconds passed first
        (the cell keeps running; wait again later).
        """
        pending = self._pending
        if pending is None:
            raise DistributedError(
                "no non-blocking cell to wait for: run one with `%%distributed --noblock`"
            )
        try:
            ar = pending.follow(self, timeout, on_poll)
        except BaseException:
            self._pending = None
            raise
        if ar is not None:
            self._pending = None
        return ar

    def result(self):
        """`wait(timeout=0)`: the finished cell's AsyncResult, or None if still running."""
        return self.wait(timeout=0)

    @property
    def pending(self) -> PendingCell | None:
        """The non-blocking cell not yet collected, if any."""
        return self._pending

    def post_mortem(self, rank: int | None = None, frame: int = -1, all_frames: bool = False):
        """The frames of the last cell that raised on `rank` (default: the lowest failing
        rank), as `%debug` on one process, torch's and nbtrain's own frames hidden unless
        `all_frames`; see `nbtrain.notebook.post_mortem`.

        Raises:
            ValueError: no rank keeps a failure, `rank` does not, or `frame` is out of range.
        """
        from .post_mortem import post_mortem

        return post_mortem(self, rank, frame, all_frames)

    def push(self, namespace: dict, targets=None) -> None:
        """Copy the values of `namespace` into the namespace of the target ranks."""
        eids = [self.engine_id(r) for r in self.targets(targets)]
        refuse_while_pending(self._pending, "cannot push")
        self.client[eids].push(namespace, block=True)

    def pull(self, name: str, targets=None, timeout: float = 60.0):
        """Bring `name` back from the ranks.

        `name` is a variable or an attribute path; digits index lists and
        ModuleLists (`model.layers.0.mlp.fc.weight`).

        A sharded value (an `nbtrain.DistributedParameter`, or a tensor of a model
        sharded by nbtrain) comes back whole: every rank gathers it, a collective
        over all ranks whatever `targets` says, and rank 0's full tensor is
        returned. Any other value comes back as it is on the ranks: one value for
        a single rank (an int, or a string such as "1" or "-1"), else a list by rank.

        Raises:
            NameError: `name` is not defined on a target rank (names the ranks).
            DistributedError: the ranks did not answer within `timeout` seconds.
        """
        ranks = self.targets(targets)
        refuse_while_pending(self._pending, f"cannot pull {name}")
        view = self.client[[self.engine_id(r) for r in ranks]]
        kinds = self._get(view.apply_async(engine_pull.pull_kind, name), timeout)
        if set(kinds) in ({"param"}, {"state_dict"}):
            every = self.client[[self.engine_id(r) for r in range(self.world_size)]]
            full = every.apply_async(engine_pull.pull_full, name, kinds[0])
            return self._get(full, timeout)[0]
        missing = [str(r) for r, kind in zip(ranks, kinds) if kind == "missing"]
        if missing:
            raise NameError(
                f"{name.split('.')[0]!r} is not defined on rank(s) "
                f"{', '.join(missing)}: set it in a %%distributed cell or "
                "send it with `%nbtrain push`"
            )
        values = self._get(view.apply_async(engine_pull.pull_value, name), timeout)
        return values[0] if one_rank(targets) else list(values)

    def _get(self, async_result, timeout: float):
        """The result of `async_result`, or a DistributedError naming the fix."""
        try:
            return async_result.get(timeout=timeout)
        except TimeoutError:
            raise DistributedError(
                f"the ranks did not answer within {timeout:.0f} s (a cell "
                "still running?); run `%nbtrain restart`"
            ) from None

    def status(self) -> list[dict]:
        """Per rank: rank, engine_id, pid, host, address, node (Slurm's node name or None),
        local_rank, device, alive, busy, rss_bytes, cuda_bytes, step and loss (the
        telemetry step counter and newest loss; None when unknown). `job_status()` tells
        the Slurm job's id, state and nodes."""
        self._require_running()
        return rank_rows(self)

    # ------------------------------------------------- used by nbtrain.notebook.cell_run
    def dead_ranks(self, ranks) -> list[int]:
        """Ranks whose engine process has exited (or unregistered, for remote hosts, or
        whose Slurm job ended)."""
        if self.job is not None and not self.job.running():
            return list(ranks)  # the job ended (scancel, time limit, node failure): all of them
        registered = set(self.client.ids) if self.client is not None else set()
        dead = []
        for rank in ranks:
            info = self.ranks[rank]
            if info.get("local"):
                alive = pid_alive(info["pid"])
            else:
                alive = info["engine_id"] in registered
            if not alive:
                dead.append(rank)
        return dead

    def interrupt(self, ranks) -> None:
        """SIGINT to the ranks' engines (a rank blocked inside gloo/NCCL ignores it)."""
        remote = []
        for rank in ranks:
            info = self.ranks[rank]
            if info.get("local"):
                try:
                    os.kill(info["pid"], signal.SIGINT)
                except ProcessLookupError:
                    pass
            else:
                remote.append(info["engine_id"])
        if remote:
            self.client.send_signal("SIGINT", targets=remote, block=False)

    def mark_stuck(self, async_result) -> None:
        self._stuck = async_result

    def job_status(self) -> str | None:
        """The Slurm job as squeue sees it now ("Slurm job 42 RUNNING on node[1-2]"), or None."""
        if self.job is None:
            return None
        self.job.refresh()
        return self.job.describe()

    def __repr__(self) -> str:
        state = f"{self.world_size} ranks, {self.launcher}" if self.running else "stopped"
        if self.job is not None:
            state += f", job {self.job.job_id}"
        return f"<nbtrain.Cluster {self.cluster_id or ''} ({state})>"


def _default_n() -> int:
    import torch

    return torch.cuda.device_count() or 2
