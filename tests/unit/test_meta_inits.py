"""nbtrain.assign_inits and the initialiser rules, on one process."""

import math

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.zero import normal_inits, torch_default_inits


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(3))  # no rule knows it


def test_a_meta_parameter_without_an_initialiser_is_named():
    with nbtrain.empty_parameters():
        model = Odd()
    with pytest.raises(ValueError, match=r"no initialiser for 1 parameter.*scale \(Odd\)"):
        nbtrain.assign_inits(model)


def test_empty_parameters_keeps_buffers_and_restores_itself():
    with nbtrain.empty_parameters():
        norm = nn.BatchNorm1d(4)
    assert norm.weight.is_meta and not norm.running_mean.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # outside the block: as before


SEED = 1  # world_of_one's seed


def test_torch_default_rule_draws_like_torch(world_of_one):
    with nbtrain.empty_parameters():
        model = nn.Sequential(nn.Linear(400, 300), nn.LayerNorm(300), nn.Embedding(50, 300))
    assert nbtrain.assign_inits(model, torch_default_inits) == 5
    model = nbtrain.wrap(model)
    nbtrain.init_parameters(model)
    state = model.state_dict()
    bound = 1 / math.sqrt(400)
    w, b = state["0.weight"], state["0.bias"]
    assert w.abs().max() <= bound + 1e-7 and w.abs().max() > 0.9 * bound  # kaiming(a=sqrt 5)
    assert b.abs().max() <= bound and b.std() > 0.4 * bound
    assert torch.equal(state["1.weight"], torch.ones(300))
    assert abs(float(state["2.weight"].std()) - 1.0) < 0.02


def test_normal_rule_scales_the_named_weights():
    rule = normal_inits(0.02, scaled={"proj.weight": 0.005})
    proj, fc = nn.Linear(4, 4), nn.Linear(4, 4)
    assert rule("layers.0.proj.weight", proj, proj.weight).kwargs["std"] == 0.005
    assert rule("layers.0.fc.weight", fc, fc.weight).kwargs["std"] == 0.02
    assert rule("layers.0.fc.bias", fc, fc.bias).func is nn.init.zeros_
