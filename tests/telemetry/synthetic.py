"""Synthetic per-rank event logs, fed through StepLog: what a real run records, made up.

Each rank's steps gather, compute and reduce-scatter with a rank-dependent speed
(rank r is 1 + r/world slower), so skew, bands and per-rank lines have something
to show. CPU ranks record RSS; `cuda=True` records CUDA allocated/reserved.
"""

import random

from nbtrain.telemetry.steplog import StepLog

MIB = 2**20


def rank_events(rank: int, world: int, steps: int, cuda: bool = False) -> list[dict]:
    rng = random.Random(rank)
    slow = 1.0 + rank / world
    events, t = [{"type": "meta", "rank": rank, "world_size": world, "t": 0.0}], 0.0
    for step in range(steps):
        t0 = t
        for block in range(3):
            gather = (t, t + 0.002 * slow)
            compute = (t + 0.001, t + 0.004 * slow + 0.001)
            events.append(
                {
                    "type": "comm",
                    "kind": "all_gather",
                    "label": f"b{block}",
                    "start": gather[0],
                    "end": gather[1],
                    "bytes": 4 * MIB,
                    "step": step,
                }
            )
            events.append(
                {
                    "type": "compute",
                    "label": f"b{block}",
                    "phase": "forward",
                    "start": compute[0],
                    "end": compute[1],
                    "step": step,
                }
            )
            t = compute[1]
        events.append(
            {
                "type": "comm",
                "kind": "reduce_scatter",
                "label": "b0",
                "start": t,
                "end": t + 0.003 * slow,
                "bytes": 8 * MIB,
                "step": step,
            }
        )
        t += 0.003 * slow
        grads = 0 if step % 2 else 3 * MIB
        memory = {"param_bytes": 3 * MIB, "grad_bytes": grads, "optimizer_bytes": 6 * MIB}
        memory["model_state_bytes"] = sum(memory.values())
        memory["full_param_bytes"] = 3 * MIB * world  # each rank holds 1/world of it
        if cuda:
            memory.update(
                cuda_allocated_bytes=(40 + step) * MIB,
                cuda_reserved_bytes=(64 + step) * MIB,
                cuda_peak_bytes=80 * MIB,
            )
        else:
            memory["rss_bytes"] = (400 + 2 * step + rank) * MIB
        loss = 4.0 * 0.95**step + 0.01 * rng.random()
        events.append(
            {
                "type": "metric",
                "loss": loss,
                "lr": 1e-3 * min(1, (step + 1) / 4),
                "loss_scale": 1.0,
                "grad_norm": 2.0 - step * 0.05,
                "tokens": 512,
                "step_time_s": t - t0,
                "t": t,
                "step": step,
            }
        )
        if step % 4 == 3:
            events.append(
                {
                    "type": "metric",
                    "val_loss": loss + 0.2,
                    "accuracy": 0.1 * step,
                    "t": t,
                    "step": step,
                }
            )
        events.append({"type": "memory", "t": t, "step": step, **memory})
        events.append({"type": "step_end", "t": t, "step": step})
    return events


def summaries(world: int, steps: int = 12, cuda: bool = False) -> dict:
    """{rank: StepLog summary} of a synthetic run of `world` ranks."""
    out = {}
    for rank in range(world):
        log = StepLog()
        for event in rank_events(rank, world, steps, cuda):
            log.feed(event)
        out[rank] = log.summary()
    return out
