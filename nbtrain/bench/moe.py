"""`nbtrain bench --moe`: the MoE GPT's tokens/s against the dense GPT of equal active
parameters, on the same ranks, batches and optimizer.

    nbtrain bench --moe --ranks 2               # hidden 256, 4 layers, 8 experts, top-2
    nbtrain bench --moe --quick                 # hidden 64, 2 layers, 4 experts: a smoke run

Both models are built in the same processes (`init_distributed(ep_size=ranks)`: the
experts are split over the ranks) and wrapped by `nbtrain.wrap` (ZeRO-3). The MoE GPT is
`MoEGPT(MoEGPTConfig(...), ep_group=ExpertParallel.from_topology())`, every layer's MLP a
dropless top-k MoE whose experts are the dense MLP's width / top_k wide, so a token meets as
many MLP parameters as in `GPT(cfg.dense())`, the dense model it is timed against, while the
model holds
num_experts / top_k times the MLP parameters. A step is forward + backward + AdamW
(the MoE loss with its auxiliary balance loss); the two models' steps alternate, in
rotating order, so a load change hits both alike. Reported: median step time after
warm-up (the slowest rank per step) as tokens/s over all ranks, and the ratio MoE /
dense; total and active parameters; bytes per step per rank (all-to-all of the token
exchange, and everything the ZeRO-3 collectives move); the router's balance (max /
mean expert load, 1.0 even) and dropped share per MoE layer over the timed steps.
"""

from __future__ import annotations

import statistics
import sys
import time

MODELS = ("moe", "dense")


def config(quick: bool, chunks: int = 1):
    from nbtrain.models.gpt_moe import MoEGPTConfig

    size = (
        dict(hidden=64, heads=4, layers=2, seq_len=64, num_experts=4)
        if quick
        else dict(hidden=256, heads=8, layers=4, seq_len=128, num_experts=8)
    )
    return MoEGPTConfig(vocab_size=256, top_k=2, moe_chunks=chunks, **size)


def param_counts(cfg) -> dict:
    """Whole-model parameter counts (built on the meta device, every expert local):
    MoE total, MoE active per token (top_k of num_experts experts), dense."""
    import torch

    from nbtrain.comm.topology import ALONE
    from nbtrain.models.gpt import GPT
    from nbtrain.models.gpt_moe import MoEGPT

    with torch.device("meta"):
        moe = MoEGPT(cfg, ep_group=ALONE)
        dense = GPT(cfg.dense())
    total = sum(p.numel() for p in moe.parameters())
    idle = sum(
        (m.num_experts - m.top_k) * (m.w_in[0].numel() + m.w_out[0].numel())
        for m in moe.moe_layers()
    )
    return {
        "moe_total": total,
        "moe_active": total - idle,
        "dense": sum(p.numel() for p in dense.parameters()),
    }


