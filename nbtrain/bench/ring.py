"""`nbtrain bench --ring`: how much of ring attention's communication hides behind its
compute, and what it costs against plain attention of the whole sequence on one rank.

    nbtrain bench --ring --ranks 2              # cp = the 2 ranks, a 2048-token sequence
    nbtrain bench --ring --quick                # 1024 tokens, a smoke run

The cp group is the world (`init_distributed(cp_size=ranks)`); q, k, v of one long
causal sequence are sharded zigzag (`shard_sequence`), and each variant is timed
forward + backward (the slowest rank, median over the timed iterations; the variants
interleaved in rotating order, so a load change hits all alike):

    ring      ring_attention with its waits on sends and receives timed (the output
              checked against full attention first): T_ring, and W, the time blocked
              in those waits
    compute   the same ring with every send/receive replaced by a local copy: the same
              blocks, block kernel and merges, no communication: T_comp
    comm      the same ring with no block computed: the same sends and receives
              (K/V forward, K/V and dK/dV backward) with nothing to hide behind: T_comm
    sdpa      `scaled_dot_product_attention` of the full sequence, forward + backward,
              on each rank alone (every rank at once, as the ring's ranks run): T_full

hidden share = (T_comm + T_comp - T_ring) / T_comm, clipped to [0, 1]: 1 when the ring
costs no more than its compute, 0 when it costs compute plus all of its comm. Where the
comm is a few percent of the compute (a CPU, a long sequence) that difference of large
times is within their noise; the waits measure it directly: hidden share from waits =
1 - W / T_comm (W of the rank that waited most, median over the iterations). W also
holds the time a rank waits for a peer still computing its step (the ring meets at
every step, where the compute variant's ranks only meet at the end), so it errs low.
The comm also takes CPU from the compute where no core is idle (gloo moves the bytes
with CPU threads), which the difference counts as not hidden and the waits do not see.
T_ring / T_full against 1 / cp says what splitting the sequence buys over one rank's
fused kernel; the table names the ring's block kernel (fused op or the math fallback).

All three ring variants are `ring_attention` itself, given a `Ring` subclass through its
public `ring=` argument (the hook for this): `exchange` wrapped to time the waits,
replaced by local copies (compute only), or `blocks` returning none (comm only), so no
copy of the attention math here can drift from the real one. W is also split by
exchange (forward K/V, backward K/V, dK/dV on the way, and the last dK/dV hop, to the
owner, which the owner's own block hides) in the JSON and the table. The goals printed
beside T_ring / T_full: at most 0.55 at cp 2 and 0.40 at cp 3 (the ideal 1 / cp plus
the merges and the exchanges a fused kernel of the whole sequence does not have).
"""

from __future__ import annotations

import statistics
import sys
import time

VARIANTS = ("ring", "compute", "comm", "sdpa")


def _rings():
    """Three `Ring` subclasses: the real ring with its waits timed (per exchange kind),
    one computing with no communication, one communicating with no compute."""
    from ..context_parallel import Ring

    class _TimedWork:
        def __init__(self, work, ring, kind):
            self.work, self.ring, self.kind = work, ring, kind

        def wait(self):
            start = time.perf_counter()
            self.work.wait()
            waited = time.perf_counter() - start
            self.ring.waited[self.kind] = self.ring.waited.get(self.kind, 0.0) + waited

    class Timed(Ring):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.waited = {}  # exchange kind: seconds blocked on it (the comm left exposed)

        def exchange(self, sends, recvs, tags, label):
            kind = _exchange_kind(label, self.size)
            return [_TimedWork(w, self, kind) for w in super().exchange(sends, recvs, tags, label)]

    class ComputeOnly(Ring):
        def exchange(self, sends, recvs, tags, label):
            for send, recv in zip(sends, recvs):  # this rank's own block stands in for
                if send.shape != recv.shape:  # its neighbour's (which may be half or whole)
                    recv.zero_()
                common = tuple(slice(0, min(a, b)) for a, b in zip(send.shape, recv.shape))
                recv[common].copy_(send[common])
            return []

    class CommOnly(Ring):
        def blocks(self, step, local_seq, whole_diagonal=True):
            return []

    return Timed, ComputeOnly, CommOnly


EXCHANGES = ("kv forward", "kv backward", "dkv", "dkv to owner")
GOALS = {2: 0.55, 3: 0.40}  # T_ring / T_full at cp 2 and 3


def _exchange_kind(label: str, size: int) -> str:
    """ring_attention's exchange labels, by kind (the last dK/dV hop reaches the block's
    owner, hidden behind its own block)."""
    if label.startswith("cp ring kv grad"):
        return "kv backward"
    if label.startswith("cp ring kv"):
        return "kv forward"
    return "dkv to owner" if label == f"cp ring dkv step {size - 1}" else "dkv"


