"""A small torchrun training script that records telemetry to JSONL.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 train_script.py RUN_DIR [STEPS]

It records what the panels draw: OptimManager's step metrics (loss, lr from a
warmup schedule, grad norm, step time), tokens per step, and a user metric
(`val_loss`) every other step.
"""

import sys

import torch

import nbtrain as nbt
from nbtrain import telemetry
from nbtrain.models import GPT, GPTConfig


def main(run_dir: str, steps: int) -> None:
    torch.set_num_threads(1)
    nbt.init_distributed(seed=0)
    telemetry.start(run_dir)
    cfg = GPTConfig(hidden=32, heads=4, layers=3, seq_len=16, vocab_size=64)
    model = nbt.wrap(GPT(cfg), zero_level=3)
    opt = nbt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    optim = nbt.optim.OptimManager(loss_scale=None)
    optim.add_optimizer(opt, nbt.lr_scheduler.Linear(opt, 1e-2, 2, steps))
    telemetry.watch(model, opt)
    gen = torch.Generator().manual_seed(nbt.rank())
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen)
        optim.zero_grad()
        optim.backward(model.loss(x[:, :-1], x[:, 1:]))
        optim.clip_grad_norm(1.0)
        if step % 2 == 1:
            with torch.no_grad():
                telemetry.metric(val_loss=model.loss(x[:, :-1], x[:, 1:]))
        telemetry.metric(tokens=x[:, :-1].numel())
        optim.step()  # records loss, lr, grad norm, step time and ends the step
    telemetry.stop()
    nbt.comm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
