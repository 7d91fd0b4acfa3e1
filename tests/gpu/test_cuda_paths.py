"""CUDA paths: NCCL at world size 1, collectives off the compute stream, parity on GPU.

Run on a GPU machine with:  python3 -m pytest -m gpu tests/gpu tests/kernels
"""

import pytest
import torch

import nbtrain as nbt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def nccl_world():
    if nbt.comm.is_initialized():
        nbt.comm.shutdown()
    ctx = nbt.init_distributed(backend="nccl")
    yield ctx
    nbt.comm.shutdown()


def test_nccl_world_of_one(nccl_world):
    assert nccl_world.backend == "nccl" and nccl_world.device.type == "cuda"
    x = torch.ones(4, device=nccl_world.device)
    nbt.comm.all_reduce(x)
    assert x.tolist() == [1.0] * 4


def test_gather_waits_on_stream_not_host(nccl_world):
    """wait() orders the compute stream after the collective without a host sync."""
    from nbtrain.comm import all_gather

    dev = nccl_world.device
    shard = torch.randn(1 << 20, device=dev)
    full = torch.empty_like(shard)
    # Queue a long kernel first so the collective cannot have finished yet.
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(8):
        a = a @ a / 4096
    handle = all_gather(full, shard, async_op=True)
    handle.wait()  # returns before the GPU is done: an event wait, not a sync
    pending = not torch.cuda.current_stream(dev).query()
    out = full.sum()  # ordered after the gather on the current stream
    torch.testing.assert_close(out, shard.sum())
    assert pending, "wait() synchronised the host with the GPU"


def test_wrapped_gpt_matches_plain_on_gpu(nccl_world):
    from nbtrain.models import GPT, GPTConfig

    dev = nccl_world.device
    cfg = GPTConfig(vocab_size=257, hidden=64, heads=4, layers=3, seq_len=16)
    torch.manual_seed(0)
    ref = GPT(cfg).to(dev)
    torch.manual_seed(0)
    model = nbt.wrap(GPT(cfg).to(dev), zero_level=3)
    assert all(p.device.type == "cuda" for p in model.parameters())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    g = torch.Generator(device="cpu").manual_seed(3)
    for _ in range(5):
        x = torch.randint(0, 257, (4, 16), generator=g).to(dev)
        y = torch.randint(0, 257, (4, 16), generator=g).to(dev)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            loss = m.loss(x, y)
            loss.backward()
            o.step()
            if m is ref:
                ref_loss = loss.item()
        assert loss.item() == pytest.approx(ref_loss, abs=1e-4)
    state = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=1e-4, rtol=1e-4)


def test_cpu_batches_and_data_parallel_parameters_on_gpu(nccl_world):
    """A wrapped GPT on the GPU takes the data helpers' batches (already on the
    device) and CPU token ids (moved by the model) alike."""
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.data import BatchSampler

    dev = nccl_world.device
    sampler = BatchSampler(torch.arange(4000) % 256, seq_len=16, global_batch=4)
    x, y = sampler.local_batch(0)
    assert x.device == dev and y.device == dev
    model = nbt.wrap(
        GPT(GPTConfig(vocab_size=256, hidden=32, heads=2, layers=2, seq_len=16)).to(dev)
    )
    cpu_x, cpu_y = sampler.batch(0)
    torch.testing.assert_close(model.loss(cpu_x, cpu_y), model.loss(x, y))


def test_data_parallel_plain_parameters_on_gpu(nccl_world):
    """Plain parameters of a DistributedModule (bucketed all-reduce) on CUDA/NCCL."""
    from torch import nn

    dev = nccl_world.device
    torch.manual_seed(0)
    embed, body, head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50)
    ref = nn.Sequential(embed, body, head).to(dev)

    class Model(nbt.DistributedModule):
        def __init__(self, plain):
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
            self.load_state_dict(
                {
                    k.replace("0.", "embed.").replace("2.", "head."): v
                    for k, v in plain.state_dict().items()
                    if k[0] in "02"
                }
            )
            self.to(dev)
            self.body = nbt.Block(nn.Linear(16, 16).to(dev).requires_grad_(True))
            self.body.load_state_dict(
                {k[2:]: v for k, v in plain.state_dict().items() if k[0] == "1"}
            )

        def forward(self, x):
            return self.head(self.body(self.embed(x)))

    model = Model(ref)
    x = torch.randint(0, 50, (4, 8), device=dev)
    for m in (ref, model):
        m(x).square().mean().backward()
    torch.testing.assert_close(model.head.weight.grad, ref[2].weight.grad)
    torch.testing.assert_close(model.embed.weight.grad, ref[0].weight.grad)


