"""A rank's experts at once (`experts_ffn`: grouped matmuls where torch has them) equal
the loop over experts, forward and backward, with empty experts and an expanded
gradient (a sum's) among the cases."""

import pytest
import torch

from nbtrain.moe import expert_ffn, experts_ffn, uses_grouped_mm


def _loop(rows, w_in, w_out, counts):
    parts = rows.split(counts)
    return torch.cat([expert_ffn(r, w_in[e], w_out[e]) for e, r in enumerate(parts)])


@pytest.mark.parametrize("counts", [[5, 0, 3, 7], [0, 0, 4, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
@pytest.mark.parametrize("reduce", ["sum", "weighted"])
def test_grouped_experts_equal_the_loop(counts, reduce):
    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    hidden, ffn = 12, 20
    leaves = [
        torch.randn(shape, generator=g, requires_grad=True)
        for shape in ((sum(counts), hidden), (4, hidden, ffn), (4, ffn, hidden))
    ]
    got = experts_ffn(*leaves, counts)
    want = _loop(*leaves, counts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if reduce == "sum":
        got_loss, want_loss = got.sum(), want.sum()
    else:
        weight = torch.randn(want.shape, generator=g)
        got_loss, want_loss = (got * weight).sum(), (want * weight).sum()
    for a, b in zip(
        torch.autograd.grad(got_loss, leaves, allow_unused=True),
        torch.autograd.grad(want_loss, leaves, allow_unused=True),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_grouped_kernel_is_used_on_cpu_where_torch_has_it():
    has = hasattr(torch.nn.functional, "grouped_mm")
    assert uses_grouped_mm("cpu", torch.float32, 256, 512) == has
