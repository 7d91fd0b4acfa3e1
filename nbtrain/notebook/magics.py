"""The IPython extension: `%nbtrain` and `%%distributed`.

Thin by design: each magic parses its flags (`%nbtrain` with one parser per action,
nbtrain.notebook.magic_parser; `%%distributed` with IPython's magic_arguments) and
calls one method of `nbtrain.Cluster`; the cluster owns every process and all the
waiting, streaming and error handling. The notebook's cluster is held by the magics
object that `%load_ext nbtrain` registers; `current_cluster()` finds it.

    %load_ext nbtrain
    %nbtrain start -n 2
    %%distributed
    x = torch.ones(1, device=nbt.get_context().device) * (nbt.rank() + 1)
    torch.distributed.all_reduce(x)   # on the rank's device: NCCL needs CUDA tensors
    print(x)
"""

from __future__ import annotations

import inspect

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .autodistribute import autodistributed_on, set_autodistributed
from .cluster import Cluster, _default_n
from .errors import NoClusterError
from .magic_args import (
    check_n,
    check_names,
    check_start,
    format_status,
    slurm_layout,
    start_differences,
)
from .magic_parser import ACTIONS, PARSER, flags_help, parse  # noqa: F401 (ACTIONS: API)
from .post_mortem import clear_failures, post_mortem, split_expression

_NO_CLUSTER = "no nbtrain cluster is running: start one with `%nbtrain start -n 2`"


