"""The local parts of MoE and ring attention, timed on one device.

    python -m nbtrain.bench.local_parts            # the sizes below; on a CPU, small ones

Expert and context parallelism need several ranks, but each has a part a single
device runs: a rank's experts on their rows, and ring attention's block kernel. This
times both against what they replace, forward + backward, median of the timed
iterations after warm-up (CUDA synchronised around each):

    experts   `nbtrain.moe.experts_ffn` (one grouped matmul per weight for all local
              experts, where torch has it) against the loop of one matmul pair per
              expert, on the same rows: experts_grouped_vs_loop (below 1: faster)
    moe       a whole `nbtrain.moe.MoE` layer with every expert local (routing, sorting,
              the grouped experts, the weighted sum; no exchange) against the dense MLP
              of equal active parameters (width top_k x the expert width) on the same
              tokens: moe_layer_vs_dense_mlp, the ceiling `nbtrain bench --moe` can
              reach on this device before any all_to_all (1: MoE costs no more)
    ring      `ring_attention` over a group of one (its block kernel and merges on
              the whole causal sequence) against `scaled_dot_product_attention` of the
              same tensors: ring_block_vs_sdpa (1: the ring's kernel costs nothing extra)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _timed(fn, device, warmup: int, iters: int) -> float:
    """Median seconds of fn() over `iters` calls after `warmup`."""
    times = []
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def experts(device, dtype, experts: int, rows: int, hidden: int, ffn: int, warmup, iters):
    """(grouped s, loop s, whether the grouped kernel ran) for `experts` local experts."""
    from nbtrain.moe import expert_ffn, experts_ffn, uses_grouped_mm

    g = torch.Generator().manual_seed(0)
    # An uneven load, as a router gives: expert e gets rows in proportion to e + 1.
    shares = torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (shares / shares.sum() * rows).floor().long().tolist()
    counts[-1] += rows - sum(counts)
    x, w_in, w_out = (
        (torch.randn(shape, generator=g) / shape[-2] ** 0.5).to(device, dtype).requires_grad_()
        for shape in ((rows, hidden), (experts, hidden, ffn), (experts, ffn, hidden))
    )
    grad = torch.randn(rows, hidden, generator=g).to(device, dtype)

    def grouped():
        torch.autograd.grad(experts_ffn(x, w_in, w_out, counts), (x, w_in, w_out), grad)

    def loop():
        parts = x.split(counts)
        out = torch.cat([expert_ffn(r, w_in[e], w_out[e]) for e, r in enumerate(parts)])
        torch.autograd.grad(out, (x, w_in, w_out), grad)

    ran = uses_grouped_mm(device.type, dtype, hidden, ffn)
    return _timed(grouped, device, warmup, iters), _timed(loop, device, warmup, iters), ran


def moe_layer(device, dtype, experts: int, tokens: int, hidden: int, width: int, warmup, iters):
    """(MoE layer s, dense MLP s): top-2 over `experts` local experts of `width` against
    an MLP of width 2 x `width`, forward + backward on the same tokens."""
    from torch import nn

    from nbtrain.comm.topology import ALONE
    from nbtrain.moe import MoE

    torch.manual_seed(0)
    moe = MoE(hidden, width, experts, top_k=2, group=ALONE, balance="none").to(device, dtype)
    mlp = nn.Sequential(nn.Linear(hidden, 2 * width), nn.GELU(), nn.Linear(2 * width, hidden))
    mlp = mlp.to(device, dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens, hidden, generator=g).to(device, dtype)

    def run(module):
        return lambda: torch.autograd.grad(module(x), (x, *module.parameters()), grad)

    return _timed(run(moe), device, warmup, iters), _timed(run(mlp), device, warmup, iters)


def ring_block(device, dtype, heads: int, seq: int, head_dim: int, warmup, iters):
    """(ring over a group of one s, SDPA s, which block kernel) on one causal sequence."""
    from nbtrain import context_parallel as cp
    from nbtrain.comm.topology import ALONE

    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, heads, seq, head_dim, generator=g).to(device, dtype).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(1, heads, seq, head_dim, generator=g).to(device, dtype)

    def ring():
        out = cp.ring_attention(q, k, v, causal=True, group=ALONE)
        torch.autograd.grad(out, (q, k, v), grad)

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    fused = "fused" if cp.uses_fused_kernel(q) else "math"
    return _timed(ring, device, warmup, iters), _timed(sdpa, device, warmup, iters), fused


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    kind = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU and none is visible")
    device = torch.device(kind)
    big = device.type == "cuda"
    dtype = torch.bfloat16 if big else torch.float32
    # GPU: 8 local experts of a 1B-class MoE layer on 8192 routed rows, a 4096-token
    # sequence of 16 heads; CPU: a smoke size.
    e_size = (8, 8192, 2048, 1408) if big else (4, 512, 128, 256)
    r_size = (16, 4096, 128) if big else (4, 512, 64)
    # MoE layer: 8 experts top-2; CPU: one rank's share in `nbtrain bench --moe`
    m_size = (8, 4096, 2048, 1408) if big else (8, 512, 256, 512)
    print(
        f"nbtrain local parts: {kind}, {str(dtype).removeprefix('torch.')}, forward + "
        f"backward, median of {args.iters} after {args.warmup} warm-up"
    )
    grouped_s, loop_s, ran = experts(device, dtype, *e_size, args.warmup, args.iters)
    print(
        f"experts: {e_size[0]} local, {e_size[1]} rows, hidden {e_size[2]}, width {e_size[3]}: "
        f"grouped {1e3 * grouped_s:.2f} ms ({'grouped_mm' if ran else 'loop fallback'}), "
        f"loop {1e3 * loop_s:.2f} ms"
    )
    moe_s, mlp_s = moe_layer(device, dtype, *m_size, args.warmup, args.iters)
    print(
        f"moe layer: {m_size[0]} experts (all local), top-2, {m_size[1]} tokens, hidden "
        f"{m_size[2]}, width {m_size[3]}: {1e3 * moe_s:.2f} ms; dense MLP of width "
        f"{2 * m_size[3]}: {1e3 * mlp_s:.2f} ms"
    )
    ring_s, sdpa_s, fused = ring_block(device, dtype, *r_size, args.warmup, args.iters)
    print(
        f"ring block: {r_size[0]} heads x {r_size[2]}, {r_size[1]} causal tokens, {fused} "
        f"kernel: ring of one {1e3 * ring_s:.2f} ms, SDPA {1e3 * sdpa_s:.2f} ms"
    )
    print(f"experts_grouped_vs_loop: {grouped_s / loop_s:.3f}")
    print(f"moe_layer_vs_dense_mlp: {moe_s / mlp_s:.3f}")
    print(f"ring_block_vs_sdpa: {ring_s / sdpa_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
