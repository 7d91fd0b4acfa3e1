"""A rank killed (SIGKILL) in the middle of a training cell: the cell fails within
seconds naming the dead rank and the one-line recovery (`%nbtrain restart`); after it,
the same cell resumes from the last checkpoint and ends exactly where an uninterrupted
run ends."""

import os
import re
import signal
import time

import pytest
from procs import signal_when
from support.notebook import run

from nbtrain import RankDiedError

TRAIN = """
import os, time, torch
from nbtrain.models import GPT, GPTConfig
ckpt, steps, pause_s = {ckpt!r}, 40, {pause_s!r}
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
    time.sleep(pause_s)
print("final", repr(nbt.sum_loss(loss).item()))
"""


def test_a_rank_killed_mid_training_is_named_and_the_run_resumes(ipython, cluster, tmp_path):
    # The pause per step only keeps the killed run going until the kill; the loss does
    # not depend on it, so the reference and the resumed run go at full speed.
    reference = run(ipython, TRAIN.format(ckpt=str(tmp_path / "reference"), pause_s=0.0))
    want = re.findall(r"final (\S+)", reference)
    assert len(want) == 2, reference

    ckpt = str(tmp_path / "run")
    victim = cluster.ranks[1]["pid"]
    # Killed once the first checkpoint (step 5 of 40, 0.1 s a step) is committed, not
    # after a fixed 2.5 s: mid-training whatever the machine's load.
    meta = os.path.join(ckpt, "meta.json")
    killed = signal_when(lambda: os.path.exists(meta), victim, signal.SIGKILL)
    with pytest.raises(RankDiedError) as info:
        run(ipython, TRAIN.format(ckpt=ckpt, pause_s=0.1))
    assert killed and time.monotonic() - killed[0] < 15  # named within 15 s of the kill
    assert "rank 1 died" in str(info.value) and "%nbtrain restart" in str(info.value)
    assert os.path.exists(os.path.join(ckpt, "meta.json")), "a checkpoint before the kill"

    ipython.run_line_magic("nbtrain", "restart")  # the one-line recovery
    assert victim not in cluster.pids()
    resumed = run(ipython, TRAIN.format(ckpt=ckpt, pause_s=0.0))
    at = [int(s) for s in re.findall(r"resuming at (\d+)", resumed)]
    assert len(at) == 2 and at[0] == at[1] and 0 < at[0] < 40, resumed
    assert re.findall(r"final (\S+)", resumed) == want  # exactly the uninterrupted run's


def test_a_stop_after_a_killed_rank_asks_the_others_to_leave(ipython, cluster):
    """The living engines leave at once after a rank was killed, as after a clean run:
    skipped over the dead one, they were left to ipyparallel's signals (4.3 s a stop
    on an idle machine, against 0.2 s). The killed engine's nanny is ended by its pid
    too: here it is held (SIGSTOP) as a busy machine held it in CI, where it still
    lingered when the hub stopped and the stop waited for it (4.1 s; 5.4 s held)."""
    import psutil

    from nbtrain.notebook import magics

    current = magics.current_cluster()
    victim = psutil.Process(current.ranks[1]["pid"])
    nannies = [p for p in victim.children() if "ipyparallel.engine.nanny" in p.cmdline()]
    assert nannies, victim.children()
    for nanny in nannies:
        nanny.send_signal(signal.SIGSTOP)
    victim.kill()
    victim.wait(timeout=10)
    began = time.monotonic()
    ipython.run_line_magic("nbtrain", "stop")
    # 0.4 s here; 3.5 s once in CI under load. Without the fix: 4.3 s idle, 5.4 s held.
    assert time.monotonic() - began < 4.0
    assert all(_ended(nanny) for nanny in nannies)


def _ended(proc) -> bool:
    """Gone, or a zombie its new parent has not reaped yet."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
