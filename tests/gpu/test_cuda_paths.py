"""CUDA paths: NCCL at world size 1, collectives off the compute stream, parity on GPU.

Run on a GPU machine with:  python3 -m pytest -m gpu tests/gpu tests/kernels
"""
import pytest
import torch

import nbtrain as nbt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


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
    model = nbt.wrap(GPT(GPTConfig(vocab_size=256, hidden=32, heads=2, layers=2,
                                   seq_len=16)).to(dev))
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
            self.load_state_dict({k.replace("0.", "embed.").replace("2.", "head."): v
                                  for k, v in plain.state_dict().items() if k[0] in "02"})
            self.to(dev)
            self.body = nbt.Block(nn.Linear(16, 16).to(dev).requires_grad_(True))
            self.body.load_state_dict({k[2:]: v for k, v in plain.state_dict().items()
                                       if k[0] == "1"})

        def forward(self, x):
            return self.head(self.body(self.embed(x)))

    model = Model(ref)
    x = torch.randint(0, 50, (4, 8), device=dev)
    for m in (ref, model):
        m(x).square().mean().backward()
    torch.testing.assert_close(model.head.weight.grad, ref[2].weight.grad)
    torch.testing.assert_close(model.embed.weight.grad, ref[0].weight.grad)
