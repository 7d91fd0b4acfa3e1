"""The magics run from a test's IPython shell (the `ipython` fixture of
tests/notebook/conftest.py): a %%distributed cell, a %nbtrain line, any magic captured."""

from __future__ import annotations

from IPython.utils.capture import CapturedIO, capture_output

# What the `cluster` fixture starts unless a module sets CLUSTER_START.
CLUSTER_START = "start -n 2 --backend gloo --start-timeout-s 90"


def distributed(ipython, cell: str, line: str = "") -> CapturedIO:
    """Run a %%distributed cell; what it wrote and displayed (.stdout, .stderr, .outputs)."""
    with capture_output() as cap:
        ipython.run_cell_magic("distributed", line, cell)
    return cap


def run(ipython, cell: str, line: str = "", *, stderr: bool = False) -> str:
    """Run a %%distributed cell; its stdout (then its stderr, with stderr=True)."""
    cap = distributed(ipython, cell, line)
    return cap.stdout + cap.stderr if stderr else cap.stdout


def nbtrain(ipython, line: str):
    """`%nbtrain <line>`; its value."""
    return ipython.run_line_magic("nbtrain", line)


def captured(ipython, magic: str, line: str, cell: str | None = None):
    """Run a line (or cell) magic; return (its value, its stdout)."""
    with capture_output() as cap:
        if cell is None:
            value = ipython.run_line_magic(magic, line)
        else:
            value = ipython.run_cell_magic(magic, line, cell)
    return value, cap.stdout
