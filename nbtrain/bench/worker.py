"""One rank of one benchmark run: build an engine, train, measure.

Every step is bracketed by a barrier so a slow rank's lag is not carried into
the next step, and its time is the slowest rank's (an all-reduce of max).
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist

import nbtrain as nbt
from nbtrain import telemetry
from nbtrain.models import GPTConfig
from nbtrain.telemetry.overlap import comm_overlap

from . import engines
from . import tp as tp_bench
from .profile import StepProfile


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _rss_bytes("VmHWM")


def hidden_fraction(events: list[dict]) -> float | None:
    """HTA comm/comp overlap of one step's telemetry events (nbtrain.overlap).

    Compute spans are the blocks' forward and backward; work outside blocks
    (embedding, head, loss, optimizer) has none, so comm under it counts as
    exposed and the share is a lower bound.
    """
    return comm_overlap(
        [(e["start"], e["end"]) for e in events if e["type"] == "comm"],
        [(e["start"], e["end"]) for e in events if e["type"] == "compute"],
    )


def batches(cfg: GPTConfig, steps: int, batch_per_rank: int, world: int, seed: int):
    """(x, y), each (steps, world * batch_per_rank, seq_len) int64; same on every rank."""
    g = torch.Generator().manual_seed(seed + 1)
    shape = (steps, world * batch_per_rank, cfg.seq_len)
    return (
        torch.randint(0, cfg.vocab_size, shape, generator=g),
        torch.randint(0, cfg.vocab_size, shape, generator=g),
    )


def run_rank(spec: dict) -> dict:
    """Trains `spec["engine"]` for warmup + steps steps; returns this rank's numbers.

    Runs on every rank under `nbtrain.launch.run_ranks` (process group ready).
    """
    ctx = nbt.get_context()
    return _train(spec, ctx.rank, ctx.world_size)


def _train(spec: dict, rank: int, world: int) -> dict:
    ctx = nbt.get_context()
    device, engine = ctx.device, spec["engine"]
    cfg = GPTConfig.preset(spec["model_size"])
    baseline = _rss_bytes("VmRSS") if device.type == "cpu" else torch.cuda.memory_allocated()
    tp = spec.get("tp", 1) if engine in tp_bench.TP_ENGINES else 1
    if tp > 1:
        nbt.init_distributed(seed=spec["seed"], tp_size=tp)
    dp, dp_rank = world // tp, rank // tp  # tp ranks of one replica share its batch
    dtype = spec.get("dtype", "fp32")
    if engine in tp_bench.TP_ENGINES:
        model = tp_bench.build(engine, cfg, spec["seed"])
    else:
        model = engines.build(engine, cfg, spec["seed"], dtype, spec.get("compile"))
    opt = engines.optimizer(engine, model, dtype)
    total = spec["warmup"] + spec["steps"]
    xs, ys = batches(cfg, total, spec["batch_per_rank"], dp, spec["seed"])
    lo, hi = dp_rank * spec["batch_per_rank"], (dp_rank + 1) * spec["batch_per_rank"]
    telemetry.set_enabled(engine in engines.NBTRAIN_ENGINES)
    _reset_peak(device)
    times, warmup, losses, wire, hidden = [], [], [], [], []
    functional = None  # DTensor's bytes, counted in the first (untimed) step
    prof = StepProfile() if spec.get("profile") and rank == 0 else None
    for step in range(total):
        x, y = xs[step, lo:hi].to(device), ys[step, lo:hi].to(device)
        dist.barrier()
        telemetry.RECORDER.clear()
        engines.reset_wire()
        counting = contextlib.nullcontext()
        if engine == "dtensor_tp" and functional is None:
            counting = functional = tp_bench.FunctionalCollectiveBytes(tp)
        profiling = prof is not None and step >= spec["warmup"]
        with prof.step() if profiling else contextlib.nullcontext():
            start = time.perf_counter()
            with counting:
                opt.zero_grad(set_to_none=True)
                loss = engines.loss_of(model, x, y)
                loss.backward()
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        if profiling:
            prof.add_wall(elapsed)
        moved = functional.total if functional is not None else engines.wire_bytes(engine)
        stats = torch.tensor([elapsed, loss.item()], dtype=torch.float64, device=device)
        slowest = stats[:1].clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM)
        losses.append(stats[1].item() / world)
        if step < spec["warmup"]:  # untimed; the first absorbs compilation
            warmup.append(slowest.item())
        else:
            times.append(slowest.item())
            wire.append(moved)
            if telemetry.enabled():
                hidden.append(hidden_fraction(telemetry.RECORDER.snapshot()))
    telemetry.set_enabled(True)
    return {
        "profile": prof.summary() if prof is not None else None,
        "step_s": times,
        "warmup_s": warmup,
        "loss": losses,
        "wire_bytes": wire,
        "hidden": hidden,
        "peak_mem": _peak(device),
        "baseline_mem": baseline,
        "state": engines.state_bytes(model, opt),
        "param_numel": sum(p.numel() for p in engines.plain_gpt(cfg, 0, "cpu").parameters()),
    }
