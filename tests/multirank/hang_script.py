"""Under torchrun: the last rank skips `synchronize()` and stays busy past the timeout.

    torchrun --standalone --nproc-per-node N hang_script.py TIMEOUT_S

The other ranks' `synchronize()` must raise CollectiveError naming the barrier and
the missing rank within the process-group timeout; the script then exits non-zero
with the error on stderr (as any script's would). Used by test_hang_report.py.
"""

import sys
import time

import torch

import nbtrain as bmt
from nbtrain.comm import collectives as C


def main(timeout_s: float) -> None:
    bmt.init_distributed(pg_timeout_s=timeout_s)
    C.all_reduce(torch.ones(3), label="warm-up")  # collective #1: every rank
    if bmt.rank() == bmt.world_size() - 1:
        time.sleep(2 * timeout_s + 2)  # "computing": never reaches the barrier in time
        return
    start = time.monotonic()
    try:
        bmt.synchronize()  # collective #2
    finally:
        print(f"WAITED {time.monotonic() - start:.1f}", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
