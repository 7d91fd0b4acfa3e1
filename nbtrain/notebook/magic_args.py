"""What `%nbtrain`'s flags mean beyond parsing: start's checks (rank count, Slurm
options and layout, a running cluster that differs from the one asked for) and the
`%nbtrain status` table. Plain functions; the magics call them."""

from __future__ import annotations

from IPython.core.error import UsageError


def _format_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _format_loss(loss) -> str:
    return "-" if loss is None else f"{loss:.4g}"


def format_status(rows: list[dict]) -> str:
    """`%nbtrain status` as a fixed-width table, one line per rank."""
    lines = [
        f"{'rank':>4}  {'pid':>7}  {'host':<16} {'device':<8} {'rss':>9} {'cuda':>9} "
        f"{'step':>6} {'loss':>10}  state"
    ]
    for r in rows:
        state = "dead" if not r["alive"] else ("busy" if r["busy"] else "idle")
        step = "-" if r.get("step") is None else r["step"]
        lines.append(
            f"{r['rank']:>4}  {r['pid']:>7}  {r['host'][:16]:<16} {str(r['device']):<8} "
            f"{_format_bytes(r['rss_bytes']):>9} {_format_bytes(r['cuda_bytes']):>9} "
            f"{step:>6} {_format_loss(r.get('loss')):>10}  {state}"
        )
    return "\n".join(lines)


# The flags (argparse names) each action reads. A flag given to an action that does not
# read it is refused, not ignored: `%nbtrain status --tp-size 4` used to do nothing.
_START_FLAGS = {
    "n", "backend", "launcher", "start_timeout_s", "timeout", "tp_size", "pg_timeout_s",
    "controller_ip", "master_addr", "mpi_args", "nodes", "ntasks_per_node",
    "gpus_per_node", "partition", "time", "account", "sbatch",
}  # fmt: skip
ACTION_FLAGS = {
    "start": _START_FLAGS,
    "restart": {"n"},
    "stop": set(),
    "status": set(),
    "dashboard": set(),
    "result": set(),
    "wait": {"timeout"},
    "pull": {"names", "targets"},
    "push": {"names", "targets"},
    "debug": {"rank", "frame", "all_frames", "interactive", "clear"},
}


def refuse_other_actions_flags(parser, args, bare) -> None:
    """Refuses a flag that `args.action` does not read, naming the actions that do.

    `bare`: what the parser makes of the action alone (its defaults); a flag counts as
    given when its value differs from that.

    Raises:
        UsageError: naming the flag, the action and where the flag belongs.
    """
    spelled = {}
    for action in parser._actions:
        if action.option_strings:
            spelled.setdefault(action.dest, max(action.option_strings, key=len))
    wanted = ACTION_FLAGS[args.action] | {"action", "names"}  # NAMES: each action checks
    for dest, value in vars(args).items():
        if dest not in wanted and value != getattr(bare, dest, value):
            flag = spelled.get(dest, dest)
            owners = [a for a, flags in ACTION_FLAGS.items() if dest in flags]
            where = " or ".join(f"`%nbtrain {a}`" for a in owners) or "no action"
            raise UsageError(f"%nbtrain {args.action} takes no {flag}: it is a flag of {where}")


def check_n(n: int | None) -> None:
    if n is not None and n < 1:
        raise UsageError(f"-n {n}: a cluster needs at least one rank, e.g. -n 2")


_SLURM_FLAGS = {
    "nodes": "--nodes",
    "ntasks_per_node": "--ntasks-per-node",
    "gpus_per_node": "--gpus-per-node",
    "partition": "--partition",
    "time": "--time",
    "account": "--account",
    "options": "--sbatch",
}


def slurm_options(args) -> dict:
    """The Slurm flags given, as `Cluster(slurm=...)` takes them.

    Raises:
        UsageError: a Slurm flag without `--launcher slurm`.
    """
    given = {
        "options" if key == "sbatch" else key: getattr(args, key)
        for key in (
            "nodes",
            "ntasks_per_node",
            "gpus_per_node",
            "partition",
            "time",
            "account",
            "sbatch",
        )
        if getattr(args, key) is not None
    }
    if given and args.launcher != "slurm":
        flags = ", ".join(_SLURM_FLAGS[k] for k in given)
        raise UsageError(f"{flags}: Slurm options, for `%nbtrain start --launcher slurm`")
    return given


def slurm_layout(args) -> tuple[int, dict]:
    from .slurm import resolve_layout

    try:
        return resolve_layout(args.n, args.slurm)
    except ValueError as err:
        raise UsageError(str(err)) from None


def start_differences(cluster, args) -> list[str]:
    """The flags of a `%nbtrain start` that the running cluster does not match."""
    asked = []
    if args.n is not None and args.n != cluster.world_size:
        asked.append(f"-n {args.n}")
    if args.launcher != cluster.launcher:
        asked.append(f"--launcher {args.launcher}")
    if args.backend is not None and cluster.backend is not None and args.backend != cluster.backend:
        asked.append(f"--backend {args.backend}")
    if args.tp_size != cluster.tp_size:
        asked.append(f"--tp-size {args.tp_size}")
    return asked
