"""nbtrain.moe in one process: routing, capacity, the layer against the plain loop,
and the errors its arguments raise."""

import pytest
import torch

from nbtrain.moe import MoE, capacity_keep, moe_reference, route


def test_combine_weights_are_the_selected_scores_renormalised():
    scores = torch.softmax(torch.randn(7, 5, generator=torch.Generator().manual_seed(0)), -1)
    chosen, weights = route(scores, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(7))
    top = scores.topk(2, -1)
    assert torch.equal(chosen, top.indices)
    assert torch.allclose(weights, top.values / top.values.sum(-1, keepdim=True))


def test_the_bias_steers_selection_not_the_weights():
    scores = torch.tensor([[0.5, 0.3, 0.2]])
    chosen, weights = route(scores, 1, bias=torch.tensor([0.0, 0.0, 1.0]))
    assert chosen.tolist() == [[2]] and weights.tolist() == [[1.0]]
    chosen, weights = route(scores, 2, bias=torch.tensor([0.0, 0.0, 1.0]))
    assert chosen.tolist() == [[2, 0]]
    assert torch.allclose(weights, torch.tensor([[0.2 / 0.7, 0.5 / 0.7]]))


def test_capacity_keeps_the_first_arrivals_in_token_order():
    chosen = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
    keep = capacity_keep(chosen, 3, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, False]]


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_layer_alone_equals_the_plain_loop(top_k):
    torch.manual_seed(3)
    moe = MoE(6, 10, 4, top_k=top_k)
    x = torch.randn(3, 5, 6, requires_grad=True)
    out = moe(x)
    want = moe_reference(x, moe.router.weight, moe.w_in, moe.w_out, top_k)
    assert (out - want).abs().max() < 1e-6
    out.square().sum().backward()
    assert moe.w_in.grad is not None and moe.router.weight.grad is not None
    assert sum(moe.stats["tokens_per_expert"]) == 15 * top_k


def test_an_expert_without_tokens_gets_a_zero_gradient():
    torch.manual_seed(4)
    moe = MoE(4, 8, 3, top_k=1)
    x = torch.randn(2, 6, 4)
    x[..., 0] = x[..., 0].abs() + 1
    with torch.no_grad():
        moe.router.weight[2] = torch.tensor([-20.0, 0, 0, 0])
    moe(x).sum().backward()
    assert moe.stats["tokens_per_expert"][2] == 0
    assert float(moe.w_in.grad[2].abs().max()) == 0.0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"top_k": 5}, "top_k=5"),
        ({"balance": "loss"}, "balance='loss'"),
        ({"capacity_factor": 0}, "capacity_factor=0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        MoE(4, 8, 4, **kwargs)
