"""What `%nbtrain`'s flags mean beyond parsing (magic_parser parses them): each
action's checks (rank count, Slurm options and layout, --tp-size against the ranks, a
running cluster that differs from the one asked for, the names to pull or push) and the
`%nbtrain status` table. Plain functions; the magics call them."""

from __future__ import annotations

from IPython.core.error import UsageError

from ..comm.layout import Layout
from ..comm.renamed import warn_renamed


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


def check_n(n: int | None) -> None:
    if n is not None and n < 1:
        raise UsageError(f"-n {n}: a cluster needs at least one rank, e.g. -n 2")


def check_start(args, default_n) -> None:
    """`%nbtrain start`'s flags checked together, before anything is launched; fills
    in `args.slurm` and unquotes `args.mpi_args`. `default_n()`: the ranks when -n is
    not given.

    Raises:
        UsageError: naming the flag, its value and the fix.
    """
    check_n(args.n)
    args.slurm = slurm_options(args)
    if args.mpi_args is not None:
        if args.launcher != "mpi":
            raise UsageError("--mpi-args: mpiexec arguments, for `%nbtrain start --launcher mpi`")
        quote = args.mpi_args[:1]  # IPython's splitting keeps the quotes of "A B"
        if quote in ("'", '"') and args.mpi_args.endswith(quote) and len(args.mpi_args) > 1:
            args.mpi_args = args.mpi_args[1:-1]
    if args.timeout is not None:
        warn_renamed("`%nbtrain start --timeout`", "--start-timeout-s", stacklevel=3)
        if args.start_timeout_s is None:
            args.start_timeout_s = args.timeout
    tp = args.tp_size
    if tp != 1:
        n = args.n if args.n is not None else default_n()
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


def check_names(args) -> None:
    """`%nbtrain pull NAME` takes one name, `%nbtrain push NAME [NAME ...]` one or more.

    Raises:
        UsageError: no name, or more than one to pull.
    """
    if not args.names:
        example = "pull loss" if args.action == "pull" else "push lr batch_size"
        raise UsageError(f"%nbtrain {args.action}: name the variable(s), e.g. `%nbtrain {example}`")
    if args.action == "pull" and len(args.names) > 1:
        raise UsageError(
            f"%nbtrain pull takes one NAME, got {' '.join(args.names)}: pull them one at a time"
        )


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
