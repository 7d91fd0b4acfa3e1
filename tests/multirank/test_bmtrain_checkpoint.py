"""BMTrain's checkpoints: `bmt.save` writes `torch.save(model.state_dict())` of the
full model; `nbtrain.load` reads such a file into a sharded model at any world size
(each rank keeping its rows), and `nbtrain.save(model, "x.pt")` writes one back.

The reference is a plain GPT on one process, trained a few SGD-with-momentum steps so
that no tensor is still at its initial value, saved the way BMTrain saves.
"""

import os

import pytest
import torch
from support import cases
from support.ranks import run_ranks

import nbtrain as nbt


def _trained_plain_state() -> dict:
    model = cases.plain_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, cases.CFG.vocab_size, (2, cases.CFG.seq_len), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def _load_and_save_back(folder):
    torch.manual_seed(100 + nbt.rank())  # a different start on every rank
    model = nbt.wrap(cases.plain_model())
    for p in model.parameters():
        torch.nn.init.normal_(p)
    result = nbt.load(model, os.path.join(folder, "bmtrain.pt"))
    out = os.path.join(folder, f"back-w{nbt.world_size()}.pt")
    nbt.save(model, out)
    state = model.state_dict()  # gathered, plain names
    return (list(result.missing_keys), list(result.unexpected_keys), state, out)


@pytest.fixture(scope="module")
def bmtrain_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bmt")
    state = _trained_plain_state()
    torch.save(state, folder / "bmtrain.pt")  # what bmt.save writes
    return str(folder), state


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_bmtrain_checkpoint_loads_into_a_sharded_model_and_saves_back(bmtrain_file, world):
    folder, want = bmtrain_file
    missing, unexpected, got, back = run_ranks(_load_and_save_back, world, folder, timeout_s=240)[0]
    assert missing == [] and unexpected == []
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    saved = torch.load(back, weights_only=True)  # what a BMTrain script's bmt.load reads
    plain = cases.plain_model()
    plain.load_state_dict(saved, strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert not [f for f in os.listdir(folder) if ".tmp-" in f]  # no temporary left


def _load_errors(folder):
    model = nbt.wrap(cases.plain_model())
    errors = {}
    for name in ("pickled.pt", "a_list.pt", "garbage.pt", "legacy.pt"):
        try:
            nbt.load(model, os.path.join(folder, name))
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    return errors, model.state_dict()


class NotATensor:
    pass


def test_what_is_not_a_state_dict_of_tensors_is_refused_naming_the_file(tmp_path):
    state = cases.plain_model().state_dict()
    torch.save({"model": state, "extra": NotATensor()}, tmp_path / "pickled.pt")
    torch.save([1, 2, 3], tmp_path / "a_list.pt")
    (tmp_path / "garbage.pt").write_bytes(b"\x80this is not a checkpoint")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    errors, loaded = run_ranks(_load_errors, 1, str(tmp_path), timeout_s=120)[0]
    assert "pickled.pt' holds objects other than tensors" in errors["pickled.pt"]
    assert "weights_only=True refuses" in errors["pickled.pt"]
    assert "a_list.pt' holds a list, not a state dict" in errors["a_list.pt"]
    assert "garbage.pt' is not a readable torch.save file" in errors["garbage.pt"]
    assert errors["legacy.pt"] is None  # torch's pre-1.6 format: read whole, not mapped
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
