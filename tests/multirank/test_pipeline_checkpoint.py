"""Pipeline stages carry the plain model's names, and sharded checkpoints reshard between
pipeline layouts: HALF steps at one layout, save, a fresh model (other initial values,
empty optimizer) at another layout loads and trains on; every loss and every final
parameter within 1e-5 of one plain process trained the same TOTAL steps (AdamW, and SGD
with momentum: the optimizer state goes through the checkpoint too).

Layouts are (pipe_size, zero_level): None keeps a stage plain, 3 or 2 wraps it (ZeRO
inside the stage, over its data-parallel ranks). The GPT's embedding is its output
projection: at pp=2 the plain stages sum its gradient over both ends; at pp=1 wrap keeps
the two layers holding it outside Blocks, so it stays one parameter.
"""

import json
import os

import pytest
from pipeline_ckpt_cases import HALF, resume
from safetensors.torch import load_file
from support.ranks import run_ranks

TIED = "0.tok.weight"  # the GPT's embedding: its first name in nn.Sequential(*gpt_layers)
HEAD = "3.head.weight"  # the same parameter as the output projection (layer 3 of 4)


def _check(out, what):
    for rank, o in enumerate(out):
        assert o["loss"] < 1e-5 and o["params"] < 1e-5, (what, rank, o["loss"], o["params"])
        # every stage's keys are plain names, and the stages cover the plain model
        assert set(o["keys"]) <= set(o["plain_keys"]), (what, rank, o["keys"])
    assert set().union(*(o["keys"] for o in out)) == set(out[0]["plain_keys"]), what


@pytest.mark.parametrize(
    "kind,first,second,optimizer",
    [
        ("mlp", (2, 3), (1, 3), "adamw"),  # pp=2 -> pp=1 with dp=2
        ("mlp", (1, 3), (2, 3), "sgd"),  # dp=2 -> pp=2
        ("mlp", (2, None), (1, 2), "sgd"),  # plain stages -> ZeRO-2: another grouping
        ("gpt", (2, None), (1, 3), "sgd"),  # tied embedding across stages -> dp=2
        ("gpt", (1, 3), (2, None), "adamw"),  # and back
    ],
)
def test_checkpoint_reshards_between_pipeline_layouts(tmp_path, kind, first, second, optimizer):
    folder = str(tmp_path / "ckpt")
    out = run_ranks(resume, 2, kind, first, second, optimizer, folder, timeout_s=240)
    _check(out, (kind, first, second))
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    assert meta["pipe_size"] == first[0] and meta["step"] == HALF
    names = {n for info in meta["params"].values() for n, *_ in info["shapes"]}
    if kind == "gpt":  # the tied parameter once, under its first plain name
        assert TIED in names and HEAD not in names, sorted(names)
    # The consolidated file holds every stage's tensors under the plain names.
    tensors = load_file(f"{folder}.safetensors")
    assert sorted(tensors) == out[0]["plain_keys"]
    for k, v in out[0]["half"].items():
        assert (tensors[k] - v).abs().max().item() < 1e-5, k


def test_zero3_inside_stages_at_pp2_by_dp2_reshards_to_dp4(tmp_path):
    folder = str(tmp_path / "ckpt")
    out = run_ranks(resume, 4, "mlp", (2, 3), (1, 2), "adamw", folder, timeout_s=240)
    _check(out, "pp2 x dp2 -> dp4")
    stages = [o["first_keys"] for o in out]
    assert stages[0] == stages[1] and stages[2] == stages[3] and stages[0] != stages[2]
