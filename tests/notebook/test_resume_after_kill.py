"""A rank killed (SIGKILL) in the middle of a training cell: the cell fails within
seconds naming the dead rank and the one-line recovery (`%nbtrain restart`); after it,
the same cell resumes from the last checkpoint and ends exactly where an uninterrupted
run ends."""

import os
import re
import signal
import threading
import time

import pytest
from support.notebook import run

from nbtrain import RankDiedError

TRAIN = """
import os, time, torch
from nbtrain.models import GPT, GPTConfig
ckpt, steps = {ckpt!r}, 40
torch.manual_seed(0)
model = nbt.wrap(GPT(GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2, seq_len=16)))
opt = nbt.optim.AdamOptimizer(model.parameters(), lr=3e-3)
manager = nbt.optim.OptimManager()
manager.add_optimizer(opt)
start = nbt.load_checkpoint(model, ckpt, manager)["step"] if os.path.exists(ckpt) else 0
print("resuming at", start)
data = torch.randint(0, 64, (steps, 2 * nbt.world_size(), 16),
                     generator=torch.Generator().manual_seed(1))
rows = slice(2 * nbt.rank(), 2 * nbt.rank() + 2)
for step in range(start, steps):
    manager.zero_grad()
    loss = model.loss(data[step, rows], data[step, rows].roll(1, dims=1))
    manager.backward(loss)
    manager.step()
    if (step + 1) % 5 == 0:
        nbt.save_checkpoint(model, ckpt, manager, step=step + 1)
    time.sleep(0.1)
print("final", repr(nbt.sum_loss(loss).item()))
"""


def test_a_rank_killed_mid_training_is_named_and_the_run_resumes(ipython, cluster, tmp_path):
    reference = run(ipython, TRAIN.format(ckpt=str(tmp_path / "reference")))
    want = re.findall(r"final (\S+)", reference)
    assert len(want) == 2, reference

    ckpt = str(tmp_path / "run")
    victim = cluster.ranks[1]["pid"]
    threading.Timer(2.5, os.kill, (victim, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        run(ipython, TRAIN.format(ckpt=ckpt))
    assert time.monotonic() - start < 2.5 + 15  # named within 15 s of the kill
    assert "rank 1 died" in str(info.value) and "%nbtrain restart" in str(info.value)
    assert os.path.exists(os.path.join(ckpt, "meta.json")), "a checkpoint before the kill"

    ipython.run_line_magic("nbtrain", "restart")  # the one-line recovery
    assert victim not in cluster.pids()
    resumed = run(ipython, TRAIN.format(ckpt=ckpt))
    at = [int(s) for s in re.findall(r"resuming at (\d+)", resumed)]
    assert len(at) == 2 and at[0] == at[1] and 0 < at[0] < 40, resumed
    assert re.findall(r"final (\S+)", resumed) == want  # exactly the uninterrupted run's
