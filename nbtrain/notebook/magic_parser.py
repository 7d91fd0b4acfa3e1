"""`%nbtrain`'s command line: one parser per action, each flag defined once.

    %nbtrain start -n 2 --tp-size 2     # start's parser reads -n and --tp-size
    %nbtrain status --tp-size 2         # refused: status's parser has no --tp-size
    %nbtrain --help, %nbtrain start --help

An action's parser knows only that action's flags, so a flag given to the wrong action
is refused by the parser itself, with a message that names the flag, the actions that
take it and the flags this action takes. A flag two actions share (-n, -t/--targets)
is added by one helper, so both read it the same way.
"""

from __future__ import annotations

import argparse
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

from ..comm.renamed import RenamedFlag
from .launchers import LAUNCHERS

_TARGETS_HELP = "0, -1 (the last rank), 0,2, 0:2, ::2, 1: (default: all)"


class _Parser(MagicArgumentParser):
    """IPython's parser (a UsageError instead of an exit), with a --help, and errors
    that name the action and where its flags are explained."""

    explains = "lists the actions"

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.HelpFormatter)
        kwargs.setdefault("add_help", True)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (`{self.prog} --help` {self.explains})")


class ActionParser(_Parser):
    """One action's parser: it also refuses what the action does not take, naming
    where it belongs (argparse would only say "unrecognized arguments")."""

    explains = "explains its flags"

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            raise UsageError(_refusal(self, extras))
        return namespace, extras

    def takes(self) -> str:
        """What this action takes, as its help spells it: "NAME, -t/--targets"."""
        parts = []
        for action in self._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            parts.append("/".join(action.option_strings) or action.metavar or action.dest.upper())
        return ", ".join(parts)


def _refusal(parser: ActionParser, extras: list[str]) -> str:
    """`%nbtrain status takes no --tp-size: it is a flag of `%nbtrain start`; ...`."""
    action = parser.prog.split()[-1]
    takes = parser.takes()
    own = f"`%nbtrain {action}` takes " + (takes or "nothing")
    flags = [word for word in extras if word.startswith("-") and word != "-"]
    if not flags:
        return f"%nbtrain {action} takes no argument {extras[0]!r}: {own}"
    flag = flags[0].split("=")[0]
    owners = [name for name, p in ACTION_PARSERS.items() if flag in p._option_string_actions]
    where = " or ".join(f"`%nbtrain {name}`" for name in owners)
    belongs = f"it is a flag of {where}" if where else "no action has it"
    return f"%nbtrain {action} takes no {flag}: {belongs}; {own} (see `%nbtrain {action} -h`)"


# -- flags shared by several actions -----------------------------------------------------
def _add_n(p, text: str) -> None:
    p.add_argument("-n", type=int, default=None, metavar="N", help=text)


def _add_targets(p) -> None:
    p.add_argument(
        "-t",
        "--targets",
        default=None,
        help=f"ranks: {_TARGETS_HELP}; write --targets=-1: for a slice that starts with '-'",
    )


def _add_names(p, text: str) -> None:
    # nargs="*": the action names a missing NAME itself, with an example.
    p.add_argument("names", nargs="*", metavar="NAME", help=text)


# -- one function per action with flags ------------------------------------------------------
def _start_flags(p) -> None:
    _add_n(p, "number of ranks (default: one per GPU, or 2)")
    p.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="torch.distributed backend (default: nccl with CUDA, else gloo)",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="how engines are launched (mpi/slurm for several nodes)",
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for the engines to register and rendezvous (default 120)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel size (init_distributed(tp_size=T) on every rank; it must "
        "divide -n); output lines then show each rank's coordinates",
    )
    p.add_argument(
        "--pg-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="torch.distributed timeout in seconds for a collective that a peer never "
        "joins (default 600); a failing rank aborts the others' collectives at once, "
        "so this only bounds true deadlocks",
    )
    p.add_argument(
        "--controller-ip",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the controller listens on (loopback by default; engines on other "
        "hosts need an address of this host that they can reach)",
    )
    p.add_argument(
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="rendezvous address (MASTER_ADDR; default: rank 0's address)",
    )
    p.add_argument(
        "--mpi-args",
        default=None,
        metavar="ARGS",
        help="with --launcher mpi: extra mpiexec arguments in one quoted string, e.g. "
        '--mpi-args "--host node1:2,node2:2" for ranks on two hosts',
    )
    slurm = p.add_argument_group("with --launcher slurm")
    slurm.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1)")
    slurm.add_argument(
        "--ntasks-per-node",
        type=int,
        default=None,
        metavar="K",
        help="ranks per node (default -n / nodes); -n must equal nodes x K",
    )
    slurm.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="GPUs per node (#SBATCH --gpus-per-node)",
    )
    slurm.add_argument("--partition", default=None, help="the partition (queue)")
    slurm.add_argument(
        "--time", default=None, metavar="LIMIT", help="the job's time limit, e.g. 02:00:00"
    )
    slurm.add_argument("--account", default=None, help="the account to charge")
    slurm.add_argument(
        "--sbatch",
        action="append",
        default=None,
        metavar="OPTION",
        help="an extra sbatch option, repeatable; write --sbatch=--qos=high (with '=' "
        "as the option starts with '-')",
    )
    # The old flags (docs/naming.md), hidden, with a FutureWarning; the old `--timeout`
    # warns in magic_args.check_start, which lets --start-timeout-s win over it.
    p.add_argument("--tp", dest="tp_size", type=int, action=RenamedFlag, new="--tp-size")
    p.add_argument(
        "--pg-timeout", dest="pg_timeout_s", type=float, action=RenamedFlag, new="--pg-timeout-s"
    )
    p.add_argument("--ip", dest="controller_ip", action=RenamedFlag, new="--controller-ip")
    p.add_argument("--timeout", type=float, default=None, help=argparse.SUPPRESS)


