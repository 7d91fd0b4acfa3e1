"""Fail and rebuild a 2-rank group many times in a row, under CPU load.

    python tests/stress/rebuild_repeat.py [--runs 300] [--load 1]

Each run is `run_ranks(_cut_optimizer_step, 2)` from tests/multirank/test_recovery_ranks.py:
both ranks fail (`recovery.fail`), rebuild the default group (`recovery.rebuild`) and
return, which ends their group at once. Beside the runs, `--load` busy-looping
processes take CPU; they are ended by their pids at the end. Prints each failing
run's error and then `K of N failed`; exits 1 if any failed.

What it caught: `init_process_group` is no barrier, so a rank could return from the
rebuild and close the new group while its peer was still finishing gloo's mesh, whose
init then failed with "Connection closed by peer" (7 of 380 runs before the barrier at
the end of `rebuild`, 0 of 300 after, on 2 cores with one busy process).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import load

ROOT = Path(__file__).resolve().parents[2]
# A command run by path, outside pytest: this checkout's nbtrain, tests/ (support) and
# the folder of the test module it borrows from go first, as a pytest run has them.
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "multirank")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--load", type=int, default=1, help="busy processes beside the runs")
    args = parser.parse_args(argv)

    from test_recovery_ranks import _cut_optimizer_step

    from nbtrain.launch import run_ranks

    failed, began = 0, time.monotonic()
    with load.busy(args.load):
        for run in range(args.runs):
            try:
                run_ranks(_cut_optimizer_step, 2, timeout_s=120)
            except Exception as err:  # a rank's traceback
                failed += 1
                print(f"run {run} failed:\n{err}", flush=True)
    print(
        f"{failed} of {args.runs} failed in {time.monotonic() - began:.0f} s "
        f"({args.load} busy process(es) beside)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
