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


class Gate:
    """A file that rank code waits for, in place of a fixed sleep: the cell
    `gate.hold()` blocks on the ranks until the test calls `gate.open()` (or
    `limit_s` passes, so a test that fails before opening it does not hang the
    ranks). The ranks are on this machine and see the same file."""

    def __init__(self, folder, limit_s: float = 60.0):
        import uuid
        from pathlib import Path

        self.path = Path(folder) / f"gate-{uuid.uuid4().hex}"
        self.limit_s = limit_s

    def hold(self) -> str:
        """Rank code that waits for the gate, at most limit_s."""
        return (
            "import os as _os, time as _time\n"
            f"_until = _time.monotonic() + {self.limit_s}\n"
            f"while not _os.path.exists({str(self.path)!r}) and _time.monotonic() < _until:\n"
            "    _time.sleep(0.02)\n"
        )

    def open(self) -> None:
        self.path.touch()

    @property
    def is_open(self) -> bool:
        return self.path.exists()
