"""Repeat the recovery tests (notebook and multi-rank) many times, under CPU load.

    python tests/stress/recovery_repeat.py [--runs 20] [--load 1] [--sigint default|ignored]
                                           [-- extra pytest arguments]

Each run is a fresh `python -m pytest` over tests/notebook/test_recovery.py and
tests/multirank/test_recovery_ranks.py, with the nbtrain of this checkout first on
PYTHONPATH. Beside the runs, `--load` busy-looping processes take CPU (the 2-core
machine of a new user who is installing something meanwhile); they are ended by their
pids at the end. By default each pytest starts with SIGINT ignored, as a run started
in the background by a non-interactive shell does (the condition under which the
interrupt tests once waited out their timeouts); `--sigint default` starts it as a
terminal does.

Prints one line per run (passed, failed, errors, seconds) and the totals; exits 1 if
any run had a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import load

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/notebook/test_recovery.py", "tests/multirank/test_recovery_ranks.py"]


def counts(output: str) -> dict[str, int]:
    """pytest's last line, e.g. '1 failed, 9 passed in 80.1s' -> {'failed': 1, 'passed': 9}."""
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tail)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=1, help="busy processes beside the runs")
    parser.add_argument("--sigint", choices=["ignored", "default"], default="ignored")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args(argv)

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    disposition = signal.SIG_IGN if args.sigint == "ignored" else signal.SIG_DFL
    totals = {"passed": 0, "failed": 0, "errors": 0}
    bad_runs = 0
    print(
        f"{args.runs} runs of {' '.join(TESTS)}; {args.load} busy process(es) beside; "
        f"SIGINT {args.sigint} at start",
        flush=True,
    )
    with load.busy(args.load):
        for run in range(1, args.runs + 1):
            began = time.monotonic()
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    *TESTS,
                    *args.pytest_args,
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
            )
            seen = counts(result.stdout)
            seen["errors"] = seen.pop("error", 0) + seen.pop("errors", 0)
            for key in totals:
                totals[key] += seen.get(key, 0)
            failed = result.returncode != 0
            bad_runs += failed
            print(
                f"run {run:>3}: {seen.get('passed', 0):>3} passed, {seen.get('failed', 0)} "
                f"failed, {seen['errors']} errors, {time.monotonic() - began:6.1f} s"
                + ("  <- exit code %d" % result.returncode if failed else ""),
                flush=True,
            )
            if failed:
                print(result.stdout[-4000:], result.stderr[-2000:], sep="\n", flush=True)
    print(
        f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['errors']} "
        f"errors; runs with a failure: {bad_runs} of {args.runs}"
    )
    return 1 if bad_runs else 0


if __name__ == "__main__":
    sys.exit(main())