def registered_magics(shell=None) -> "NbtrainMagics | None":
    """The NbtrainMagics that `%load_ext nbtrain` registered in `shell` (default: the
    running IPython), or None. It stays registered after `%unload_ext nbtrain`."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    manager = getattr(shell, "magics_manager", None)
    return None if manager is None else manager.registry.get(NbtrainMagics.__name__)


def current_cluster(shell=None) -> Cluster | None:
    """The cluster `%nbtrain start` made, if it is running (in `shell`, default the
    running IPython)."""
    magics = registered_magics(shell)
    return None if magics is None else magics.running_cluster()


def _targets(cluster: Cluster, targets: str | None):
    """`--targets` checked against the cluster: the string, or an int for one rank.

    Raises:
        UsageError: the targets are malformed or out of range.
    """
    if targets is None:
        return None
    try:
        cluster.targets(targets)
    except ValueError as err:
        raise UsageError(f"--targets {targets}: {err}") from None
    return int(targets) if targets.strip().lstrip("-").isdigit() else targets


_START_TIMEOUT_S = 120.0


@magics_class
class NbtrainMagics(Magics):
    """`%nbtrain start|stop|restart|status|pull|push|wait|result|dashboard|debug`,
    `%%distributed` and `%autodistributed`.

    The notebook's one cluster is `self.cluster`: the magics that `%load_ext nbtrain`
    registers keep it, as ipyparallel's magics keep their view, and a reload of the
    extension hands it to the new magics (`load_ipython_extension`)."""

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.cluster: Cluster | None = None

    def running_cluster(self) -> Cluster | None:
        """`self.cluster` if it is running."""
        cluster = self.cluster
        return cluster if cluster is not None and cluster.running else None

    def _require_cluster(self) -> Cluster:
        cluster = self.running_cluster()
        if cluster is None:
            raise NoClusterError(_NO_CLUSTER)
        return cluster

    @line_magic
    def nbtrain(self, line):
        """Manage the notebook's cluster of ranks. `%nbtrain ACTION --help` lists the
        flags of one action; a flag of another action is refused.

        Actions:
          start      start N ranks with torch.distributed ready (-n, --backend,
                     --launcher, --start-timeout-s, --pg-timeout-s, --tp-size,
                     --controller-ip, --master-addr; --mpi-args with --launcher
                     mpi); keeps a running cluster. With
                     --launcher slurm: --nodes, --ntasks-per-node, --gpus-per-node,
                     --partition, --time, --account, --sbatch=OPTION; the job's wait
                     in the queue is shown and not counted against --start-timeout-s
          stop       stop every process of the cluster
          restart    fresh ranks with empty namespaces (-n N to change the count)
          status     one line per rank: pid, host, device, memory, step, loss, state
                     (and the Slurm job: id, state, nodes)
          pull NAME  bring a variable (or attribute path such as
                     model.layers.0.mlp.fc.weight) back from the ranks: a list by
                     rank, one value with -t RANK; a sharded parameter comes back
                     as one full tensor, gathered on every rank
          push NAME [NAME ...]
                     send notebook variables to the ranks (-t for some ranks)
          wait       wait for the last `%%distributed --noblock` cell, then show its
                     output by rank and raise its errors as a blocking cell would
                     (--timeout S: stop waiting after S seconds; the cell runs on)
          result     the same without waiting: its output and errors if it has
                     finished, else which ranks are still running it
          dashboard  show the live telemetry dashboard
          debug [EXPR]
                     post-mortem of the last failing %%distributed cell on one rank
                     (--rank R, default the lowest failing): its frames and the
                     locals of the innermost (--frame N, 0 the outermost); with
                     EXPR (after the flags) evaluate it in that frame there; -i for
                     a prompt; --clear frees the kept failure; torch's, nbtrain's
                     and packages' frames are hidden (--all-frames lists them).
                     The other ranks are untouched; a rank keeps its failure
                     until its next cell

        Targets (-t/--targets): 0, -1 (the last rank), 0,2, 0:2, ::2, 1:.
        """
        line, expr = split_expression(line)  # debug's EXPR, verbatim
        args = parse(line)
        if args is None:  # --help
            return None
        if args.action == "debug":
            args.expr = expr
        elif args.action == "start":
            check_start(args, _default_n)
        elif args.action == "restart":
            check_n(args.n)
        elif args.action in ("pull", "push"):
            check_names(args)
        return getattr(self, f"_{args.action}")(args)

    def _start(self, args) -> None:
        cluster = self.running_cluster()
        if cluster is not None:
            asked = start_differences(cluster, args)
            if asked:
                # Keeping it would run the next cells somewhere the user did not ask for.
                raise UsageError(
                    f"a cluster is already running ({cluster.world_size} ranks, "
                    f"{cluster.launcher} launcher, tp {cluster.tp_size}, id "
                    f"{cluster.cluster_id}), and this start asks for {', '.join(asked)}: "
                    "`%nbtrain stop` first, then start again (or `%nbtrain restart -n N` "
                    "to change only the number of ranks)"
                )
            print(
                f"a cluster is already running ({cluster.world_size} ranks, "
                f"id {cluster.cluster_id}); keeping it. "
                "Use `%nbtrain restart` for fresh ranks or `%nbtrain stop` first."
            )
            return
        timeout = _START_TIMEOUT_S if args.start_timeout_s is None else args.start_timeout_s
        extra = {} if args.pg_timeout_s is None else {"pg_timeout_s": args.pg_timeout_s}
        extra["tp_size"] = args.tp_size
        if args.launcher == "slurm":
            slurm_layout(args)  # a wrong -n is a usage error, refused before submitting
        cluster = Cluster(
            n=args.n,
            backend=args.backend,
            launcher=args.launcher,
            controller_ip=args.controller_ip,
            start_timeout_s=timeout,
            slurm=args.slurm,
            master_addr=args.master_addr,
            mpi_args=args.mpi_args,
            **extra,
        )
        self.cluster = cluster = cluster.start()
        devices = sorted({r["device"] for r in cluster.ranks})
        job = f", Slurm job {cluster.job.job_id}" if cluster.job is not None else ""
        print(
            f"nbtrain cluster ready: {cluster.world_size} ranks on {', '.join(devices)} "
            f"({cluster.launcher} launcher{job}, id {cluster.cluster_id})"
        )

    def _stop(self, args) -> None:
        if self.cluster is None:
            print("no nbtrain cluster is running")
            return
        from . import dashboard

        dashboard.settle()  # the last cell's picture, before the engines go
        self.cluster.stop()
        self.cluster = None
        print("nbtrain cluster stopped")

    def _restart(self, args) -> None:
        cluster = self.cluster
        if cluster is None:
            raise NoClusterError(_NO_CLUSTER)
        tp = getattr(cluster, "tp_size", 1)
        if args.n is not None and args.n % tp:
            raise UsageError(
                f"restart -n {args.n}: the cluster has tensor-parallel size {tp}, "
                f"which must divide the number of ranks, e.g. -n {2 * tp}"
            )
        cluster.restart(n=args.n)
        print(
            f"nbtrain cluster restarted: {cluster.world_size} fresh ranks (id {cluster.cluster_id})"
        )

    def _status(self, args) -> None:
        cluster = self._require_cluster()
        rows = cluster.status()
        job = cluster.job_status()
        if job is not None:
            print(job)
        print(format_status(rows))
        pending = cluster.pending
        if pending is not None:
            print(_pending_line(pending))

    def _wait(self, args) -> None:
        from . import dashboard as widgets

        board = widgets.current()
        cluster = self._require_cluster()
        if cluster.wait(args.timeout, board.poll if board is not None else None) is None:
            print(
                f"{_pending_line(cluster.pending)}; it keeps running: "
                "`%nbtrain wait` again to collect it"
            )

    def _result(self, args) -> None:
        cluster = self._require_cluster()
        if cluster.result() is None:
            print(_pending_line(cluster.pending))

    def _dashboard(self, args) -> None:
        from .dashboard import Dashboard

        Dashboard().show().refresh(self._require_cluster())  # later %%distributed cells feed it

    def _debug(self, args) -> None:
        cluster = self._require_cluster()
        try:
            if args.clear:
                ranks = clear_failures(cluster, args.rank)
                print(f"cleared the failure of rank(s) {', '.join(map(str, ranks)) or 'none'}")
                return
            debugger = post_mortem(cluster, args.rank, args.frame, args.all_frames)
        except ValueError as err:
            raise UsageError(f"%nbtrain debug: {err}") from None
        if args.interactive:
            debugger.interact()
        else:
            print(debugger.show(args.expr) if args.expr else debugger.render())

    def _pull(self, args):
        cluster = self._require_cluster()
        return cluster.pull(args.names[0], _targets(cluster, args.targets))

    def _push(self, args) -> None:
        cluster = self._require_cluster()
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(
                f"%nbtrain push: {', '.join(missing)} not defined in the "
                "notebook; run the cell that defines it first"
            )
        targets = _targets(cluster, args.targets)
        cluster.push({n: self.shell.user_ns[n] for n in args.names}, targets)

    @cell_magic
    @magic_arguments()
    @argument(
        "-t",
        "--targets",
        default=None,
        help="ranks to run on: 0, -1 (last), 0,2, 0:2, ::2, 1: (default: all)",
    )
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds after which the cell fails, naming the ranks still busy",
    )
    @argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print each rank's output when the cell ends instead of live",
    )
    @argument(
        "--dashboard",
        action="store_true",
        help="show the live telemetry dashboard above the cell's output",
    )
    @argument(
        "--noblock",
        dest="noblock",
        action="store_true",
        default=False,
        help="return at once; the ranks run the cell while the notebook stays "
        "free; `%%nbtrain wait` or `%%nbtrain result` collects it",
    )
    @argument(
        "--block",
        dest="noblock",
        action="store_false",
        help="wait for the cell to finish (the default)",
    )
    def distributed(self, line, cell):
        """Run the cell on every rank (or --targets); each rank keeps its namespace.

        Flags: -t/--targets RANKS (0, -1, 0,2, 0:2, ::2, 1:), --timeout S, --no-stream,
        --dashboard, --block (the default: wait for the cell) / --noblock (return at
        once; `%nbtrain wait` or `%nbtrain result` shows its output and errors later).
        """
        args = parse_argstring(self.distributed, line)
        cluster = self._require_cluster()
        targets = _targets(cluster, args.targets)
        from . import dashboard as widgets

        if args.dashboard:
            widgets.Dashboard(since_cell=True).show()  # this cell's steps only
        board = widgets.current()
        if args.noblock:
            pending = cluster.submit(
                cell, targets=targets, timeout=args.timeout, stream=args.stream
            )
            ranks = ", ".join(map(str, pending.ranks))
            print(
                f"running on ranks {ranks} without blocking: `%nbtrain wait` shows its "
                "output and errors (`%nbtrain result` checks without waiting)"
            )
            if board is not None:  # the dashboard keeps updating while the notebook is free
                from .pending import feed_dashboard

                feed_dashboard(cluster.pending, board)
            return
        cluster.execute(
            cell,
            targets=targets,
            timeout=args.timeout,
            stream=args.stream,
            on_poll=board.poll if board is not None else None,
        )

    @line_magic
    def autodistributed(self, line):
        """`%autodistributed [on|off]`: run every following cell on the ranks.

        While on, each cell runs as if it began with `%%distributed`, except cells
        that start with `%` or `!` (magics and shell commands run locally).
        With no argument it toggles.
        """
        arg = line.strip().lower()
        if arg not in ("", "on", "off"):
            raise UsageError(f"%autodistributed {line.strip()}: use on, off, or nothing to toggle")
        on = not autodistributed_on(self.shell) if arg == "" else arg == "on"
        set_autodistributed(self.shell, on)
        print(
            "autodistributed on: cells run on the ranks (`%autodistributed off` to stop)"
            if on
            else "autodistributed off: cells run in the notebook"
        )


def _pending_line(pending) -> str:
    ranks = ", ".join(map(str, pending.busy()))
    if not ranks:
        return "the non-blocking cell has finished: `%nbtrain result` shows it"
    return f"still running on ranks {ranks} (a non-blocking cell)"


# `%nbtrain`'s parser where IPython's magic_arguments keeps a magic's (parse_argstring),
# and its help dedented as `%nbtrain?` shows it, as magic_arguments does.
NbtrainMagics.nbtrain.parser = PARSER
_doc = inspect.cleandoc(NbtrainMagics.nbtrain.__doc__)
NbtrainMagics.nbtrain.__doc__ = f"{_doc}\n\n{flags_help()}"


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`: registers the magics. The magics registered before (a
    `%reload_ext nbtrain`, or a load after `%unload_ext nbtrain`) hand over their
    cluster, so a running cluster is never orphaned."""
    magics = NbtrainMagics(shell=ipython)
    magics.cluster = getattr(registered_magics(ipython), "cluster", None)
    ipython.register_magics(magics)


def unload_ipython_extension(ipython) -> None:
    """`%unload_ext nbtrain`: the magics go; a running cluster keeps running until exit
    (the magics object stays in IPython's registry, holding it for the next load)."""
    ipython.magics_manager.magics["line"].pop("nbtrain", None)
    ipython.magics_manager.magics["cell"].pop("distributed", None)
    ipython.magics_manager.magics["line"].pop("autodistributed", None)
    set_autodistributed(ipython, False)
