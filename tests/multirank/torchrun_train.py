"""Trains the test GPT under torchrun and prints the losses as JSON (rank 0).

Usage, from the checkout: PYTHONPATH=.:tests python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/multirank/torchrun_train.py STEPS
"""

import json
import sys

import torch
from support import cases  # tests/ on PYTHONPATH: support.script_env()

import nbtrain as nbt

ctx = nbt.init_distributed(seed=0)
torch.set_num_threads(1)
model = cases.sharded_model("wrap", 3, False)
losses, _, _ = cases.train_sharded(model, int(sys.argv[1]))
if ctx.rank == 0:
    print("LOSSES", json.dumps({"world": ctx.world_size, "backend": ctx.backend, "losses": losses}))
nbt.synchronize()
nbt.comm.shutdown()
