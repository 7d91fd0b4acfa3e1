"""`run_cli(*argv)`: an `nbtrain` command run in this test process, as `nbtrain ARGV` would.

A command run as `python -m nbtrain.cli` pays a fresh interpreter, torch's import and a
fresh rank forkserver (torch._dynamo and FSDP2 preloaded) before its first rank starts:
6-9 s on 2 cores, more than many a quick benchmark's own work. In this process the
forkserver of nbtrain.launch is already up, so only the command's work is left.

What a subprocess would check and this cannot, the entry point itself (`python -m
nbtrain.cli` dispatching to the command's module, its exit status), stays checked by
the tests that run the real command line: tests/multirank/test_demo.py's first test and
the bench refusals in tests/multirank/test_bench_smoke.py and test_bench_modes.py.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*argv: str) -> CliRun:
    """`nbtrain ARGV` in this process: its exit status and what it printed.

    An uncaught exception propagates (a traceback in the test is the clearest report);
    SystemExit becomes the exit status, its message (if any) the last line of stderr,
    as the interpreter would print it. The environment is restored afterwards.
    """
    from nbtrain import cli

    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in argv])
            except SystemExit as exit_:
                code = exit_.code
                if isinstance(code, str):
                    print(code, file=err)
                    code = 1
                code = code or 0
    finally:
        os.environ.clear()
        os.environ.update(env)
    return CliRun(int(code), out.getvalue(), err.getvalue())
