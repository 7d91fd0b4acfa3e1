"""`nbtrain bench --pipe-size P`: nbtrain's pipeline schedule against
torch.distributed.pipelining (PipelineStage with Schedule1F1B), same GPT, same stages, same
micro-batches, same run.

The GPT (untied head: the two ends are on different stages) is cut by
`nbtrain.models.gpt_pipe.gpt_layers` and `nbtrain.pipeline.balanced_split`; both
engines run the same stage modules with 1F1B. Reported besides the usual columns:
the measured bubble of nbtrain's schedule (per stage, 1 - compute time / schedule
time, from its telemetry spans, averaged over stages) against the theory
(P - 1) / (M + P - 1) and against torch's, measured the same way (its stage's
forward_one_chunk and backward_one_chunk timed), and the point-to-point bytes of all
ranks per step against the activation count 2 (P - 1) x batch x seq x hidden x 4
(activations forward, their gradients back). torch's sends are counted by wrapping the
torch.distributed calls
its schedule makes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nbtrain as nbt
from nbtrain import pipeline, telemetry
from nbtrain.comm import COUNTERS
from nbtrain.models import GPTConfig
from nbtrain.models.gpt_pipe import gpt_layers

from . import engines
from .worker import _peak, _reset_peak, batches

PP_ENGINES = ("nbtrain_pp", "torch_pp")


def _config(spec: dict) -> GPTConfig:
    return GPTConfig.preset(spec["model_size"], tie_embeddings=False)


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _count_torch_sends() -> None:
    """Counts the bytes of the sends torch's schedule posts (into engines.WIRE): every
    transfer goes through its `_batch_p2p` or `_sorted_batch_p2p` helper."""
    from torch.distributed.pipelining import schedules

    def counting(post):
        def wrapped(p2p_ops, *a, **kw):
            for op in p2p_ops:
                if op.op is dist.isend:
                    engines.WIRE.add(op.tensor.numel() * op.tensor.element_size())
            return post(p2p_ops, *a, **kw)

        return wrapped

    for name in ("_batch_p2p", "_sorted_batch_p2p"):
        setattr(schedules, name, counting(getattr(schedules, name)))


def _bubble(events: list[dict], span: float) -> float | None:
    busy = sum(
        e["end"] - e["start"]
        for e in events
        if e["type"] == "compute" and e["label"].startswith("stage")
    )
    return None if span <= 0 or not busy else max(0.0, 1.0 - busy / span)


def _time_torch_chunks(torch_stage) -> list[float]:
    """Times torch's per-micro-batch forward and backward on this stage (its compute,
    without the transfers): the busy seconds of a step accumulate in the returned cell."""
    busy = [0.0]

    def timed(method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        return run

    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(torch_stage, name, timed(getattr(torch_stage, name)))
    return busy


def run_rank(spec: dict) -> dict:
    """One rank of one engine: train warmup + steps steps, measure."""
    ctx = nbt.get_context()
    pipe, engine, micro = spec["pp"], spec["engine"], spec["micro_batches"]
    topo = nbt.init_distributed(seed=spec["seed"], pipe_size=pipe).topology
    cfg = _config(spec)
    device = ctx.device
    layers = gpt_layers(engines.plain_gpt(cfg, spec["seed"], device))
    stage = pipeline.stage_of(layers)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    schedule = None
    if engine == "torch_pp":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        _count_torch_sends()
        torch_stage = PipelineStage(stage, topo.pipe_rank, pipe, device)
        busy = _time_torch_chunks(torch_stage)
        schedule = Schedule1F1B(torch_stage, n_microbatches=micro, loss_fn=_loss)
    total = spec["warmup"] + spec["steps"]
    xs, ys = batches(cfg, total, spec["batch_per_rank"] * ctx.world_size, 1, spec["seed"])
    first, last = topo.pipe_rank == 0, topo.pipe_rank == pipe - 1
    telemetry.set_enabled(engine == "nbtrain_pp")
    _reset_peak(device)
    times, losses, wire, bubbles = [], [], [], []
    for step in range(total):
        x, y = xs[step].to(device), ys[step].to(device)
        dist.barrier()
        telemetry.RECORDER.clear()
        COUNTERS.reset()
        engines.WIRE.total = 0
        if engine == "torch_pp":
            busy[0] = 0.0
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if engine == "nbtrain_pp":
            mb = pipeline.run(stage, list(x.chunk(micro)), list(y.chunk(micro)), _loss)
            loss = torch.tensor(sum(mb) / micro, device=device)
        else:
            mb = []
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=mb)
            else:
                schedule.step()
            loss = torch.stack(mb).mean().detach() if last else torch.zeros((), device=device)
            dist.broadcast(loss, src=pipe - 1)
        span = time.perf_counter() - start
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        sent = (
            COUNTERS.snapshot()["bytes"].get("p2p", 0)
            if engine == "nbtrain_pp"
            else engines.WIRE.total
        )
        stats = torch.tensor([elapsed, sent], dtype=torch.float64, device=device)
        slowest = stats[:1].clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM)  # every rank's sends
        losses.append(loss.item())
        if step >= spec["warmup"]:
            times.append(slowest.item())
            wire.append(stats[1].item())
            if telemetry.enabled():
                bubbles.append(_bubble(telemetry.RECORDER.snapshot(), span))
            elif engine == "torch_pp" and span > 0:  # the same measure, from its chunks
                bubbles.append(max(0.0, 1.0 - busy[0] / span))
    telemetry.set_enabled(True)
    return {
        "step_s": times,
        "loss": losses,
        "wire_bytes": wire,
        "hidden": [],
        "bubble": [b for b in bubbles if b is not None],
        "peak_mem": _peak(device),
        "baseline_mem": 0,
        "state": engines.state_bytes(stage, opt),
        "param_numel": sum(p.numel() for p in engines.plain_gpt(cfg, 0, "cpu").parameters()),
    }


def theory(cfg: GPTConfig, batch: int, pipe: int, param_numel: int) -> dict:
    """Model state per rank (16 bytes x params / P, balanced stages) and the p2p bytes
    of all ranks per step (activations and their gradients over P - 1 links, fp32)."""
    act = batch * cfg.seq_len * cfg.hidden * 4
    return {"state_bytes": 16 * param_numel / pipe, "wire_bytes": 2 * (pipe - 1) * act}


def bubble_theory(pipe: int, micro: int) -> float:
    return (pipe - 1) / (micro + pipe - 1)
