"""nbtrain.inspect's gather accounting on 2 ranks: parameter bytes gathered inside a
block's forward, and track_gathered's most blocks at once, bytes and gather count, at
ZeRO-2 and ZeRO-3 (a world of one gathers nothing: tests/unit/test_inspect_api.py)."""

import pytest
import torch
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain.inspect import parameter_bytes, track_gathered
from nbtrain.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, hidden=16, heads=2, layers=4, seq_len=8)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, x.roll(1, dims=1)


def _accounting(level):
    torch.manual_seed(0)
    model = nbt.wrap(GPT(CFG), zero_level=level)
    layer = sum(g.layout.padded_numel * g.shard.element_size() for g in model.layers[0].groups)
    at_rest = parameter_bytes(model)["gathered"]
    seen = []
    model.layers[1].mlp.register_forward_hook(
        lambda *_: seen.append(parameter_bytes(model)["gathered"])
    )
    model.loss(*_batch()).backward()
    after = parameter_bytes(model)["gathered"]
    with track_gathered(model) as gathered:
        model.loss(*_batch()).backward()
    with track_gathered() as anonymous:  # without the model: blocks, no bytes
        model.loss(*_batch()).backward()
    return (
        layer,
        at_rest,
        seen[0],
        after,
        gathered.peak_blocks,
        gathered.peak_bytes,
        gathered.gathers,
        anonymous.peak_blocks,
        anonymous.peak_bytes,
    )


@pytest.mark.parametrize("level", [2, 3])
def test_gathered_bytes_and_blocks_at_two_ranks(level):
    (layer, at_rest, inside, after, peak_blocks, peak_bytes, gathers, anon_blocks, anon_bytes) = (
        run_ranks(_accounting, 2, level, timeout_s=120)[0]
    )
    assert at_rest == 0 and after == 0  # all released after backward
    # Inside layer 1's forward: layer 1 and the prefetched layer 2 at ZeRO-3; at ZeRO-2
    # layers 0 and 1 stay gathered for backward, and layer 2 is prefetched.
    assert inside == (2 if level == 3 else 3) * layer
    blocks = 2 if level == 3 else CFG.layers
    assert peak_blocks == blocks and peak_bytes == blocks * layer
    # forward gathers every layer once; ZeRO-3 gathers each again for backward but
    # the last, which stays gathered from its forward into its backward
    assert gathers == (2 * CFG.layers - 1 if level == 3 else CFG.layers)
    assert anon_blocks == blocks and anon_bytes == 0