def run_rank(spec: dict) -> dict:
    """One rank: both models trained step by step, alternating; the slowest rank's times."""
    import torch
    import torch.distributed as dist

    import nbtrain
    from nbtrain.comm.collectives import COUNTERS
    from nbtrain.models.gpt import GPT
    from nbtrain.models.gpt_moe import MoEGPT, router_stats
    from nbtrain.moe import ExpertParallel

    world = dist.get_world_size()
    ctx = nbtrain.init_distributed(seed=spec["seed"], ep_size=world)
    rank, device = ctx.rank, ctx.device
    cfg = config(spec["quick"], spec.get("chunks", 1))
    models = {}
    for name in MODELS:
        torch.manual_seed(spec["seed"])
        model = (
            MoEGPT(cfg, ep_group=ExpertParallel.from_topology())
            if name == "moe"
            else GPT(cfg.dense())
        )
        model = nbtrain.wrap(model.to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
        models[name] = (model, opt)
    total, rows = spec["warmup"] + spec["steps"], spec["batch_per_rank"]
    g = torch.Generator().manual_seed(spec["seed"] + 1)  # the same batches on every rank
    data = torch.randint(0, cfg.vocab_size, (total, world * rows, cfg.seq_len + 1), generator=g)
    out = {name: {"step_s": [], "loss": [], "a2a": [], "wire": []} for name in MODELS}
    routing: list[dict] = []
    for step in range(total):
        batch = data[step, rank * rows : (rank + 1) * rows].to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        for name in MODELS if step % 2 == 0 else MODELS[::-1]:
            model, opt = models[name]
            dist.barrier()
            COUNTERS.reset()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            moved = COUNTERS.snapshot()
            stats = torch.tensor([elapsed, loss.item()], dtype=torch.float64, device=device)
            slowest = stats[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM)
            rec = out[name]
            rec["loss"].append(stats[1].item() / world)
            if step >= spec["warmup"]:
                rec["step_s"].append(slowest.item())
                rec["a2a"].append(moved["bytes"].get("all_to_all", 0))
                rec["wire"].append(moved["total_bytes"])
                if name == "moe":
                    routing.append(router_stats(model))
    return {**out, "routing": routing}


def _routing_summary(routing: list[dict]) -> dict:
    """{layer label: (mean balance, max balance, dropped share)} over the timed steps."""
    labels = sorted(
        {k[: -len(".balance")] for r in routing for k in r if k.endswith(".balance")},
        key=lambda s: int(s.rsplit(".", 1)[1]),
    )
    out = {}
    for label in labels:
        balance = [r[f"{label}.balance"] for r in routing]
        dropped = sum(r[f"{label}.dropped"] for r in routing)
        assigned = sum(sum(r[f"{label}.load"]) for r in routing)
        out[label] = (statistics.mean(balance), max(balance), dropped / max(assigned, 1))
    return out


def measure(ranks: int, spec: dict, backend: str | None = None, log=print) -> dict:
    from ..launch import run_ranks

    start = time.perf_counter()
    per_rank = run_ranks(run_rank, ranks, spec, seed=spec["seed"], backend=backend, timeout_s=900.0)
    log(f"moe bench: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    cfg = config(spec["quick"])
    tokens = ranks * spec["batch_per_rank"] * cfg.seq_len  # per step, all ranks
    runs = {}
    for name in MODELS:
        step_s = per_rank[0][name]["step_s"]  # all-reduced maxima: the same on every rank
        median = statistics.median(step_s)
        runs[name] = {
            "step_time_s": median,
            "step_times_s": step_s,
            "tokens_per_s": tokens / median,
            "all_to_all_bytes_per_step": max(statistics.mean(r[name]["a2a"]) for r in per_rank),
            "wire_bytes_per_step": max(statistics.mean(r[name]["wire"]) for r in per_rank),
            "losses": per_rank[0][name]["loss"],
        }
    params = param_counts(cfg)
    routing = _routing_summary(per_rank[0]["routing"])
    moe, dense = runs["moe"], runs["dense"]
    ratios = {
        "moe_tokens_per_s_vs_dense": moe["tokens_per_s"] / dense["tokens_per_s"],
        "moe_total_params_vs_dense": params["moe_total"] / params["dense"],
        "moe_active_params_vs_dense": params["moe_active"] / params["dense"],
        "moe_wire_bytes_vs_dense": moe["wire_bytes_per_step"] / dense["wire_bytes_per_step"],
        "moe_router_balance_mean": statistics.mean(b for b, _, _ in routing.values()),
    }
    settings = {
        **spec,
        "ranks": ranks,
        "tokens_per_step": tokens,
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    }
    return {
        "settings": settings,
        "runs": runs,
        "params": params,
        "routing": routing,
        "ratios": ratios,
    }


def table(result: dict) -> str:
    runs, params, MiB = result["runs"], result["params"], 2**20
    lines = [
        (
            f"{'model':<6} {'step ms':>8} {'min-max ms':>13} {'tokens/s':>10} "
            f"{'params M':>9} {'active M':>9} {'a2a MiB':>8} {'wire MiB':>9} {'loss':>12}"
        )
    ]
    counts = {
        "moe": (params["moe_total"], params["moe_active"]),
        "dense": (params["dense"], params["dense"]),
    }
    for name in MODELS:
        r = runs[name]
        times, losses = r["step_times_s"], r["losses"]
        span = f"{1e3 * min(times):.0f}-{1e3 * max(times):.0f}"
        trend = f"{losses[0]:.2f}->{losses[-1]:.2f}"
        lines.append(
            f"{name:<6} {1e3 * r['step_time_s']:>8.1f} "
            f"{span:>13} "
            f"{r['tokens_per_s']:>10,.0f} {counts[name][0] / 1e6:>9.3f} "
            f"{counts[name][1] / 1e6:>9.3f} "
            f"{r['all_to_all_bytes_per_step'] / MiB:>8.2f} "
            f"{r['wire_bytes_per_step'] / MiB:>9.2f} "
            f"{trend:>12}"
        )
    lines.append(
        "router balance (max / mean expert load, 1.00 even; timed steps): "
        + ", ".join(
            f"{label} {mean:.2f} (max {worst:.2f}, dropped {100 * drop:.1f}%)"
            for label, (mean, worst, drop) in result["routing"].items()
        )
    )
    lines.append(
        "min-max ms: fastest-slowest timed step; a2a / wire MiB: per step per rank "
        "(the token exchange / every collective)"
    )
    lines += [f"{key}: {value:.3f}" for key, value in result["ratios"].items()]
    return "\n".join(lines)


def main(args) -> int:
    from .runs import backend_of, write_json

    quick = args.quick
    backend = backend_of(args)
    spec = {
        "quick": quick,
        "seed": args.seed,
        "batch_per_rank": args.batch_per_rank,
        "warmup": args.warmup if args.warmup is not None else 2 if quick else 3,
        "steps": args.steps or (4 if quick else 20),
        "chunks": args.moe_chunks,
    }
    if args.moe_chunks < 1:
        raise SystemExit(f"--moe-chunks {args.moe_chunks}: give 1 (no pipelining) or more")
    cfg = config(quick, args.moe_chunks)
    if cfg.num_experts % args.ranks:
        raise SystemExit(
            f"--moe: {cfg.num_experts} experts do not split over {args.ranks} "
            f"ranks; use --ranks dividing {cfg.num_experts}"
        )
    print(
        f"nbtrain bench --moe: {args.ranks} ranks (ep {args.ranks}), {backend}, GPT hidden "
        f"{cfg.hidden}, {cfg.layers} layers, seq {cfg.seq_len}; MoE: {cfg.num_experts} "
        f"experts of width {cfg.expert_hidden}, top-{cfg.top_k}, dropless, aux balance "
        f"loss, exchange in {cfg.moe_chunks} chunk(s); dense: MLP width "
        f"{cfg.mlp_ratio * cfg.hidden}; ZeRO-3, AdamW, fp32, "
        f"{spec['batch_per_rank']} seq/rank, {spec['steps']} timed steps "
        f"(+{spec['warmup']} warm-up) each",
        flush=True,
    )
    result = measure(args.ranks, spec, backend)
    print(table(result))
    write_json(args.json, result)
    return 0
