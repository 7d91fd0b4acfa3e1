"""Deferred initialisation draws only the requested range, the same for any split."""

import math

import pytest
import torch
from torch import nn

import nbtrain as nbt
from nbtrain.zero.init import CHUNK_NUMEL, init_range

SEED = 3
pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/unit/conftest.py


INITS = [
    nbt.ParameterInitializer(nn.init.kaiming_uniform_, a=math.sqrt(5)),
    nbt.ParameterInitializer(nn.init.xavier_normal_, gain=2.0),
    nbt.ParameterInitializer(nn.init.normal_, std=0.02),
    nn.init.zeros_,
    nbt.ParameterInitializer(nn.init.orthogonal_),  # not element-wise: full-tensor path
]


@pytest.mark.parametrize("init", INITS, ids=lambda i: getattr(i, "func", i).__name__)
def test_any_split_reassembles_the_same_tensor(init):
    shape = (300, 457)  # 137100 elements: three chunks, the last one partial
    whole = init_range("w", shape, torch.float32, torch.device("cpu"), init, 0, 137100)
    for world in (2, 3, 7):
        n = math.ceil(137100 / world)
        parts = [
            init_range(
                "w",
                shape,
                torch.float32,
                torch.device("cpu"),
                init,
                r * n,
                min((r + 1) * n, 137100),
            )
            for r in range(world)
        ]
        torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)


def test_scale_follows_the_full_shape():
    shape = (300, 500)
    values = init_range(
        "w",
        shape,
        torch.float32,
        torch.device("cpu"),
        nbt.ParameterInitializer(nn.init.kaiming_uniform_, a=math.sqrt(5)),
        0,
        150000,
    )
    bound = 1 / math.sqrt(500)  # gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
    assert values.abs().max() <= bound and values.abs().max() > 0.99 * bound
    assert values.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    xavier = init_range(
        "x",
        shape,
        torch.float32,
        torch.device("cpu"),
        nbt.ParameterInitializer(nn.init.xavier_normal_),
        0,
        150000,
    )
    assert xavier.std().item() == pytest.approx(math.sqrt(2 / 800), rel=0.02)


def test_a_shard_of_a_huge_parameter_is_drawn_without_the_rest():
    # 10**11 elements (400 GB in fp32) could never be materialised here: only the
    # chunks that overlap the requested range are drawn.
    shape = (1_000_000, 100_000)
    start = 7 * CHUNK_NUMEL - 5
    values = init_range(
        "huge",
        shape,
        torch.float32,
        torch.device("cpu"),
        nbt.ParameterInitializer(nn.init.kaiming_uniform_, a=math.sqrt(5)),
        start,
        start + 1000,
    )
    assert values.shape == (1000,) and 0 < values.abs().max() <= 1 / math.sqrt(100_000)
