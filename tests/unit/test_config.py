"""`nbtrain.config`: BMTrain's `config[...]` keys, read from the context, read-only."""

import pytest

import nbtrain as nbt

SEED = 5
pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/unit/conftest.py


def test_bmtrain_keys_match_the_context():
    ctx = nbt.get_context()
    assert nbt.config["rank"] == ctx.rank == 0
    assert nbt.config["world_size"] == ctx.world_size == 1
    assert nbt.config["local_rank"] == 0 and nbt.config["zero_rank"] == 0
    assert nbt.config["tp_size"] == 1 and nbt.config["pipe_size"] == 1
    assert nbt.config["tp_zero_size"] == 1 and nbt.config["tp_zero_rank"] == 0
    assert nbt.config["topology"] is ctx.topology and nbt.config["seed"] == 5
    assert dict(nbt.config)["device"] == ctx.device


def test_unknown_key_and_assignment_are_clear_errors():
    with pytest.raises(KeyError, match="no key 'tp_rnak'.*tp_rank"):
        nbt.config["tp_rnak"]
    with pytest.raises(TypeError, match="read-only.*init_distributed"):
        nbt.config["rank"] = 3


def test_bmtrains_extra_keys_name_the_groups():
    assert nbt.config["initialized"] is True
    topo = nbt.get_context().topology
    assert nbt.config["comm"] is None  # every rank
    assert nbt.config["tp_comm"] is topo.group("tp") and nbt.config["zero_comm"] is topo.group(
        "zero"
    )


def test_print_rank_takes_prints_keywords(capsys):
    nbt.print_rank("a", "b", sep="-", flush=True)
    nbt.print_rank("not here", rank=1)
    assert capsys.readouterr().out == "a-b\n"


def test_bmtrains_stream_keys_are_the_current_stream():
    # a BMTrain training loop waits on config["load_stream"] before clipping: nbtrain
    # gathers on the current stream, so both keys are that stream of the context's device
    import torch

    ctx = nbt.get_context()
    current = torch.get_device_module(ctx.device).current_stream()
    for key in ("calc_stream", "load_stream"):
        stream = nbt.config[key]
        assert type(stream) is type(current) and stream == current, key
    current.wait_stream(nbt.config["load_stream"])  # what the BMTrain script calls
