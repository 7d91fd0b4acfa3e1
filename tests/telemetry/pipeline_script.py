"""A torchrun pipeline run that records telemetry: a tiny GPT in 2 stages, 4 micro-batches.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 pipeline_script.py \
    RUN_DIR [STEPS] [SCHEDULE]
"""

import sys

import torch
import torch.nn.functional as F

import nbtrain as nbt
from nbtrain import pipeline, telemetry
from nbtrain.models import GPT, GPTConfig
from nbtrain.models.gpt_pipe import gpt_layers

MICRO = 4


def main(run_dir: str, steps: int, schedule: str) -> None:
    torch.set_num_threads(1)
    nbt.init_distributed(seed=0, pipe_size=2)
    telemetry.start(run_dir)
    cfg = GPTConfig(hidden=32, heads=4, layers=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    stage = pipeline.stage_of(gpt_layers(GPT(cfg)))
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)  # the same batches on both stages

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1))

    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2 * MICRO, cfg.seq_len + 1), generator=gen)
        inputs, targets = tokens[:, :-1].chunk(MICRO), tokens[:, 1:].chunk(MICRO)
        opt.zero_grad()
        losses = pipeline.run(stage, list(inputs), list(targets), loss_fn, schedule=schedule)
        opt.step()
        telemetry.metric(loss=sum(losses) / len(losses))
        telemetry.next_step()
    telemetry.stop()
    nbt.comm.shutdown()


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]) if len(sys.argv) > 2 else 3,
        sys.argv[3] if len(sys.argv) > 3 else "1f1b",
    )
