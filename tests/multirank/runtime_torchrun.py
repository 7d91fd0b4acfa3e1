"""nbtrain.runtime as a plain script under torchrun: the reference against pp 2
(2 micro-batches), 3 steps; prints one JSON line of compare's rows.

Usage, from the checkout: PYTHONPATH=.:tests python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/multirank/runtime_torchrun.py
"""

import json

import torch
from support.runtime_cases import batches, configs  # tests/ on PYTHONPATH: support.script_env()

import nbtrain

if __name__ == "__main__":
    torch.set_num_threads(1)
    nbtrain.init_distributed()
    from nbtrain.runtime import compare

    reference, mine = configs("sgd", pipe_size=2, num_micro_batches=2)
    rows = compare(reference, mine, steps=3, data=batches())
    if nbtrain.rank() == 0:
        print("ROWS " + json.dumps(rows))
    nbtrain.comm.shutdown()
