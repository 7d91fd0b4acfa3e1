"""nbtrain.inspect's local views, in a world of one: parameter bytes (full, resident,
gathered now), the most blocks gathered at once, and the last step's record. The
tutorials use these instead of the engine's and the recorder's internals; the
world-size test (tests/multirank/test_tutorials_world_sizes.py) checks the resident
share at 2 and 3 ranks through tutorial 02."""

import pytest
import torch
from torch import nn

import nbtrain as nbt
from nbtrain import telemetry
from nbtrain.inspect import last_step, parameter_bytes, track_gathered
from nbtrain.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, hidden=16, heads=2, layers=4, seq_len=8)


@pytest.fixture(autouse=True)
def _ctx(world_of_one):
    return world_of_one


def _plain_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # ties once


def _layer_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in GPT(CFG).layers[0].parameters())


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, x.roll(1, dims=1)


def test_a_plain_model_is_all_resident():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2, bias=False))
    want = (3 * 5 + 5 + 5 * 2) * 4
    assert parameter_bytes(model) == {"full": want, "resident": want, "gathered": 0}


@pytest.mark.parametrize("level", [2, 3])
def test_a_world_of_one_gathers_nothing(level):
    """One rank's shard is the whole buffer: a block computes on it in place, so nothing
    is ever gathered (tests/multirank/test_inspect_gathered.py counts gathers at 2)."""
    torch.manual_seed(0)
    full = _plain_bytes(GPT(CFG))
    model = nbt.wrap(GPT(CFG), zero_level=level)
    assert parameter_bytes(model) == {"full": full, "resident": full, "gathered": 0}
    seen = []
    model.layers[1].mlp.register_forward_hook(
        lambda *_: seen.append(parameter_bytes(model)["gathered"])
    )
    with track_gathered(model) as gathered:
        model.loss(*_batch()).backward()
    assert seen == [0]
    assert (gathered.peak_blocks, gathered.peak_bytes, gathered.gathers) == (0, 0, 0)


def test_track_gathered_sees_nothing_outside_its_block():
    model = nbt.wrap(GPT(CFG), zero_level=3)
    with track_gathered(model) as gathered:
        pass
    model.loss(*_batch()).backward()
    assert (gathered.peak_blocks, gathered.peak_bytes, gathered.gathers) == (0, 0, 0)


def test_track_gathered_refuses_when_events_are_off():
    telemetry.set_enabled(False)
    try:
        with pytest.raises(RuntimeError, match="events are switched off"):
            with track_gathered():
                pass
    finally:
        telemetry.set_enabled(True)


def test_last_step_is_the_step_just_finished():
    torch.manual_seed(0)
    model = nbt.wrap(GPT(CFG), zero_level=3)
    opt = nbt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    manager = nbt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(opt)
    for _ in range(2):
        manager.zero_grad()
        manager.backward(model.loss(*_batch()))
        before = telemetry.RECORDER.step  # the step this one closes
        manager.step()
    record = last_step()
    assert record["step"] == before
    assert record["duration_s"] > 0 and record["compute_s"] > 0
    labels = {label for _, _, label, _ in record["compute"]}
    assert {f"layers.{i}" for i in range(CFG.layers)} <= labels
    assert {phase for *_, phase in record["compute"]} >= {"forward", "backward"}
    record["compute"].clear()  # a copy: the recorder's record is untouched
    assert last_step()["compute"]
