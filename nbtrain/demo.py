"""`nbtrain demo`: train a small GPT with ZeRO-3 on local ranks, end to end.

One rank per GPU, or 2 CPU ranks (gloo) without one. The corpus is Python's own
standard library, byte-level, so nothing is downloaded. The run shows a progress
bar, writes a checkpoint, per-rank telemetry and a report picture into the
output folder, and prints where they are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbtrain demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="local ranks (default: one per GPU, else 2 CPU ranks)",
    )
    p.add_argument("--model-size", choices=["tiny", "small", "medium"], default="tiny")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    p.add_argument("--batch-per-rank", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="nbtrain-out", help="output folder (default ./nbtrain-out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32 (default), or bf16 weights and activations with fp32 "
        "gradient reduction and fp32 master weights in the optimizer",
    )
    return p


def _train(args: argparse.Namespace) -> None:
    """Runs on every rank (see nbtrain.launch.run_ranks)."""
    import torch
    import torch.nn.functional as F

    import nbtrain as nbt
    from nbtrain import progress, telemetry
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.data import VOCAB_SIZE, BatchSampler, stdlib_corpus

    ctx = nbt.init_distributed(seed=args.seed)
    run_dir = os.path.join(args.out, "telemetry")
    telemetry.start(run_dir)
    cfg = GPTConfig.preset(args.model_size, vocab_size=VOCAB_SIZE, seq_len=args.seq_len)
    if args.dtype == "bf16":
        # bf16 Blocks reduce their gradients in fp32 (each shard's main_grad), and
        # AdamOptimizer keeps fp32 master weights of bf16 parameters.
        model = nbt.wrap(
            GPT(cfg).to(ctx.device, torch.bfloat16), zero_level=3, reduce_dtype=torch.float32
        )
    else:
        model = nbt.wrap(GPT(cfg).to(ctx.device), zero_level=3)
    # AdamW: decoupled weight decay for fp32 weights too (BMTrain's rule is L2 for them).
    optimizer = nbt.optim.AdamOptimizer(
        model.parameters(), lr=args.lr, weight_decay=0.01, decoupled_weight_decay=True
    )
    scheduler = nbt.lr_scheduler.Cosine(
        optimizer, start_lr=args.lr, warmup_iter=max(1, args.steps // 20), end_iter=args.steps
    )
    manager = nbt.optim.OptimManager()
    manager.add_optimizer(optimizer, scheduler)
    # Every step's memory sample counts this rank's model state (the report's panel).
    telemetry.watch(model, optimizer)

    sampler = BatchSampler(
        stdlib_corpus(), cfg.seq_len, args.batch_per_rank * ctx.world_size, seed=args.seed
    )
    losses = []
    for step in progress(range(args.steps), desc="nbtrain demo", unit="step"):
        x, y = sampler.local_batch(step)
        telemetry.metric(tokens=x.numel())  # this rank's tokens: the report's tokens/s
        manager.zero_grad()
        logits = model(x).float()  # the loss in fp32 whatever the weights' dtype
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.to(logits.device).reshape(-1)
        )
        manager.backward(loss)
        manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        manager.step()
        mean_loss = nbt.sum_loss(loss).item()
        losses.append(mean_loss)

    nbt.save_checkpoint(model, os.path.join(args.out, "checkpoint"), manager, step=args.steps)
    nbt.save(model, os.path.join(args.out, "model.safetensors"))
    telemetry.stop()
    if ctx.rank == 0:
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(
                {
                    "world_size": ctx.world_size,
                    "backend": ctx.backend,
                    "model_size": args.model_size,
                    "dtype": args.dtype,
                    "losses": losses,
                },
                f,
            )


def summarise(losses: list[float]) -> tuple[float, float]:
    """Mean loss over the first and the last 10% of steps."""
    k = max(1, len(losses) // 10)
    return sum(losses[:k]) / k, sum(losses[-k:]) / k


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nbtrain.launch import default_world_size, run_ranks

    ranks = args.ranks or default_world_size()
    if ranks < 1 or args.steps < 1:
        raise SystemExit(f"--ranks={ranks} and --steps={args.steps} must be positive")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    print(
        f"nbtrain demo: {args.model_size} GPT, ZeRO-3, {args.dtype}, {ranks} rank(s), "
        f"{args.steps} steps, output in {args.out}",
        flush=True,
    )
    start = time.perf_counter()
    run_ranks(_train, ranks, args, seed=args.seed, timeout_s=24 * 3600)
    elapsed = time.perf_counter() - start

    with open(os.path.join(args.out, "losses.json")) as f:
        result = json.load(f)
    first, last = summarise(result["losses"])
    from nbtrain.telemetry import report as report_cli

    report = os.path.join(args.out, "report.png")
    report_cli.main([os.path.join(args.out, "telemetry"), "-o", report])
    print(
        f"\nloss {first:.3f} -> {last:.3f} (first vs last 10% of steps; "
        f"uniform guessing is {math.log(256):.3f})"
    )
    print(f"done in {elapsed:.0f} s on {result['world_size']} {result['backend']} rank(s)")
    print(f"  checkpoint : {os.path.join(args.out, 'checkpoint')}")
    print(f"  weights    : {os.path.join(args.out, 'model.safetensors')}")
    print(f"  telemetry  : {os.path.join(args.out, 'telemetry')}")
    print(f"  report     : {report}")
    return 0 if last < first else 1
