"""nbtrain's GPT under context parallelism, on real gloo ranks (world 2, cp_size 2, so
one batch per step and each rank half of every sequence), wrapped with ZeRO-3:

- 10 training steps equal one process training the plain GPT on full rows, within
  1e-5 in each step's loss and in the final weights: AdamW and SGD with momentum (SGD
  catches a wrongly scaled gradient, which Adam's normalisation hides), one causal
  sequence per row and packed documents spanning the ranks, zigzag and contiguous
  layouts; and with activation checkpointing (the ring recomputed in the backward);
- the logits gathered from the shards equal the plain GPT's on the full rows;
- the layout passed is the topology's cp group; bad inputs name the fix;
- a GPT given no layout is the plain model at cp_size 2 too: bitwise the logits, loss
  and gradient of one process on the full rows, and no ring traffic;
- in one process: the cp code path at cp 1 (`ContextParallel(ALONE)`) computes what
  the plain GPT does, and plain-PyTorch use stays bitwise as before.
"""

import pytest
import torch
from gpt_cp_cases import CASES, batch, config, cp_training, new_gpt, reference
from support.ranks import run_ranks

from nbtrain.comm.topology import ALONE
from nbtrain.context_parallel import ContextParallel
from nbtrain.models.gpt import GPT

STEPS = 10
TOL = 1e-5


@pytest.fixture(scope="module")
def cp_ranks():
    return run_ranks(cp_training, 2, STEPS, timeout_s=180)


@pytest.fixture(scope="module")
def cp_references():
    return {(packed, opt): reference(opt, packed, STEPS) for _, packed, opt in CASES}


def case_id(case):
    layout, packed, opt, *recompute = case
    return "-".join([layout, "packed" if packed else "one-doc", opt, *recompute])


@pytest.mark.parametrize("case", CASES + [("zigzag", True, "sgd", "recompute")], ids=case_id)
def test_training_equals_one_process(cp_ranks, cp_references, case):
    _, packed, opt = case[:3]
    want_losses, _, want_state = cp_references[(packed, opt)]
    assert len(set(want_losses)) == STEPS  # it trains
    for rank in cp_ranks:
        losses, _, state = rank["results"][case]
        loss_err = max(abs(a - b) for a, b in zip(losses, want_losses))
        assert loss_err < TOL, (losses, want_losses)
        assert state.keys() == want_state.keys()
        for key in state:
            err = float((state[key] - want_state[key]).abs().max())
            assert err < TOL, f"{key}: max error {err:.2e}"


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "sgd"], ids=case_id)
def test_gathered_logits_equal_the_full_rows(cp_ranks, cp_references, case):
    _, packed, _ = case
    want = cp_references[(packed, "sgd")][1]
    for rank in cp_ranks:
        got = rank["results"][case][1]
        assert got.shape == want.shape == (2, 32, 64)
        assert float((got - want).abs().max()) < TOL


def test_the_layout_passed_is_the_topologys_cp_group(cp_ranks):
    for r, rank in enumerate(cp_ranks):
        facts = rank["facts"]
        assert (facts["cp_size"], facts["cp_rank"], facts["data_size"]) == (2, r, 1)
        assert facts["zigzag"] == ("zigzag", r, 2)
        assert facts["contiguous"] == ("contiguous", r, 2)


def test_a_gpt_given_no_layout_is_the_plain_model_under_cp(cp_ranks):
    """init_distributed(cp_size=2) does not make a GPT built without a layout context
    parallel: on each rank it computes what one process computes on the full rows."""
    model = new_gpt()
    ids, targets, pos = batch(0, True)
    with torch.no_grad():
        want_logits = (model(ids), model(ids, pos))
    loss = model.loss(ids, targets, pos)
    loss.backward()
    for rank in cp_ranks:
        got = rank["no_layout"]
        assert got["active"] is None and got["shard"]
        assert got["p2p"] == 0
        assert got["logits"][0].shape == (2, 32, 64)  # whole rows, not a shard
        assert all(torch.equal(a, b) for a, b in zip(got["logits"], want_logits))
        assert got["loss"] == float(loss.detach())
        assert torch.equal(got["grad"], model.tok.weight.grad)


def test_bad_inputs_name_the_fix(cp_ranks):
    errors = cp_ranks[0]["errors"]
    assert "length 30 does not divide into 4 chunks" in errors["indivisible"]
    assert "multiple of 4 (e.g. 32)" in errors["indivisible"]
    assert "sequence length 64 (local 32 x cp 2) exceeds seq_len=32" in errors["full rows"]
    assert "model.shard_batch" in errors["full rows"]
    assert "local sequence length 7 is odd" in errors["odd shard"]
    assert "shard_batch(idx, targets, position_ids)" in errors["no doc_ids"]
    assert "targets of shape (2, 16)" in errors["targets"]


# ----------------------------------------------------------------- in one process


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_cp_path_at_cp_1_is_the_plain_gpt(layout):
    model = new_gpt()
    ids, targets, pos = batch(0, True)
    with torch.no_grad():
        plain, packed = model(ids), model(ids, pos)
        model.context_parallel = ContextParallel(ALONE, layout)
        idx, _, local_pos, docs = model.shard_batch(ids, targets, pos)
        assert docs is not None and torch.equal(idx, ids)
        assert (model(idx) - plain).abs().max() < 1e-6
        assert (model(idx, local_pos, docs) - packed).abs().max() < 1e-6


def test_plain_use_is_unchanged():
    model = new_gpt()
    assert model.context_parallel is None and model.active_cp() is None
    ids, targets, pos = batch(1, True)
    assert model.shard_batch(ids, targets, pos) == (ids, targets, pos, None)
    with torch.no_grad():
        out = model(ids, pos)
        model.context_parallel = None
        assert torch.equal(model(ids, pos), out)
    with pytest.raises(ValueError, match="doc_ids are for context parallelism"):
        model(ids, pos, pos)


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="layout='diagonal'"):
        ContextParallel(layout="diagonal")
    model = GPT(config())
    model.context_parallel = "world"
    with pytest.raises(ValueError, match="context_parallel='world'"):
        model(batch(0, False)[0])
    dropped = GPT(config().__class__(**{**config().__dict__, "dropout": 0.1}))
    dropped.context_parallel = ContextParallel(ALONE)
    with pytest.raises(NotImplementedError, match="dropout=0.1"):
        dropped(batch(0, False)[0])


def test_the_old_paths_warn_and_still_work():
    import importlib
    import sys

    import nbtrain.context_parallel as home

    model = GPT(config())
    model.context_parallel = "topology"  # the old default: nbtrain's cp group, if any
    with pytest.warns(FutureWarning, match="ContextParallel.from_topology"):
        assert model.active_cp() is None  # no distributed context here
    with pytest.warns(FutureWarning, match="nbtrain.context_parallel.ContextParallel"):
        from nbtrain.models.gpt import ContextParallel as old
    assert old is home.ContextParallel
    sys.modules.pop("nbtrain.nn.ring", None)
    with pytest.warns(FutureWarning, match="nbtrain.nn.ring moved to nbtrain.context_parallel"):
        ring = importlib.import_module("nbtrain.nn.ring")
    assert ring.ring_attention is home.ring_attention and ring.Ring is home.Ring
