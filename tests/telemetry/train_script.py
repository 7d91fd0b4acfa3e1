"""A small torchrun training script that records telemetry to JSONL.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 train_script.py RUN_DIR [STEPS]
"""
import sys
import time

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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    telemetry.watch(model, opt)
    gen = torch.Generator().manual_seed(nbt.rank())
    for _ in range(steps):
        start = time.perf_counter()
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        telemetry.metric(loss=loss.detach(), lr=opt.param_groups[0]["lr"], loss_scale=1.0,
                         skipped=False, step_time_s=time.perf_counter() - start)
        telemetry.next_step()
    telemetry.stop()
    nbt.comm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
