"""Trains the test GPT under torchrun and prints the losses as JSON (rank 0)."""
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import cases  # noqa: E402

import nbtrain as nbt  # noqa: E402

ctx = nbt.init_distributed(seed=0)
torch.set_num_threads(1)
model = cases.sharded_model("wrap", 3, False)
losses, _, _ = cases.train_sharded(model, int(sys.argv[1]))
if ctx.rank == 0:
    print("LOSSES", json.dumps({"world": ctx.world_size, "backend": ctx.backend,
                                "losses": losses}))
nbt.synchronize()
nbt.comm.shutdown()
