"""Under torchrun: stage 1 of 2 raises in its third forward, while stage 0 waits on it.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 pipeline_fail_script.py
"""

import torch
import torch.nn.functional as F

import nbtrain as nbt
from nbtrain import pipeline


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        if nbt.rank() == 1 and self.calls == 3:
            raise ValueError("bad micro-batch on stage 1")
        return self.lin(x)


if __name__ == "__main__":
    torch.set_num_threads(1)
    nbt.init_distributed(pipe_size=2)
    torch.manual_seed(0)
    stage = pipeline.stage_of([Layer(), Layer()])  # layer i on stage i
    xs = [torch.randn(2, 4) for _ in range(4)]
    pipeline.run(stage, xs, xs, F.mse_loss, schedule="1f1b")
    print("NOT REACHED")