def _restart_flags(p) -> None:
    _add_n(p, "the new number of ranks (default: as now)")


def _wait_flags(p) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for the cell (default: until done); the cell runs on",
    )


def _pull_flags(p) -> None:
    _add_names(p, "the variable or attribute path to bring back, e.g. model.0.weight")
    _add_targets(p)


def _push_flags(p) -> None:
    _add_names(p, "the notebook variables to send")
    _add_targets(p)


def _debug_flags(p) -> None:
    p.add_argument(
        "expr",
        nargs="*",
        metavar="EXPR",
        help="an expression to evaluate in the failing frame (after the flags)",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="the failing rank to open (default: the lowest failing rank)",
    )
    p.add_argument(
        "--frame",
        type=int,
        default=-1,
        metavar="N",
        help="the frame to open, 0 the outermost, -1 the innermost (the default)",
    )
    p.add_argument(
        "--all-frames",
        action="store_true",
        help="also list the frames of torch, nbtrain and installed packages",
    )
    p.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="a prompt that evaluates each line in the frame (q or empty ends)",
    )
    p.add_argument(
        "--clear",
        action="store_true",
        help="drop the kept failure (and the locals it keeps alive) on every rank, or on --rank R",
    )


# action: (one line for `%nbtrain --help`, more for `%nbtrain ACTION --help`, its flags)
_ACTIONS = {
    "start": (
        "start N ranks with torch.distributed ready; keeps a running cluster",
        "With --launcher slurm the job's wait in the queue is shown and not counted "
        "against --start-timeout-s.",
        _start_flags,
    ),
    "stop": ("stop every process of the cluster", "", None),
    "restart": ("fresh ranks with empty namespaces (-n N to change the count)", "", _restart_flags),
    "status": (
        "one line per rank: pid, host, device, memory, step, loss, state",
        "With the Slurm launcher, the job too: its id, state and nodes.",
        None,
    ),
    "pull": (
        "bring a variable back from the ranks",
        "A list by rank, one value with -t RANK; a sharded parameter comes back as one "
        "full tensor, gathered on every rank.",
        _pull_flags,
    ),
    "push": ("send notebook variables to the ranks", "", _push_flags),
    "wait": (
        "wait for the last `%%distributed --noblock` cell and show it",
        "Its output by rank, and its errors raised as a blocking cell would.",
        _wait_flags,
    ),
    "result": (
        "the last non-blocking cell's output if it has finished, without waiting",
        "Else which ranks are still running it.",
        None,
    ),
    "dashboard": ("show the live telemetry dashboard", "", None),
    "debug": (
        "post-mortem of the last failing %%distributed cell on one rank",
        "Its frames and the locals of the innermost; torch's, nbtrain's and packages' "
        "frames are hidden (--all-frames lists them). The other ranks are untouched; a "
        "rank keeps its failure until its next cell.",
        _debug_flags,
    ),
}
ACTIONS = tuple(_ACTIONS)


def build_parser() -> tuple[_Parser, dict[str, ActionParser]]:
    """`%nbtrain`'s parser and, by action, each action's own."""
    parser = _Parser(
        prog="%nbtrain",
        description="Manage the notebook's cluster of ranks. `%nbtrain ACTION --help` "
        "shows an action's flags.",
    )
    sub = parser.add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=ActionParser
    )
    parsers = {}
    for name, (line, more, add_flags) in _ACTIONS.items():
        # argparse %-formats a help string (not a description): "%%distributed" there
        # would print as "%distributed".
        p = sub.add_parser(name, help=line.replace("%", "%%"), description=f"{line}. {more}")
        if add_flags is not None:
            add_flags(p)
        parsers[name] = p
    return parser, parsers


PARSER, ACTION_PARSERS = build_parser()


def flags_help() -> str:
    """Each action's flags, one line each, for `%nbtrain?`."""
    lines = ["Flags by action (`%nbtrain ACTION --help` explains them):"]
    for name, parser in ACTION_PARSERS.items():
        line = f"  {name:<10} {parser.takes() or '-'}"
        lines.append(textwrap.fill(line, 80, subsequent_indent=" " * 13, break_on_hyphens=False))
    return "\n".join(lines)


def parse(line: str):
    """`line`'s namespace (its `action` and that action's flags), or None when it asked
    for help (printed).

    Raises:
        UsageError: an unknown action, or a flag the action does not take.
    """
    try:
        return PARSER.parse_argstring(line)
    except SystemExit as exit_:  # --help printed the help
        if exit_.code:
            raise
        return None
