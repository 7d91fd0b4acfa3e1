"""nbtrain.save writes BMTrain's torch.save format for any path but `.safetensors`;
nbtrain.load reads both formats whatever the file is called (the bytes tell)."""

import os
import shutil

import pytest
import safetensors.torch
import torch
from torch import nn

import nbtrain as nbt

pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/unit/conftest.py


def _model(seed):
    torch.manual_seed(seed)
    return nbt.wrap(nn.Sequential(nn.Linear(5, 3), nn.ModuleList([nn.Linear(3, 3)])))


@pytest.mark.parametrize("name", ["x.ckp", "x.pt", "x.bin", "x"])
def test_any_other_name_is_torch_save_format(tmp_path, name):
    model = _model(0)
    path = str(tmp_path / name)
    nbt.save(model, path)
    loaded = torch.load(path, weights_only=True)
    plain = {k: v.detach() for k, v in _plain(0).state_dict().items()}
    assert loaded.keys() == plain.keys()
    for key in plain:
        assert torch.equal(loaded[key], plain[key]), key
    with open(path, "rb") as f:
        assert f.read(4) == b"PK\x03\x04"  # torch.save's zip format


def test_a_safetensors_name_is_safetensors(tmp_path):
    path = str(tmp_path / "x.safetensors")
    nbt.save(_model(0), path)
    assert set(safetensors.torch.load_file(path)) == set(_plain(0).state_dict())


@pytest.mark.parametrize(
    "written, renamed",
    [("a.safetensors", "a.pt"), ("a.pt", "a.safetensors"), ("a.safetensors", "a.ckp")],
)
def test_load_reads_either_format_whatever_the_name(tmp_path, written, renamed):
    nbt.save(_model(0), str(tmp_path / written))
    shutil.move(str(tmp_path / written), str(tmp_path / renamed))
    other = _model(1)
    nbt.load(other, str(tmp_path / renamed))
    for (k, a), b in zip(other.state_dict().items(), _plain(0).state_dict().values()):
        assert torch.equal(a, b), k
    assert not os.path.exists(str(tmp_path / written))


def _plain(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 3), nn.ModuleList([nn.Linear(3, 3)]))
