"""CPU load beside a stress run: busy-looping processes, ended by their pids."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def busy(count: int):
    """`count` processes that spin on a core each while the block runs."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]) for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
