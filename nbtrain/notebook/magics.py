"""The IPython extension: `%nbtrain` and `%%distributed`.

Thin by design: each magic parses its flags with IPython's magic_arguments and
calls one method of `nbtrain.Cluster`; the cluster owns every process and all the
waiting, streaming and error handling.

    %load_ext nbtrain
    %nbtrain start -n 2
    %%distributed
    x = torch.ones(1) * (nbt.rank() + 1)
    torch.distributed.all_reduce(x)
    print(x)
"""
from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .errors import NoClusterError
from .launchers import LAUNCHERS
from .cluster import Cluster

_NO_CLUSTER = "no nbtrain cluster is running: start one with `%nbtrain start -n 2`"

# The notebook's one cluster. Module-level so that reloading the extension (or
# running `%load_ext` twice) finds the running cluster instead of orphaning it.
_current: Cluster | None = None


def current_cluster() -> Cluster | None:
    """The cluster `%nbtrain start` made, if it is running."""
    return _current if _current is not None and _current.running else None


def _format_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def format_status(rows: list[dict]) -> str:
    """`%nbtrain status` as a fixed-width table, one line per rank."""
    lines = [f"{'rank':>4}  {'pid':>7}  {'host':<16} {'device':<8} {'rss':>9} {'cuda':>9}  state"]
    for r in rows:
        state = "dead" if not r["alive"] else ("busy" if r["busy"] else "idle")
        lines.append(f"{r['rank']:>4}  {r['pid']:>7}  {r['host'][:16]:<16} {str(r['device']):<8} "
                     f"{_format_bytes(r['rss_bytes']):>9} {_format_bytes(r['cuda_bytes']):>9}  "
                     f"{state}")
    return "\n".join(lines)


@magics_class
class NbtrainMagics(Magics):
    """`%nbtrain start|stop|restart|status|pull` and `%%distributed`."""

    @line_magic
    @magic_arguments()
    @argument("action", choices=["start", "stop", "restart", "status", "pull", "dashboard"],
              help="what to do with the cluster")
    @argument("name", nargs="?", help="pull: the variable to bring back from the ranks")
    @argument("-n", type=int, default=None, help="start: number of ranks (default: GPUs, or 2)")
    @argument("--backend", choices=["gloo", "nccl"], default=None,
              help="start: torch.distributed backend (default: nccl with CUDA, else gloo)")
    @argument("--launcher", choices=LAUNCHERS, default="local",
              help="start: how engines are launched (mpi/slurm for several nodes)")
    @argument("--timeout", type=float, default=120.0,
              help="start: seconds to wait for the engines to register and rendezvous")
    @argument("--ip", default="127.0.0.1",
              help="start: address the controller listens on (loopback by default)")
    @argument("-t", "--targets", default=None, help="pull: rank(s), e.g. 0 or 0,2")
    def nbtrain(self, line):
        """Start, stop, restart or inspect the notebook's cluster; pull a value back."""
        global _current
        args = parse_argstring(self.nbtrain, line)
        cluster = current_cluster()
        if args.action == "start":
            if cluster is not None:
                print(f"a cluster is already running ({cluster.world_size} ranks, "
                      f"id {cluster.cluster_id}); keeping it. "
                      "Use `%nbtrain restart` for fresh ranks or `%nbtrain stop` first.")
                return None
            _current = Cluster(n=args.n, backend=args.backend, launcher=args.launcher,
                               controller_ip=args.ip, start_timeout_s=args.timeout).start()
            devices = sorted({r["device"] for r in _current.ranks})
            print(f"nbtrain cluster ready: {_current.world_size} ranks on {', '.join(devices)} "
                  f"({_current.launcher} launcher, id {_current.cluster_id})")
            return None
        if args.action == "stop":
            if _current is None:
                print("no nbtrain cluster is running")
            else:
                _current.stop()
                _current = None
                print("nbtrain cluster stopped")
            return None
        if _current is None:
            raise NoClusterError(_NO_CLUSTER)
        if args.action == "restart":
            _current.restart()
            print(f"nbtrain cluster restarted: {_current.world_size} fresh ranks "
                  f"(id {_current.cluster_id})")
            return None
        if args.action == "status":
            print(format_status(_current.status()))
            return None
        if args.action == "dashboard":
            from .dashboard import Dashboard

            Dashboard().show().refresh(_current)  # later %%distributed cells feed it
            return None
        if not args.name:
            raise ValueError("usage: %nbtrain pull NAME [-t RANK]")
        targets = args.targets
        if targets is not None and targets.strip().isdigit():
            targets = int(targets)
        return _current.pull(args.name, targets)

    @cell_magic
    @magic_arguments()
    @argument("-t", "--targets", default=None, help="ranks to run on, e.g. 0,2 (default: all)")
    @argument("--timeout", type=float, default=None,
              help="seconds after which the cell fails, naming the ranks still busy")
    @argument("--no-stream", dest="stream", action="store_false",
              help="print each rank's output when the cell ends instead of live")
    @argument("--dashboard", action="store_true",
              help="show the live telemetry dashboard above the cell's output")
    def distributed(self, line, cell):
        """Run the cell on every rank (or --targets); each rank keeps its namespace."""
        args = parse_argstring(self.distributed, line)
        cluster = current_cluster()
        if cluster is None:
            raise NoClusterError(_NO_CLUSTER)
        from . import dashboard as widgets

        if args.dashboard:
            widgets.Dashboard().show()
        board = widgets.current()
        cluster.execute(cell, targets=args.targets, timeout=args.timeout, stream=args.stream,
                        on_poll=board.poll if board is not None else None)


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`."""
    ipython.register_magics(NbtrainMagics)


def unload_ipython_extension(ipython) -> None:
    """`%unload_ext nbtrain`: the magics go; a running cluster keeps running until exit."""
    ipython.magics_manager.magics["line"].pop("nbtrain", None)
    ipython.magics_manager.magics["cell"].pop("distributed", None)