# -- torch.compile of Blocks (inductor on CUDA) and bf16 with fp32 masters, world 1 ------
# The CPU versions, at 2 ranks, are tests/multirank/test_compile.py and test_bf16.py.


def _tiny_gpt_cfg():
    from nbtrain.models import GPTConfig

    # hidden 36: parameter views at offsets that are not multiples of 16 bytes
    return GPTConfig(vocab_size=97, hidden=36, heads=3, layers=2, seq_len=16)


def _cuda_batches(dev, steps, rows=4):
    g = torch.Generator(device="cpu").manual_seed(5)
    cfg = _tiny_gpt_cfg()
    xs = torch.randint(0, cfg.vocab_size, (steps, rows, cfg.seq_len), generator=g)
    ys = torch.randint(0, cfg.vocab_size, (steps, rows, cfg.seq_len), generator=g)
    return xs.to(dev), ys.to(dev)


def compiled_vs_eager(dev, setting=True, steps=3):
    """Eager and compiled (inductor by default) Blocks trained alike with SGD momentum
    and AdamW; returns the results by optimizer, the plain model's state_dict keys."""
    from torch._dynamo.utils import counters

    from nbtrain.models import GPT

    cfg = _tiny_gpt_cfg()
    xs, ys = _cuda_batches(dev, steps)
    out = {}
    for opt_name in ("sgd", "adamw"):
        for mode, option in (("eager", False), ("compiled", setting)):
            torch.manual_seed(0)
            model = nbt.wrap(GPT(cfg).to(dev), zero_level=3, compile=option)
            opt = (
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                if opt_name == "sgd"
                else torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
            )
            losses, graphs = [], []
            for s in range(steps):
                with torch._dynamo.config.patch(error_on_recompile=s > 0):
                    opt.zero_grad()
                    loss = model.loss(xs[s], ys[s])
                    loss.backward()
                if s == 0:
                    grads = nbt.zero.full_named_grads(model)
                opt.step()
                losses.append(loss.item())
                graphs.append(counters["stats"]["unique_graphs"])
            out[opt_name, mode] = {
                "losses": losses,
                "grads": grads,
                "graphs": graphs,
                "state": model.state_dict(),
                "stats": [b.compile_stats for b in model.layers],
            }
    torch.manual_seed(0)
    return out, list(GPT(cfg).state_dict())


def check_compiled_vs_eager(out, plain_keys, tol):
    for opt_name in ("sgd", "adamw"):
        eager, compiled = out[opt_name, "eager"], out[opt_name, "compiled"]
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=tol), opt_name
        for name, g in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][name], g, atol=tol, rtol=tol)
        assert list(compiled["state"]) == plain_keys, opt_name
        for name, v in eager["state"].items():
            torch.testing.assert_close(compiled["state"][name], v, atol=tol, rtol=tol)
        graphs = compiled["graphs"]
        assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * (len(graphs) - 1), graphs
        assert all(s is not None and s.graph_breaks == 0 for s in compiled["stats"]), compiled[
            "stats"
        ]


def test_compiled_blocks_match_eager_on_gpu(nccl_world):
    """Inductor's CUDA kernels inside ZeRO-3 Blocks: equal to eager Blocks (1e-4:
    inductor fuses the norms and activations into kernels of its own), no recompile
    after the first step, no graph break in the GPT layer, plain state_dict names."""
    pytest.importorskip("triton", reason="inductor's CUDA backend needs triton")
    from torch._inductor.async_compile import shutdown_compile_workers

    try:
        out, plain_keys = compiled_vs_eager(nccl_world.device)
    finally:  # inductor's pool of compile processes would outlive the module
        shutdown_compile_workers()
    check_compiled_vs_eager(out, plain_keys, 1e-4)


