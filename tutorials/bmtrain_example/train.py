"""Trains the example GPT with tensor parallelism over 2 ranks:

    torchrun --nproc_per_node=2 train.py

A tiny model on a fixed random batch, so that it runs in seconds on CPU ranks (gloo)
as well as on GPUs (NCCL, half precision). Writes checkpoint.pt (the full state
dict) in the current folder.
"""
import time

import torch
from models import GPT

import nbtrain as bmt  # was: import bmtrain as bmt

VOCAB_SIZE = 64
SEQ_LEN = 8
BATCH_SIZE = 4
NUM_STEPS = 6


def make_model(dtype):
    return GPT(
        num_layers=2,
        vocab_size=VOCAB_SIZE,
        dim_model=16,
        dim_head=8,
        num_heads=2,
        dim_ff=32,
        max_distance=SEQ_LEN,
        bias=True,
        dtype=dtype,
    )


def make_batch(device):
    """This data-parallel replica's batch of dummy data: the same on every
    tensor-parallel rank of the replica (the model takes each rank's rows itself)."""
    gen = torch.Generator().manual_seed(1234)
    dp_size = bmt.config["tp_zero_size"]
    dp_rank = bmt.config["tp_zero_rank"]
    for i in range(dp_size):
        sent = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN + 1), generator=gen)
        enc_length = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (BATCH_SIZE,), generator=gen)
        enc_length = enc_length.to(device)
        enc_input = sent[:, :-1].long().to(device)
        targets = sent[:, 1:].long().to(device)
        mask = torch.arange(SEQ_LEN, device=device)[None, :] < enc_length[:, None]
        targets = torch.where(mask, targets, torch.full_like(targets, -100))
        if i == dp_rank:
            break
    return enc_input, enc_length, targets


def main():
    bmt.init_distributed(seed=0, tp_size=2)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.half if torch.cuda.is_available() else torch.float32
    model = make_model(dtype)
    bmt.init_parameters(model)

    bmt.print_rank("Model parameters")
    bmt.print_rank(bmt.inspect.format_summary(bmt.inspect.inspect_model(model, "*")))
    bmt.synchronize()

    enc_input, enc_length, targets = make_batch(device)

    # The logits are split by vocabulary over the tensor-parallel ranks: the loss
    # is computed without gathering them.
    loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100, parallel=True)

    optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), weight_decay=1e-2)
    lr_scheduler = bmt.lr_scheduler.Noam(optimizer, start_lr=1e-3, warmup_iter=2,
                                         end_iter=NUM_STEPS, num_iter=0)

    optim_manager = bmt.optim.OptimManager(loss_scale=2**20)
    optim_manager.add_optimizer(optimizer, lr_scheduler)

    bmt.synchronize()

    losses = []
    for iteration in range(NUM_STEPS):
        st = time.time()
        optim_manager.zero_grad()

        with bmt.inspect.inspect_tensor() as inspector:
            pos = torch.arange(enc_input.size(1), device=device).long()
            pos = pos.repeat(enc_input.size(0), 1)
            logits = model(enc_input, pos, pos < enc_length[:, None])
            batch, seq_len, vocab_out_size = logits.size()

            loss = loss_func(logits.view(batch * seq_len, vocab_out_size),
                             targets.view(batch * seq_len))
            global_loss = bmt.sum_loss(loss).item()

            optim_manager.backward(loss)

        # What went through the model (forward and backward) in the first step.
        if iteration == 0:
            bmt.print_rank(bmt.inspect.format_summary(inspector.get_summary()))

        grad_norm = optim_manager.clip_grad_norm(optimizer.param_groups, max_norm=10.0)
        optim_manager.step()
        losses.append(global_loss)

        bmt.print_rank(
            f"| Iter: {iteration:6d} | loss: {global_loss:.4f} "
            f"| lr: {lr_scheduler.current_lr:.4e} scale: {optim_manager.loss_scale:10.4f} "
            f"| grad_norm: {grad_norm:.4f} | time: {time.time() - st:.4f}"
        )

    bmt.print_rank("Model parameters after training")
    bmt.print_rank(bmt.inspect.format_summary(bmt.inspect.inspect_model(model, "*")))

    bmt.save(model, "checkpoint.pt")
    return {"losses": losses, "checkpoint": "checkpoint.pt"}


if __name__ == "__main__":
    main()
