"""Batches from nbtrain's data helpers: each rank's rows, on the rank's device, at any
world size that divides the global batch; a clear error otherwise."""

import pytest
import torch
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain.models import GPT, GPTConfig
from nbtrain.models.data import BatchSampler

TOKENS = torch.arange(5000) % 256


def _local(global_batch: int):
    sampler = BatchSampler(TOKENS, seq_len=8, global_batch=global_batch, seed=3)
    x, y = sampler.local_batch(4)
    return x, y, x.device == nbt.get_context().device


@pytest.mark.parametrize("world", [1, 2, 3])
def test_local_batches_are_the_ranks_rows_on_its_device(world):
    x_all, y_all = BatchSampler(TOKENS, seq_len=8, global_batch=6, seed=3).batch(4)
    parts = run_ranks(_local, world, 6)
    assert all(on_device for _, _, on_device in parts)
    assert torch.equal(torch.cat([x for x, _, _ in parts]), x_all)
    assert torch.equal(torch.cat([y for _, y, _ in parts]), y_all)


def test_a_batch_that_does_not_split_names_the_sizes():
    with pytest.raises(
        AssertionError,
        match="global_batch=16 does not split over 3 ranks: use a multiple of 3, e.g. 18",
    ):
        run_ranks(_local, 3, 16)


def test_the_model_says_what_is_wrong_with_its_input():
    model = GPT(GPTConfig(vocab_size=11, hidden=8, heads=2, layers=1, seq_len=4))
    with pytest.raises(TypeError, match="token ids of shape \\(batch, seq\\).*float32"):
        model(torch.zeros(2, 4))