def bf16_vs_masters_reference(dev, steps=6):
    """A bf16 GPT in ZeRO-3 Blocks (fp32 reduction, AdamOptimizer's fp32 masters: the
    fused kernel on CUDA) and a plain bf16 copy stepped by torch AdamW on fp32 masters.
    Returns per step (loss, reference loss) and the masters' |error| / |distance moved|
    and largest elementwise error."""
    from nbtrain.models import GPT
    from nbtrain.optim import AdamOptimizer

    cfg, hyper = _tiny_gpt_cfg(), {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
    xs, ys = _cuda_batches(dev, steps)
    torch.manual_seed(0)
    ref = GPT(cfg).to(dev, torch.bfloat16)
    params = dict(ref.named_parameters())
    start = {n: p.detach().float() for n, p in params.items()}
    masters = {n: v.clone() for n, v in start.items()}
    ref_opt = torch.optim.AdamW(masters.values(), foreach=False, **hyper)
    torch.manual_seed(0)
    model = nbt.wrap(GPT(cfg).to(dev, torch.bfloat16), zero_level=3, reduce_dtype=torch.float32)
    opt = AdamOptimizer(model.parameters(), **hyper)
    rows = []
    for s in range(steps):
        ref.zero_grad()
        ref_loss = ref.loss(xs[s], ys[s])
        ref_loss.backward()
        with torch.no_grad():
            for n, p in params.items():
                masters[n].grad = p.grad.float()
            ref_opt.step()
            for n, p in params.items():
                p.copy_(masters[n])
        opt.zero_grad()
        loss = model.loss(xs[s], ys[s])
        loss.backward()
        fp32 = all(g.shard.main_grad.dtype == torch.float32 for b in model.layers for g in b.groups)
        opt.step()
        # World 1: each shard is the whole flat buffer (padding at its end).
        ours = {}
        for prefix, module in model.named_modules():
            if isinstance(module, nbt.Block):
                for group in module.groups:
                    master = opt.state[group.shard]["master"]
                    for view, entry in zip(group.param_views(master), group.entries):
                        ours[f"{prefix}.{entry.names[0]}"] = view
        for name, p in model.named_parameters():
            if isinstance(p, nbt.DistributedParameter):
                ours[name] = opt.state[p]["master"][: p.full_shape.numel()].view(p.full_shape)
        assert sorted(ours) == sorted(masters)
        diff = torch.cat([(ours[n] - m).flatten() for n, m in masters.items()])
        moved = torch.cat([(m - start[n]).flatten() for n, m in masters.items()])
        rows.append(
            {
                "loss": loss.float().item(),
                "ref_loss": ref_loss.float().item(),
                "rel": float(diff.norm() / moved.norm()),
                "max": float(diff.abs().max()),
                "fp32_reduced": fp32,
            }
        )
    return rows


def test_bf16_with_fp32_masters_matches_torch_on_gpu(nccl_world):
    """bf16 Blocks, fp32 gradient reduction and fp32 masters (the fused Adam kernel)
    against torch AdamW on fp32 masters of a plain bf16 copy. At world 1 the two differ
    only by the kernels' fp32 rounding, which can move a bf16 weight by one ulp; the
    tolerances are test_bf16.py's, at every step: losses within one bf16 ulp, masters
    within 8 bf16 unit roundoffs of the distance moved and within 2 lr elementwise
    (its "not doubling" check has no meaning here: the first step's error is ~0)."""
    import math

    pytest.importorskip("triton", reason="AdamOptimizer's CUDA kernel needs triton")
    rows = bf16_vs_masters_reference(nccl_world.device)
    u = 2.0**-8
    for s, r in enumerate(rows):
        ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(r["ref_loss"]))
        assert abs(r["loss"] - r["ref_loss"]) <= ulp, (s, r)
        assert r["fp32_reduced"] and r["max"] <= 2 * 1e-3, (s, r)
    rel = [r["rel"] for r in rows]
    assert max(rel) <= 8 * u, rel


def test_distributed_parameters_take_the_foreach_optimizer_path(nccl_world):
    """A DistributedParameter in a param group keeps torch's optimizers on their
    multi-tensor kernels (they admit exact Tensor/Parameter types only)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    dp = nbt.DistributedParameter(torch.randn(8, 4))
    plain = torch.nn.Parameter(torch.randn(3, device=nccl_world.device))
    assert dp.device.type == "cuda"
    assert _default_to_fused_or_foreach([dp, plain], differentiable=False) == (False, True)
