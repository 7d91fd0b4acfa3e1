"""Bad input gets an error naming the value and the fix (world of one, in process)."""

import pytest
import torch
from torch import nn

import nbtrain as nbt


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    if nbt.comm.is_initialized():
        yield
        return
    nbt.init_distributed()
    yield
    nbt.comm.shutdown()


@pytest.mark.parametrize("level", [0, 1, 4, "three"])
def test_zero_level_must_be_2_or_3(level):
    with pytest.raises(ValueError, match=rf"zero_level={level!r}.*use 2 .* or 3"):
        nbt.Block(nn.Linear(3, 3), zero_level=level)
    with pytest.raises(ValueError, match="zero_level"):
        nbt.wrap(nn.Sequential(nn.Linear(2, 2)), zero_level=level)


def test_bmtrains_positional_order_is_understood():
    block = nbt.Block(nn.Linear(3, 3), True, 2)  # BMTrain: (module, use_checkpoint, zero_level)
    assert block.use_checkpoint is True and int(block.zero_level) == 2
    block = nbt.Block(nn.Linear(3, 3), False, initialized=True)
    assert block.use_checkpoint is False and int(block.zero_level) == 3
    block = nbt.Block(nn.Linear(3, 3), 2, True)  # nbtrain: (module, zero_level, use_checkpoint)
    assert block.use_checkpoint is True and int(block.zero_level) == 2


def test_block_mode_is_bmtrains():
    with pytest.raises(ValueError, match=r"Block\(mode='pipe'\): use \"BLOCK\""):
        nbt.Block(nn.Linear(3, 3), mode="pipe")


def _sharded_linear():
    model = nn.Sequential(nn.Linear(4, 3), nn.ModuleList([nn.Linear(3, 3)]))
    return nbt.wrap(model)


def test_load_state_dict_missing_key():
    model = _sharded_linear()
    state = model.state_dict()
    del state["1.0.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"1\.0\.weight"'):
        model.load_state_dict(state)


@pytest.mark.parametrize("key", ["0.weight", "1.0.weight"])
def test_load_state_dict_wrong_shape_names_key_and_shapes(key):
    model = _sharded_linear()
    state = model.state_dict()
    state[key] = torch.zeros(5, 5)
    expected = tuple(model.state_dict()[key].shape)
    with pytest.raises(ValueError, match=rf"'{key}'.*\(5, 5\).*{expected}"):
        model.load_state_dict(state)


def test_state_dict_round_trip_into_plain_model():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.ModuleList([nn.Linear(3, 3)]))
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    sharded = nbt.wrap(plain)
    assert {k: v.shape for k, v in sharded.state_dict().items()} == {
        k: v.shape for k, v in reference.items()
    }
    fresh = nn.Sequential(nn.Linear(4, 3), nn.ModuleList([nn.Linear(3, 3)]))
    fresh.load_state_dict(sharded.state_dict())
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, reference[k])


def test_plain_state_dict_loads_strictly_into_a_wrapped_model():
    from nbtrain.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=31, hidden=8, heads=2, layers=2, seq_len=4)
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(1)
    sharded = nbt.wrap(GPT(cfg))
    result = sharded.load_state_dict(plain.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[k], v)


def test_init_distributed_twice_returns_same_context():
    assert nbt.init_distributed() is nbt.init_distributed()
    assert nbt.world_size() == 1 and nbt.rank() == 0


def test_bad_backend_names_the_value():
    from nbtrain.comm.context import pick_backend

    with pytest.raises(ValueError, match="backend='mpi'"):
        pick_backend("mpi")
