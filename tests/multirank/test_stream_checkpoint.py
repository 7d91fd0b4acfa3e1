"""nbtrain.save and nbtrain.load without a full copy of the model on any rank, and
their errors for bad files, on real gloo ranks.

A 25 MB GPT (built on the meta device, ZeRO-3 over 2 ranks): saving adds less than one
transformer block's full size to a rank's memory (one parameter gathered at a time);
loading into a fresh sharded model adds at most its shards plus the largest tensor
(plus 2 MB), of which only this rank's rows are read (a 32 MiB embedding adds half of
it). The file is a plain safetensors file holding the trained weights, and the reload
equals them.
"""

import pytest
import torch
from meta_cases import bad_files, save_load_peak
from support.ranks import run_ranks

MB = 1 << 20


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    return run_ranks(save_load_peak, 2, str(folder), 256, 8, timeout_s=300)


def test_saving_holds_less_than_one_block(peaks):
    # A Block's parameters are gathered one at a time (each rank broadcasts its part):
    # a gathered flat group would be a whole block, twice that on gloo, whose
    # all_gather keeps a temporary copy (measured: 6 MiB for this 3 MiB block).
    for p in peaks:
        assert p["full"] > 20e6 and p["block"] < p["full"] / 6
        assert p["save_peak"] < p["block"], (
            f"save peak {p['save_peak'] / MB:.1f} MiB, one block {p['block'] / MB:.1f} MiB"
        )


def test_loading_holds_the_shards_and_one_tensor(peaks):
    for p in peaks:
        bound = p["held"] + p["largest"] + 2 * MB
        assert p["load_peak"] < bound, (
            f"load peak {p['load_peak'] / MB:.1f} MiB, bound {bound / MB:.1f} MiB"
        )
        assert p["load_peak"] < 0.7 * p["full"]
        assert p["same"]  # the reload equals the saved model


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The same GPT with a 32768-token vocabulary: one 32 MiB embedding."""
    folder = tmp_path_factory.mktemp("wide")
    return run_ranks(save_load_peak, 2, str(folder), 256, 8, 32768, timeout_s=300)


def test_loading_reads_only_this_ranks_rows(wide):
    # The embedding is read by rows, this rank's half: reading it whole would add
    # its 32 MiB, this adds about 16 (measured: whole reads 8 MiB above sliced ones
    # for an 8 MiB embedding, per rank).
    for p in wide:
        assert p["largest"] == 32 * MB and p["same"]
        bound = p["held"] + 0.75 * p["largest"]
        assert p["load_peak"] < bound, (
            f"load peak {p['load_peak'] / MB:.1f} MiB, bound {bound / MB:.1f} MiB"
        )


def test_the_file_is_plain_safetensors(peaks):
    from safetensors.torch import load_file

    from nbtrain.models.gpt import GPT, GPTConfig

    state = load_file(peaks[0]["path"])
    plain = GPT(GPTConfig(vocab_size=96, hidden=256, heads=8, layers=8, seq_len=16))
    plain.load_state_dict(state)  # strict: every name, every shape
    assert torch.equal(state["head.weight"], state["tok.weight"])


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    return run_ranks(bad_files, 2, str(tmp_path_factory.mktemp("bad")), timeout_s=300)


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("truncated", r"ValueError: '.*truncated.safetensors' is not a readable safetensors file"),
        ("garbage", r"ValueError: '.*garbage.safetensors' is not a readable safetensors file"),
        ("missing", r"FileNotFoundError: nbtrain.load: no file '.*nothing.safetensors'"),
        ("other model", r"'tok.weight' has shape \(96, 32\) in the file but \(96, 64\)"),
        (
            "unwritable",
            r"nbtrain.save\('.*/no/such/dir/m.safetensors'\): the folder '.*/no/such/dir'"
            r" does not exist",
        ),
        (
            "truncated shard",
            r"ValueError: checkpoint shard .*/ckpt/v-\w+/rank0000[01].safetensors is "
            r"not a readable safetensors file",
        ),
        (
            "unwritable checkpoint",
            r"save_checkpoint\('.*good.safetensors/ckpt'\): cannot create "
            r"the checkpoint folder there \(Not a directory\)",
        ),
    ],
)
def test_bad_files_name_the_file_and_the_problem(errors, case, pattern):
    import re

    for per_rank in errors:
        assert re.search(pattern, per_rank[case]), per_rank[case]
