"""Parameter offload (`wrap(model, offload=True)`: Blocks keep their shards, gradients
and optimizer state in host memory, copied to the device for each gather) trains
exactly as without it, at world 1 and 2, with AdamW (AdamOffloadOptimizer against
AdamOptimizer) and SGD with momentum: losses and final weights within 1e-5.

On this CPU-only machine host and device coincide, so the same code path runs
(the copies to the device are host copies) and its memory effect does not show;
on a GPU the device then holds only the blocks in flight.
"""

import pytest
import torch
from offload_cases import train
from support.ranks import run_ranks

STEPS = 5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_offload_trains_exactly_as_without(world, optimizer):
    plain = run_ranks(train, world, False, optimizer, STEPS, timeout_s=300)
    offloaded = run_ranks(train, world, True, optimizer, STEPS, timeout_s=300)
    for (losses_a, state_a, where_a), (losses_b, state_b, where_b) in zip(plain, offloaded):
        assert len(set(losses_a)) == STEPS  # it trains
        assert losses_b == pytest.approx(losses_a, abs=1e-5)
        for key in state_a:
            assert torch.allclose(state_a[key], state_b[key], atol=1e-5), key
        assert where_b["blocks"] == 2 and where_b["offloaded"] and not where_a["offloaded"]
        assert where_b["shards"] == ["cpu"] and where_b["grads"] == ["cpu"]
