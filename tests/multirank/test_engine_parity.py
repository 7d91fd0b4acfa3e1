"""Sharded training equals plain single-process PyTorch (fp32, 1e-5)."""

import itertools
import math

import pytest
import torch
from support import cases
from support.ranks import run_ranks

import nbtrain as nbt

STEPS = 10
CONFIGS = list(itertools.product(["blocks", "blocklist", "wrap"], [2, 3], [False, True]))


def _train_all_configs():
    results = {}
    for mode, level, ckpt in CONFIGS:
        model = cases.sharded_model(mode, level, ckpt)
        out = cases.train_sharded(model, STEPS)
        results[(mode, level, ckpt)] = out if nbt.rank() == 0 else None
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_training_matches_plain_pytorch(world_size):
    ref_losses, ref_grads, ref_state = cases.train_plain(world_size, STEPS)
    results = run_ranks(_train_all_configs, world_size, timeout_s=240)[0]
    for config, (losses, grads, state) in results.items():
        assert losses == pytest.approx(ref_losses, abs=1e-5), config
        assert set(grads) == set(ref_grads), config
        for name, g in ref_grads.items():
            torch.testing.assert_close(
                grads[name],
                g,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, name=name, config=config: f"{config} grad {name}: {m}",
            )
        assert list(state) == list(ref_state), config
        for name, v in ref_state.items():
            assert state[name].shape == v.shape, (config, name)
            torch.testing.assert_close(
                state[name],
                v,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, name=name, config=config: f"{config} param {name}: {m}",
            )


def _shard_sizes():
    model = cases.sharded_model("wrap", 3, False)
    world = nbt.world_size()
    sizes = []
    for block in model.layers:
        for group in block.groups:
            sizes.append((group.layout.numel, group.shard.numel(), group.layout.padded_numel))
    loose = [
        (p.full_numel, p.numel())
        for p in model.parameters()
        if isinstance(p, nbt.DistributedParameter)
    ]
    return world, sizes, loose


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_sizes_are_padded(world_size):
    for world, sizes, loose in run_ranks(_shard_sizes, world_size):
        assert sizes and loose
        for numel, shard, padded in sizes:
            assert shard == math.ceil(numel / world)
            assert padded == shard * world and padded >= numel
        for full, shard in loose:
            assert shard == math.ceil(full / world)
