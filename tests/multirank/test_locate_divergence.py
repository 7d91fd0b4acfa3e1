"""nbtrain.debug.locate_divergence: correct ZeRO-3, tp 2 and pipeline layouts agree with
the plain model over 3 SGD-momentum steps, and three injected bugs are named by module,
step, direction and rank (a tp layer whose backward forgets its all-reduce, a wrong
scale on rank 1's shard, a pipeline stage that drops a micro-batch)."""

import pytest
from locate_cases import STEPS, checkpoint_cases, pipeline_cases, tp_cases, zero_cases
from support.ranks import run_ranks


@pytest.fixture(scope="module")
def zero_runs():
    return run_ranks(zero_cases, 2, timeout_s=240)


@pytest.fixture(scope="module")
def tp_runs():
    return run_ranks(tp_cases, 2, timeout_s=240)


@pytest.fixture(scope="module")
def pipeline_runs():
    return run_ranks(pipeline_cases, 2, timeout_s=240)


def _agrees(found):
    assert not found["diverged"] and found["first"] is None, found["table"]
    assert found["steps"] == [[None, None, None]] * STEPS, found["table"]


def test_correct_layouts_do_not_diverge(zero_runs, tp_runs, pipeline_runs):
    for runs in (zero_runs, tp_runs, pipeline_runs):
        assert runs[0]["correct"] == runs[1]["correct"]  # every rank holds one report
    _agrees(zero_runs[0]["correct"])
    _agrees(tp_runs[0]["correct"])
    _agrees(pipeline_runs[0]["correct"])
    # Under ZeRO-3 every module that runs is compared (24: all but the root and the
    # layer list, which is never called); under tp 2 the layers whose outputs are
    # slices are listed as skipped.
    zero = zero_runs[0]["correct"]
    assert zero["skipped"] == [] and zero["compared"]["forward"] == 24, zero
    assert zero["compared"]["params"] == 26, zero
    tp = tp_runs[0]["correct"]
    assert "layers.1.mlp.0" in tp["skipped"] and tp["compared"]["forward"] >= 10, tp


def test_wrong_scale_on_one_shard_is_named_by_parameter_rank_and_step(zero_runs):
    found = zero_runs[0]["scaled"]
    assert found == zero_runs[1]["scaled"]
    assert found["first"] == (1, "params", "layers.1.mlp.0", 1, "layers.1.mlp.0.weight"), found
    # Step 0 agrees; step 2's forward first meets the scaled weight in that layer.
    assert found["steps"][0] == [None, None, None], found["table"]
    assert found["steps"][2][0][:3] == (2, "forward", "layers.1.mlp.0"), found["table"]
    # The plot: each direction's panel has a line per step and the tolerance line.
    assert zero_runs[0]["plot_lines"] == [STEPS + 1] * 3, zero_runs[0]["plot_lines"]


def test_tp_layer_without_its_backward_all_reduce_is_named(tp_runs):
    found = tp_runs[0]["no_all_reduce"]
    assert found == tp_runs[1]["no_all_reduce"]
    # The forward is right; the first input gradient off is the broken layer's.
    assert found["steps"][0][0] is None, found["table"]
    assert found["first"] == (0, "backward", "layers.1.mlp.0", 0, "input grad"), found["table"]


def test_pipeline_stage_dropping_a_micro_batch_is_named(pipeline_runs):
    found = pipeline_runs[0]["dropped"]
    assert found == pipeline_runs[1]["dropped"]
    # Stage 1 (rank 1) holds layers 2 and 3; its last layer's input gradient is the
    # first off, at step 0, and the forward agrees until the parameters moved.
    assert found["first"] == (0, "backward", "3", 1, "input grad"), found["table"]
    assert found["steps"][0][0] is None and found["steps"][0][2] is not None, found["table"]


@pytest.mark.parametrize("world", [2, 3])
def test_checkpointed_blocks_compare_every_module_once(world):
    """use_checkpoint=True recomputes each Block's forward in backward: the recompute is
    not a second call of the module (it was joined to the first along dim 0, and every
    correct model diverged at the first module inside the first Block; at world 3 the
    joined shapes were skipped as "other shapes")."""
    runs = run_ranks(checkpoint_cases, world, timeout_s=240)
    for level in (2, 3):
        correct = runs[0][f"correct{level}"]
        assert all(r[f"correct{level}"] == correct for r in runs)
        _agrees(correct)
        assert correct["skipped"] == [] and correct["compared"]["forward"] == 24, correct
        assert correct["compared"]["backward"] == 24, correct
        found = runs[0][f"scaled{level}"]
        assert all(r[f"scaled{level}"] == found for r in runs)
        assert found["first"] == (1, "params", "layers.1.mlp.0", 1, "layers.1.mlp.0.weight"), found[
            "table"
        ]
        assert found["steps"][0] == [None, None, None], found["table"]
        assert found["steps"][2][0][:3] == (2, "forward", "layers.1.mlp.0"), found["table"]


def test_a_summed_loss_is_named_nearest_the_loss_with_its_factor(zero_runs):
    """A loss summed where a mean belongs: the forward agrees, the first backward
    finding is the module nearest the loss, and its ratio to the reference is the
    number of tokens a rank sums (2 rows x 8), the mark of one scale gone wrong
    upstream rather than one wrong module (docs/debugging.md)."""
    found = zero_runs[0]["summed"]
    assert found == zero_runs[1]["summed"]
    assert found["steps"][0][0] is None, found["table"]
    assert found["steps"][0][1] == (0, "backward", "head", 0, "input grad"), found["table"]
    assert zero_runs[0]["summed_ratio"] == pytest.approx(16, rel=1e-4), found["table"]
    assert "(= reference x 16)" in found["table"], found["table"]
