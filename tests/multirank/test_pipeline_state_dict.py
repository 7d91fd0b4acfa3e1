"""A model holding a PipelineTransformerBlockList has the plain model's state dict on
every rank (BMTrain's behaviour): every layer's keys, gathered from the stage holding
it, and loads a plain model's state dict strictly on every stage. Tiny models (an
embedding, four residual layers, a head) trained a few steps with every rank's batch
slice, against the plain model on one process with the whole batch (SGD with momentum
and AdamW)."""

import pytest
import torch
from pipeline_cases import (
    SD_LAYERS,
    state_dict_after_training,
    state_dict_checkpoint,
    state_dict_loading,
)
from safetensors.torch import load_file
from support.ranks import run_ranks

VARIANTS = ["pipe", "block", "plain", "pipe frozen embed"]


@pytest.mark.parametrize(
    "world,pipe,optimizer", [(2, 2, "sgd"), (2, 2, "adamw"), (4, 2, "adamw")]
)  # world 4: dp 2 inside each stage
def test_state_dict_holds_every_layer_on_every_rank(world, pipe, optimizer):
    """Blocks made with mode="PIPE" (checkpointing or not) and plain modules train alike, and each
    rank's state dict is the plain model's (values checked with assert_close inside the
    ranks); the stage's own part stays available as stage_state_dict()."""
    out = run_ranks(state_dict_after_training, world, pipe, optimizer, timeout_s=240)
    stages = {tuple(o["pipe"]["local"]) for o in out}
    assert sorted(i for s in stages for i in s) == list(range(SD_LAYERS)), stages
    for rank, o in enumerate(out):
        assert sorted(o) == sorted(VARIANTS), o.keys()
        for what in VARIANTS:
            r = o[what]
            assert sorted(r["keys"]) == sorted(r["plain_keys"]), (rank, what, r["keys"])
            assert r["err"] < 1e-5, (rank, what, r["err"])
            assert {k.split(".")[0] for k in r["stage_keys"]} == {str(i) for i in r["local"]}


@pytest.fixture(scope="module")
def loading():
    return run_ranks(state_dict_loading, 2, 2, timeout_s=180)


def test_a_plain_state_dict_loads_strictly_on_every_stage(loading):
    """No error, nothing missing or unexpected; the logits and loss are then the plain
    model's (checked inside the ranks) and so is the state dict."""
    assert {tuple(o["local"]) for o in loading} == {(0, 1), (2, 3)}
    for rank, o in enumerate(loading):
        assert o["missing"] == [] and o["unexpected"] == [], (rank, o)
        assert o["after"] < 1e-6 and o["still"] < 1e-6, (rank, o)


@pytest.mark.parametrize(
    "key", ["layers.0.linear.weight", f"layers.{SD_LAYERS - 1}.gain", "head.bias"]
)
def test_a_missing_key_is_missing_on_every_stage(loading, key):
    """A key of a stage-0 layer, of a stage-1 layer's buffer, outside the list: reported
    (strict=False) and raised (strict=True) on every rank, naming the key."""
    for rank, o in enumerate(loading):
        assert o[f"non-strict without {key}"] == [key], (rank, o)
        err = o[f"strict without {key}"]
        assert "Missing key(s)" in err and repr(key)[1:-1] in err, (rank, err)


def test_bogus_keys_are_unexpected_on_every_stage(loading):
    bogus = ["layers.1.bogus", f"layers.{SD_LAYERS}.linear.weight", "layers.extra"]
    for rank, o in enumerate(loading):
        assert sorted(o["non-strict bogus"]) == sorted(bogus), (rank, o["non-strict bogus"])
        err = o["strict bogus"]
        assert "Unexpected key(s)" in err and all(k in err for k in bogus), (rank, err)


def test_nbtrain_save_and_load_with_a_pipeline_block_list(tmp_path):
    """Each stage writes its own layers (no stage sends its tensors to another): the file
    holds the plain model's state dict, and a fresh model loads it back."""
    out = run_ranks(state_dict_checkpoint, 2, 2, str(tmp_path), timeout_s=180)
    ref = out[0]["ref"]
    for rank, o in enumerate(out):
        for name in ("model.safetensors", "model.pt"):
            r = o[name]
            assert r["missing"] == [] and r["unexpected"] == [] and r["err"] < 1e-6, (rank, name, r)
    for name, saved in (
        ("model.safetensors", load_file(str(tmp_path / "model.safetensors"))),
        ("model.pt", torch.load(str(tmp_path / "model.pt"), weights_only=True)),
    ):
        assert sorted(saved) == sorted(ref), (name, sorted(set(saved) ^ set(ref)))
        for k, v in ref.items():
            torch.testing.assert_close(
                saved[k], v, msg=lambda m, k=k, name=name: f"{name} {k}: {m}"
            )
