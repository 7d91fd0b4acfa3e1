"""The same Block model, trained a few steps, gives the same losses in a
`%%distributed` cell as under torchrun with the same world size."""

import json
import subprocess
import sys

import pytest

from nbtrain.notebook.engine_boot import free_port

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import json
import torch
import nbtrain as nbt


def train(steps=4):
    ctx = nbt.init_distributed(seed=0)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
              for _ in range(2)]
    blocks = torch.nn.ModuleList([nbt.Block(m, zero_level=3) for m in layers])
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        for block in blocks:
            x = block(x)
        loss = x.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(nbt.sum_loss(loss).item())
    return losses


if __name__ == "__main__":
    losses = train()
    if nbt.rank() == 0:
        print("LOSSES", json.dumps(losses))
"""


def test_block_training_matches_torchrun(ipython, tmp_path):
    script = tmp_path / "train_blocks.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOSSES"))
    torchrun_losses = json.loads(line.split(" ", 1)[1])

    ipython.run_line_magic("nbtrain", "start -n 2 --start-timeout-s 90")
    try:
        ipython.run_cell_magic(
            "distributed", "", f"import runpy\nlosses = runpy.run_path({str(script)!r})['train']()"
        )
        cell_losses = ipython.run_line_magic("nbtrain", "pull losses -t 0")
        assert ipython.run_line_magic("nbtrain", "pull losses -t 1") == cell_losses
    finally:
        ipython.run_line_magic("nbtrain", "stop")
    assert len(cell_losses) == 4 and cell_losses[0] != cell_losses[-1]  # it trained
    assert cell_losses == pytest.approx(torchrun_losses, rel=1e-6, abs=1e-7)
