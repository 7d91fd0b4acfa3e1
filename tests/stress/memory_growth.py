"""Does a long run's memory per rank level off? RSS per rank over N training steps.

    python tests/stress/memory_growth.py [--steps 20000] [--ranks 2] [--every 1000]
                                         [--warmup 2000] [--diagnose] [--tracemalloc]

Trains a tiny GPT (ZeRO-3, AdamOptimizer, OptimManager, cosine schedule) on local
CPU ranks with nbtrain's per-step machinery as `nbtrain demo` runs it: telemetry on
and written to JSONL (`telemetry.start`), the model and optimizer watched (each
step's memory sample counts their state), a tokens metric per step,
`nbtrain.progress` around the loop, the loss summed over ranks. Every `--every`
steps each rank prints its RSS; at the end a table gives each rank's RSS after
warm-up, at the end, and the growth between them in MiB.

`--diagnose` also prints, at each interval, the lengths of the containers nbtrain
keeps per step (recorder events, step log histories, comm counters, in-flight
handles, step-end hooks, the JSONL buffer, ...) and the number of objects the
garbage collector tracks; `--tracemalloc` prints the 15 allocation sites that grew
most between the end of warm-up and the end of the run (slows the run ~3x; the
RSS growth then counts tracemalloc's own bookkeeping).
The script runs the nbtrain of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # this checkout's nbtrain

MiB = 2**20


def containers() -> dict:
    """len() of what nbtrain keeps per step or per event in this process."""
    import gc

    from nbtrain import telemetry
    from nbtrain.comm import collectives, events, recovery

    rec = telemetry.RECORDER
    log = rec.log
    out = {
        "events": len(rec.events),
        "metrics": len(log.metrics),
        "overlap": len(log.overlap),
        "steps": len(log.steps),
        "memory_history": len(log.memory_history),
        "spans": len(log._spans),
        "sinks": len(rec.sinks),
        "jsonl_buffer": sum(len(getattr(s, "_buffer", ())) for s in rec.sinks),
        "counter_kinds": len(collectives.COUNTERS.bytes),
        "in_flight": len(collectives.IN_FLIGHT),
        "step_end_hooks": len(events._STEP_END),
        "subscribers": len(events.HUB.subscribers),
        "phases": len(recovery._S.phases),
        "gc_objects": len(gc.get_objects()),
    }
    return out


def _rank_main(args) -> dict:
    """Runs on every rank (nbtrain.launch.run_ranks)."""
    import tracemalloc

    import torch.nn.functional as F

    import nbtrain as nbt
    from nbtrain import progress, telemetry
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.data import VOCAB_SIZE, BatchSampler, stdlib_corpus
    from nbtrain.telemetry.sinks import _rss_bytes

    ctx = nbt.get_context()
    telemetry.start(os.path.join(args.out, "telemetry"))
    cfg = GPTConfig.preset("tiny", vocab_size=VOCAB_SIZE, seq_len=args.seq_len)
    model = nbt.wrap(GPT(cfg).to(ctx.device), zero_level=3)
    optimizer = nbt.optim.AdamOptimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = nbt.lr_scheduler.Cosine(
        optimizer, start_lr=1e-3, warmup_iter=max(1, args.steps // 20), end_iter=args.steps
    )
    manager = nbt.optim.OptimManager()
    manager.add_optimizer(optimizer, scheduler)
    telemetry.watch(model, optimizer)  # each step's memory sample counts the model state
    sampler = BatchSampler(
        stdlib_corpus(), cfg.seq_len, args.batch_per_rank * ctx.world_size, seed=0
    )

    samples, lengths, top = [], [], None
    started = time.perf_counter()
    for step in progress(range(args.steps), desc="memory_growth", unit="step", mininterval=30):
        x, y = sampler.local_batch(step)
        telemetry.metric(tokens=x.numel())
        manager.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        manager.backward(loss)
        manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        manager.step()
        nbt.sum_loss(loss).item()
        done = step + 1
        if args.tracemalloc and done == args.warmup:
            tracemalloc.start(1)
            top = tracemalloc.take_snapshot()
        if done % args.every == 0 or done == args.steps or done == args.warmup:
            rss = _rss_bytes()
            samples.append((done, rss))
            line = (
                f"[rank {ctx.rank}] step {done:6d}  rss {rss / MiB:7.1f} MiB  "
                f"{(time.perf_counter() - started) / done * 1e3:5.1f} ms/step"
            )
            if args.diagnose:
                sizes = containers()
                lengths.append((done, sizes))
                line += "  " + " ".join(f"{k}={v}" for k, v in sizes.items())
            print(line, flush=True)

    grown = []
    if top is not None:
        stats = tracemalloc.take_snapshot().compare_to(top, "lineno")
        grown = [str(s) for s in stats[:15]]
        tracemalloc.stop()
    telemetry.stop()
    return {"rank": ctx.rank, "samples": samples, "lengths": lengths, "tracemalloc": grown}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--every", type=int, default=1000, help="steps between RSS lines")
    p.add_argument(
        "--warmup", type=int, default=2000, help="growth is measured from this step (default 2000)"
    )
    p.add_argument("--batch-per-rank", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument(
        "--diagnose", action="store_true", help="print the lengths of nbtrain's per-step containers"
    )
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="print the allocation sites that grew most after warm-up",
    )
    args = p.parse_args(argv)
    args.warmup = min(args.warmup, args.steps)

    from nbtrain.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="nbtrain-memory-growth-") as out:
        args.out = out
        start = time.perf_counter()
        results = run_ranks(_rank_main, args.ranks, args, timeout_s=24 * 3600)
        elapsed = time.perf_counter() - start

    print(
        f"\n{args.steps} steps on {args.ranks} CPU rank(s) in {elapsed:.0f} s; "
        f"growth from step {args.warmup} to step {args.steps}:"
    )
    worst = 0.0
    for res in sorted(results, key=lambda r: r["rank"]):
        by_step = dict(res["samples"])
        first, last = by_step[args.warmup], by_step[args.steps]
        worst = max(worst, (last - first) / MiB)
        print(
            f"  rank {res['rank']}: {first / MiB:7.1f} -> {last / MiB:7.1f} MiB "
            f"(growth {(last - first) / MiB:+.1f} MiB)"
        )
        for line in res["tracemalloc"]:
            print(f"    {line}")
    print(f"largest growth after warm-up: {worst:+.1f} MiB per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
