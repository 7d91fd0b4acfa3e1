"""The IPython extension: `%nbtrain` and `%%distributed`.

Thin by design: each magic parses its flags with IPython's magic_arguments and
calls one method of `nbtrain.Cluster`; the cluster owns every process and all the
waiting, streaming and error handling.

    %load_ext nbtrain
    %nbtrain start -n 2
    %%distributed
    x = torch.ones(1, device=nbt.get_context().device) * (nbt.rank() + 1)
    torch.distributed.all_reduce(x)   # on the rank's device: NCCL needs CUDA tensors
    print(x)
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..comm.layout import Layout
from ..comm.renamed import RenamedFlag, warn_renamed
from .autodistribute import autodistributed_on, set_autodistributed
from .cluster import Cluster, _default_n
from .errors import NoClusterError
from .launchers import LAUNCHERS
from .magic_args import (
    check_n,
    format_status,
    refuse_other_actions_flags,
    slurm_layout,
    slurm_options,
    start_differences,
)
from .post_mortem import clear_failures, post_mortem, split_expression

_NO_CLUSTER = "no nbtrain cluster is running: start one with `%nbtrain start -n 2`"

# The notebook's one cluster. Module-level so that reloading the extension (or
# running `%load_ext` twice) finds the running cluster instead of orphaning it.
_current: Cluster | None = None


def current_cluster() -> Cluster | None:
    """The cluster `%nbtrain start` made, if it is running."""
    return _current if _current is not None and _current.running else None


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


def _require_cluster() -> Cluster:
    cluster = current_cluster()
    if cluster is None:
        raise NoClusterError(_NO_CLUSTER)
    return cluster


ACTIONS = (
    "start",
    "stop",
    "restart",
    "status",
    "pull",
    "push",
    "wait",
    "result",
    "dashboard",
    "debug",
)
_START_TIMEOUT_S = 120.0


@magics_class
class NbtrainMagics(Magics):
    """`%nbtrain start|stop|restart|status|pull|push|wait|result|dashboard|debug`,
    `%%distributed` and `%autodistributed`."""

    @line_magic
    @magic_arguments()
    @argument("action", choices=ACTIONS, help="what to do with the cluster (see above)")
    @argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="pull: the variable to bring back; push: the variables to send; "
        "debug: an expression to evaluate in the failing frame (after the flags)",
    )
    @argument(
        "-n",
        type=int,
        default=None,
        help="start/restart: number of ranks (start default: GPUs, or 2; restart default: as now)",
    )
    @argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="start: torch.distributed backend (default: nccl with CUDA, else gloo)",
    )
    @argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="start: how engines are launched (mpi/slurm for several nodes)",
    )
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="wait: seconds to wait for the cell (default: until done)",
    )
    @argument(
        "--start-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="start: seconds to wait for the engines to register and rendezvous (default 120)",
    )
    @argument(
        "--tp-size",
        type=int,
        default=1,
        metavar="T",
        help="start: tensor-parallel size (init_distributed(tp_size=T) on every rank; "
        "it must divide -n); output lines then show each rank's coordinates",
    )
    @argument(
        "--pg-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="start: torch.distributed timeout in seconds for a collective that a "
        "peer never joins (default 600); a failing rank aborts the others' "
        "collectives at once, so this only bounds true deadlocks",
    )
    @argument(
        "--controller-ip",
        default="127.0.0.1",
        metavar="ADDR",
        help="start: address the controller listens on (loopback by default; engines "
        "on other hosts need an address of this host that they can reach)",
    )
    # The old flags (docs/naming.md), with a FutureWarning; `start --timeout` is in nbtrain().
    @argument("--tp", dest="tp_size", type=int, action=RenamedFlag, new="--tp-size")
    @argument(
        "--pg-timeout", dest="pg_timeout_s", type=float, action=RenamedFlag, new="--pg-timeout-s"
    )
    @argument("--ip", dest="controller_ip", action=RenamedFlag, new="--controller-ip")
    @argument(
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="start: rendezvous address (MASTER_ADDR; default: rank 0's address)",
    )
    @argument(
        "--mpi-args",
        default=None,
        metavar="ARGS",
        help="start, mpi: extra mpiexec arguments in one quoted string, e.g. "
        '--mpi-args "--host node1:2,node2:2" for ranks on two hosts',
    )
    @argument("--nodes", type=int, default=None, help="start, slurm: number of nodes (default 1)")
    @argument(
        "--ntasks-per-node",
        type=int,
        default=None,
        metavar="K",
        help="start, slurm: ranks per node (default -n / nodes); -n must equal nodes x K",
    )
    @argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="start, slurm: GPUs per node (#SBATCH --gpus-per-node)",
    )
    @argument("--partition", default=None, help="start, slurm: the partition (queue)")
    @argument(
        "--time",
        default=None,
        metavar="LIMIT",
        help="start, slurm: the job's time limit, e.g. 02:00:00",
    )
    @argument("--account", default=None, help="start, slurm: the account to charge")
    @argument(
        "--sbatch",
        action="append",
        default=None,
        metavar="OPTION",
        help="start, slurm: an extra sbatch option, repeatable; write "
        "--sbatch=--qos=high (with '=' as the option starts with '-')",
    )
    @argument(
        "-t",
        "--targets",
        default=None,
        help="pull/push: ranks, e.g. 0, -1 (last), 0,2, 0:2, ::2, 1: (default: all); "
        "write --targets=-1: for a slice that starts with '-'",
    )
    @argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="debug: the failing rank to open (default: the lowest failing rank)",
    )
    @argument(
        "--frame",
        type=int,
        default=-1,
        metavar="N",
        help="debug: the frame to open, 0 the outermost, -1 the innermost (the default)",
    )
    @argument(
        "--all-frames",
        action="store_true",
        help="debug: also list the frames of torch, nbtrain and installed packages",
    )
    @argument(
        "-i",
        "--interactive",
        action="store_true",
        help="debug: a prompt that evaluates each line in the frame (q or empty ends)",
    )
    @argument(
        "--clear",
        action="store_true",
        help="debug: drop the kept failure (and the locals it keeps alive) on every "
        "rank, or on --rank R",
    )
    def nbtrain(self, line):
        """Manage the notebook's cluster of ranks.

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
        args = parse_argstring(self.nbtrain, line)
        bare = parse_argstring(self.nbtrain, args.action)
        refuse_other_actions_flags(self.nbtrain.parser, args, bare)
        args.expr = expr
        check_n(args.n)
        args.slurm = slurm_options(args)
        if args.mpi_args is not None:
            if args.launcher != "mpi":
                raise UsageError(
                    "--mpi-args: mpiexec arguments, for `%nbtrain start --launcher mpi`"
                )
            quote = args.mpi_args[:1]  # IPython's splitting keeps the quotes of "A B"
            if quote in ("'", '"') and args.mpi_args.endswith(quote) and len(args.mpi_args) > 1:
                args.mpi_args = args.mpi_args[1:-1]
        if args.action == "start" and args.timeout is not None:
            warn_renamed("`%nbtrain start --timeout`", "--start-timeout-s", stacklevel=2)
            if args.start_timeout_s is None:
                args.start_timeout_s = args.timeout
        tp = args.tp_size
        if args.action == "start" and tp != 1:
            n = args.n if args.n is not None else _default_n()
            if args.launcher == "slurm":
                n = slurm_layout(args)[0]
            if not Layout(tp_size=max(tp, 1)).fits(n) or tp < 1:  # the one layout rule
                raise UsageError(
                    f"--tp-size {tp} must divide the number of ranks ({n}), "
                    f"e.g. -n {2 * max(tp, 1)} --tp-size {max(tp, 1)}"
                )
        if args.pg_timeout_s is not None and args.pg_timeout_s <= 0:
            raise UsageError(
                f"--pg-timeout-s {args.pg_timeout_s:g}: give a positive number "
                "of seconds, e.g. --pg-timeout-s 120"
            )
        if args.action in ("pull", "push") and not args.names:
            example = "pull loss" if args.action == "pull" else "push lr batch_size"
            raise UsageError(
                f"%nbtrain {args.action}: name the variable(s), e.g. `%nbtrain {example}`"
            )
        if args.action == "pull" and len(args.names) > 1:
            raise UsageError(
                f"%nbtrain pull takes one NAME, got {' '.join(args.names)}: pull them one at a time"
            )
        return getattr(self, f"_{args.action}")(args)

    def _start(self, args) -> None:
        global _current
        cluster = current_cluster()
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
        _current = cluster.start()
        devices = sorted({r["device"] for r in _current.ranks})
        job = f", Slurm job {_current.job.job_id}" if _current.job is not None else ""
        print(
            f"nbtrain cluster ready: {_current.world_size} ranks on {', '.join(devices)} "
            f"({_current.launcher} launcher{job}, id {_current.cluster_id})"
        )

    def _stop(self, args) -> None:
        global _current
        if _current is None:
            print("no nbtrain cluster is running")
            return
        from . import dashboard

        dashboard.settle()  # the last cell's picture, before the engines go
        _current.stop()
        _current = None
        print("nbtrain cluster stopped")

    def _restart(self, args) -> None:
        if _current is None:
            raise NoClusterError(_NO_CLUSTER)
        tp = getattr(_current, "tp_size", 1)
        if args.n is not None and args.n % tp:
            raise UsageError(
                f"restart -n {args.n}: the cluster has tensor-parallel size {tp}, "
                f"which must divide the number of ranks, e.g. -n {2 * tp}"
            )
        _current.restart(n=args.n)
        print(
            f"nbtrain cluster restarted: {_current.world_size} fresh ranks "
            f"(id {_current.cluster_id})"
        )

    def _status(self, args) -> None:
        cluster = _require_cluster()
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
        cluster = _require_cluster()
        if cluster.wait(args.timeout, board.poll if board is not None else None) is None:
            print(
                f"{_pending_line(cluster.pending)}; it keeps running: "
                "`%nbtrain wait` again to collect it"
            )

    def _result(self, args) -> None:
        cluster = _require_cluster()
        if cluster.result() is None:
            print(_pending_line(cluster.pending))

    def _dashboard(self, args) -> None:
        from .dashboard import Dashboard

        Dashboard().show().refresh(_require_cluster())  # later %%distributed cells feed it

    def _debug(self, args) -> None:
        cluster = _require_cluster()
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
        cluster = _require_cluster()
        return cluster.pull(args.names[0], _targets(cluster, args.targets))

    def _push(self, args) -> None:
        cluster = _require_cluster()
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
        cluster = _require_cluster()
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


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`."""
    ipython.register_magics(NbtrainMagics)


def unload_ipython_extension(ipython) -> None:
    """`%unload_ext nbtrain`: the magics go; a running cluster keeps running until exit."""
    ipython.magics_manager.magics["line"].pop("nbtrain", None)
    ipython.magics_manager.magics["cell"].pop("distributed", None)
    ipython.magics_manager.magics["line"].pop("autodistributed", None)
    set_autodistributed(ipython, False)