def run_rank(spec: dict) -> dict:
    """One rank: every variant timed, rotating; returns the slowest rank's seconds."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import nbtrain
    from nbtrain import context_parallel as ra
    from nbtrain.comm.collectives import COUNTERS

    world = dist.get_world_size()
    ctx = nbtrain.init_distributed(cp_size=world)
    group = ctx.topology.group("cp")
    b, h, t, d = spec["batch"], spec["heads"], spec["seq"], spec["head_dim"]
    g = torch.Generator().manual_seed(spec["seed"])  # the same full tensors on every rank
    full = [torch.randn(b, h, t, d, generator=g).to(ctx.device) for _ in range(4)]  # q k v dout
    local = [ra.shard_sequence(x, 2, group) for x in full]
    timed_ring, compute_ring, comm_ring = _rings()
    rings = []  # the timed ring of each "ring" call, for its waits

    def ring_call(cls):
        def build(**kwargs):  # ring_attention's `ring=` factory: keeps each ring built
            rings.append(cls(**kwargs))
            return rings[-1]

        return lambda q, k, v: ra.ring_attention(q, k, v, causal=True, group=group, ring=build)

    calls = {
        "ring": (ring_call(timed_ring), local),
        "compute": (ring_call(compute_ring), local),
        "comm": (ring_call(comm_ring), local),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), full),
    }
    leaves = {
        name: [x.clone().requires_grad_(True) for x in tensors[:3]]
        for name, (_, tensors) in calls.items()
    }

    def once(name):
        fn, tensors = calls[name]
        q, k, v = leaves[name]
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v)
        out.backward(tensors[3])
        return out

    # Exact first: ring_attention's output is this rank's rows of full attention, and so
    # is the timed ring's.
    reference = ra.shard_sequence(
        F.scaled_dot_product_attention(*full[:3], is_causal=True), 2, group
    )
    diff = max(
        (ra.ring_attention(*local[:3], causal=True, group=group) - reference).abs().max(),
        (once("ring").detach() - reference).abs().max(),
    ).item()
    COUNTERS.reset()
    once("ring")
    p2p = COUNTERS.snapshot()["bytes"].get("p2p", 0)
    times = {name: [] for name in VARIANTS}
    waits = []  # per timed "ring" call: {exchange kind: seconds blocked}
    for it in range(spec["warmup"] + spec["iters"]):
        order = VARIANTS[it % len(VARIANTS) :] + VARIANTS[: it % len(VARIANTS)]
        for name in order:
            dist.barrier()
            rings.clear()
            start = time.perf_counter()
            once(name)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            slowest = torch.tensor(
                [time.perf_counter() - start], dtype=torch.float64, device=ctx.device
            )
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if it >= spec["warmup"]:
                times[name].append(slowest.item())
                if name == "ring":  # forward and backward share the ring object
                    waits.append(
                        {kind: sum(r.waited.get(kind, 0.0) for r in rings) for kind in EXCHANGES}
                    )
    fused = ra.uses_fused_kernel(local[0])
    kernel = (
        {
            "cpu": "fused: aten flash attention for CPU",
            "cuda": "fused: aten memory-efficient attention",
        }.get(ctx.device.type)
        if fused
        else "math (float32)"
    )
    return {
        "times": times,
        "waits": waits,
        "p2p_bytes": p2p,
        "max_abs_diff": diff,
        "kernel": kernel,
    }


def measure(ranks: int, spec: dict, backend: str | None = None, log=print) -> dict:
    """Runs the ranks; the per-variant seconds (the slowest rank per iteration) and ratios."""
    from ..launch import run_ranks

    start = time.perf_counter()
    per_rank = run_ranks(run_rank, ranks, spec, seed=spec["seed"], backend=backend, timeout_s=900.0)
    log(f"ring bench: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    times = per_rank[0]["times"]  # every rank holds the same all-reduced maxima
    med = {name: statistics.median(times[name]) for name in VARIANTS}
    waited = max(statistics.median(sum(w.values()) for w in r["waits"]) for r in per_rank)
    by_kind = {
        kind: max(statistics.median(w[kind] for w in r["waits"]) for r in per_rank)
        for kind in EXCHANGES
    }
    t_ring, t_comp, t_comm, t_full = (med[n] for n in VARIANTS)
    hidden = _hidden(t_ring, t_comp, t_comm)
    ratios = {
        "ring_hidden_comm_share": min(1.0, max(0.0, hidden)),
        "ring_hidden_comm_share_unclipped": hidden,
        "ring_hidden_comm_share_from_waits": min(1.0, max(0.0, 1 - waited / t_comm)),
        "ring_vs_compute_only": t_ring / t_comp,
        "comm_only_vs_compute_only": t_comm / t_comp,
        "ring_vs_full_sdpa": t_ring / t_full,
        "compute_only_vs_full_sdpa": t_comp / t_full,
        "ideal_vs_full_sdpa": 1.0 / ranks,
    }
    return {
        "settings": {**spec, "ranks": ranks},
        "median_s": med,
        "times_s": times,
        "exposed_wait_s": waited,
        "exposed_wait_by_exchange_s": by_kind,
        "waits_s": [r["waits"] for r in per_rank],
        "p2p_bytes_per_call": max(r["p2p_bytes"] for r in per_rank),
        "max_abs_diff_vs_sdpa": max(r["max_abs_diff"] for r in per_rank),
        "block_kernel": per_rank[0]["kernel"],
        "ratios": ratios,
    }


def _hidden(t_ring: float, t_comp: float, t_comm: float) -> float:
    return (t_comm + t_comp - t_ring) / t_comm if t_comm > 0 else float("nan")


def table(result: dict) -> str:
    med, times = result["median_s"], result["times_s"]
    names = {
        "ring": "ring (comm + compute)",
        "compute": "compute only (local copies)",
        "comm": "comm only (no blocks)",
        "sdpa": "full-sequence SDPA, one rank",
    }
    lines = [f"{'variant':<30} {'median ms':>10} {'min ms':>8} {'max ms':>8}"]
    for name in VARIANTS:
        lines.append(
            f"{names[name]:<30} {1e3 * med[name]:>10.1f} "
            f"{1e3 * min(times[name]):>8.1f} {1e3 * max(times[name]):>8.1f}"
        )
    lines.append(
        f"{'ring: blocked in waits (W)':<30} {1e3 * result['exposed_wait_s']:>10.1f}"
        f"   (the rank that waited most)"
    )
    lines.append(
        "  W by exchange: "
        + ", ".join(
            f"{kind} {1e3 * t:.1f}" for kind, t in result["exposed_wait_by_exchange_s"].items()
        )
        + " ms (medians, the rank that waited most on each)"
    )
    lines.append(f"block kernel: {result['block_kernel']}")
    lines.append(
        f"p2p bytes per rank per forward+backward: "
        f"{result['p2p_bytes_per_call'] / 2**20:.2f} MiB; ring vs SDPA max |diff| "
        f"{result['max_abs_diff_vs_sdpa']:.1e}"
    )
    lines.append(
        "hidden share = (T_comm + T_comp - T_ring) / T_comm, clipped to [0, 1] "
        "(medians); _from_waits: 1 - W / T_comm"
    )
    lines += [f"{key}: {value:.3f}" for key, value in result["ratios"].items()]
    goal = GOALS.get(result["settings"]["ranks"])
    if goal is not None:
        got = result["ratios"]["ring_vs_full_sdpa"]
        lines.append(
            f"goal ring_vs_full_sdpa <= {goal:.2f} at cp {result['settings']['ranks']}: "
            f"{got:.3f}, {'met' if got <= goal else 'not met'}"
        )
    return "\n".join(lines)


def main(args) -> int:
    from .runs import backend_of, write_json

    quick = args.quick
    backend = backend_of(args)
    spec = {
        "batch": 1,
        "heads": 4 if quick else 8,
        "head_dim": 64,
        "seq": 1024 if quick else 2048,
        "seed": args.seed,
        "warmup": args.warmup if args.warmup is not None else (1 if quick else 2),
        "iters": args.steps or (3 if quick else 25),
    }
    if args.ranks < 2:
        raise SystemExit("--ring: a ring needs --ranks 2 or more (one rank is plain attention)")
    # The zigzag layout cuts the sequence into 2 x cp equal chunks: at cp 3, 2046 tokens.
    spec["seq"] -= spec["seq"] % (2 * args.ranks)
    print(
        f"nbtrain bench --ring: {args.ranks} ranks (cp {args.ranks}, zigzag), {backend}, "
        f"batch {spec['batch']}, {spec['heads']} heads x {spec['head_dim']}, causal "
        f"sequence of {spec['seq']} tokens ({spec['seq'] // args.ranks} per rank), "
        f"float32, forward + backward, {spec['iters']} timed (+{spec['warmup']} warm-up) "
        f"per variant",
        flush=True,
    )
    result = measure(args.ranks, spec, backend)
    print(table(result))
    write_json(args.json, result)
    return 0 if result["max_abs_diff_vs_sdpa"] < 1e-3 else 1
