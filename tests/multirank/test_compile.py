"""torch.compile of Blocks' modules (`wrap(model, compile=...)`) equals eager Blocks.

On each rank one tiny GPT trains eagerly and compiled, with SGD momentum and with
AdamW: losses, every step's gradients and the parameters afterwards agree to 1e-5.
After the first step nothing compiles again (dynamo's error_on_recompile is set for
the later steps and the count of captured graphs does not move), although each
forward installs new view tensors. state_dict names are the plain model's.

The two-rank cases compile with backend="aot_eager": dynamo's capture and AOTAutograd's
joint forward/backward graph, which is where the composition with the block's views,
gathers, checkpointing and release is decided; inductor (it does run on this machine,
g++ is here) only changes the kernels, and costs ~30-60 s per compile on two loaded
cores, so it runs once, at one rank (marked slow), and on CUDA in tests/gpu.
"""

import warnings

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

import nbtrain as nbt
from nbtrain.models import GPT, GPTConfig

# The smallest GPT that still has every layer kind; hidden 18 pads at 2 ranks.
CFG = GPTConfig(vocab_size=61, hidden=18, heads=3, layers=2, seq_len=8)
STEPS = 3
BATCH_PER_RANK = 2


def _batches(world):
    g = torch.Generator().manual_seed(7)
    shape = (STEPS, world * BATCH_PER_RANK, CFG.seq_len)
    return (
        torch.randint(0, CFG.vocab_size, shape, generator=g),
        torch.randint(0, CFG.vocab_size, shape, generator=g),
    )


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def _train(zero_level, ckpt, opt_name, setting):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nbt.wrap(GPT(CFG), zero_level=zero_level, use_checkpoint=ckpt, compile=setting)
    opt = _optimizer(opt_name, model.parameters())
    xs, ys = _batches(nbt.world_size())
    lo, hi = nbt.rank() * BATCH_PER_RANK, (nbt.rank() + 1) * BATCH_PER_RANK
    losses, grads, graphs = [], [], []
    for s in range(STEPS):
        # A recompilation from step 2 on raises (the views are new tensors each step).
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            opt.zero_grad()
            loss = model.loss(xs[s, lo:hi], ys[s, lo:hi])
            loss.backward()
        grads.append(nbt.zero.full_named_grads(model))
        opt.step()
        losses.append(nbt.sum_loss(loss).item())
        graphs.append(counters["stats"]["unique_graphs"])
    stats = [b.compile_stats for b in model.layers]
    return {
        "losses": losses,
        "grads": grads,
        "state": model.state_dict(),
        "graphs": graphs,
        "stats": stats,
    }


def _compare(zero_level, ckpt, backend):
    out = {}
    for opt_name in ("sgd", "adamw"):
        out[opt_name] = {
            "eager": _train(zero_level, ckpt, opt_name, False),
            "compiled": _train(zero_level, ckpt, opt_name, {"backend": backend}),
        }
    return out if nbt.rank() == 0 else None


def _check(results):
    torch.manual_seed(0)
    plain_keys = list(GPT(CFG).state_dict())
    for opt_name, runs in results.items():
        eager, compiled = runs["eager"], runs["compiled"]
        what = f"{opt_name}, compiled vs eager"
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5), what
        for step, (g, ref) in enumerate(zip(compiled["grads"], eager["grads"])):
            assert set(g) == set(ref), what
            for name, v in ref.items():
                torch.testing.assert_close(
                    g[name],
                    v,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, w=what, s=step, n=name: f"{w} step {s} grad {n}: {m}",
                )
        assert list(compiled["state"]) == plain_keys, what  # no `_orig_mod.` anywhere
        for name, v in eager["state"].items():
            torch.testing.assert_close(
                compiled["state"][name],
                v,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, w=what, n=name: f"{w} param {n}: {m}",
            )
        graphs = compiled["graphs"]
        assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * (STEPS - 1), (what, graphs)
        first, *others = compiled["stats"]
        assert first.graphs >= 1 and first.graph_breaks == 0, (what, first)
        assert all(s.reused and s.graph_breaks == 0 for s in others), (what, others)


@pytest.mark.parametrize(
    "world_size,zero_level,ckpt",
    [(2, 2, False), (2, 3, True)],
    ids=["world2-zero2", "world2-zero3-ckpt"],
)
def test_compiled_blocks_match_eager(world_size, zero_level, ckpt):
    _check(run_ranks(_compare, world_size, zero_level, ckpt, "aot_eager", timeout_s=240)[0])


@pytest.mark.slow
def test_compiled_blocks_match_eager_inductor():
    """Inductor's CPU kernels (C++ through g++) in Blocks: world 1, ZeRO-3."""
    _check(run_ranks(_compare, 1, 3, False, "inductor", timeout_s=290)[0])


class _Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).relu()


def _reports():
    """Graph breaks reported once, by block; the errors for unusable settings."""
    torch.manual_seed(0)
    blocks = nbt.TransformerBlockList(
        [_Breaks() for _ in range(2)], compile={"backend": "aot_eager"}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            blocks(torch.randn(3, 4, requires_grad=True)).sum().backward()
    messages = [str(w.message) for w in caught if "graph break" in str(w.message)]
    errors = {}
    try:
        nbt.Block(nn.Linear(2, 2), compile="yes")
    except TypeError as err:
        errors["type"] = str(err)
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import cpp_compiler_search

    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        cpp_compiler_search.cache_clear()
        try:
            nbt.Block(nn.Linear(2, 2), compile=True)
        except RuntimeError as err:
            errors["cxx"] = str(err)
    cpp_compiler_search.cache_clear()
    return {
        "stats": [b.compile_stats for b in blocks],
        "messages": messages,
        "errors": errors,
        "repr": repr(blocks[0]),
        "keys": list(blocks.state_dict()),
    }


def test_graph_breaks_reported_and_errors():
    res = run_ranks(_reports, 1, timeout_s=120)[0]
    first, second = res["stats"]
    assert (first.graphs, first.graph_breaks, first.reused) == (2, 1, False), first
    assert "graph_break()" in first.reasons[0], first
    assert (second.graph_breaks, second.reused) == (1, True), second
    assert len(res["messages"]) == 1, res["messages"]  # once, not per block or per step
    assert "'block0'" in res["messages"][0] and "1 graph break" in res["messages"][0]
    assert "compiled" in res["repr"]
    assert res["keys"] == [
        "0.a.weight",
        "0.a.bias",
        "0.b.weight",
        "0.b.bias",
        "1.a.weight",
        "1.a.bias",
        "1.b.weight",
        "1.b.bias",
    ]
    assert "dict of torch.compile keywords" in res["errors"]["type"]
    assert "C++ compiler" in res["errors"]["cxx"] and "aot_eager" in res["errors"]["cxx"]
