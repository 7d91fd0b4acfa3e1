"""nbtrain.runtime.compare(..., per_layer=True): the tiny GPT at dp 2 (ZeRO-3), tp 2 and
pp 2 agrees module by module with the one-process reference over 3 SGD-momentum steps,
and a registered model variant whose layers.1.mlp output is scaled on rank 1 at step 1
is named by module, step, direction and rank at every layout."""

import pytest
from per_layer_cases import BUGGY_MODULE, BUGGY_RANK, BUGGY_STEP, LAYOUTS, STEPS, per_layer
from support.ranks import run_ranks


@pytest.fixture(scope="module")
def per_layer_runs():
    return run_ranks(per_layer, 2, timeout_s=300)


def test_correct_layouts_agree_module_by_module(per_layer_runs):
    assert per_layer_runs[0] == per_layer_runs[1]  # every rank holds one report
    for layout in LAYOUTS:
        found = per_layer_runs[0][layout, "correct"]
        assert not found["diverged"] and found["first"] is None, (layout, found["table"])
        assert found["steps"] == [[None, None, None]] * STEPS, (layout, found["table"])
        for loss_a, loss_b in found["losses"]:
            assert abs(loss_a - loss_b) < 1e-5, (layout, found["losses"])
    # The pipeline stage's modules ("1.mlp") are paired with the plain names
    # ("layers.0.mlp"): under ZeRO-3 and pp 2 all 24 modules that run are compared (the
    # root, the layer list and the stages' embedding and head wrappers are not), with
    # 26 parameters, and 27 at pp 2, where the last stage holds the tied embedding
    # under the head's name.
    for layout, params in (("dp", 26), ("pp", 27)):
        found = per_layer_runs[0][layout, "correct"]
        assert found["skipped"] == [] and len(found["compared"]["forward"]) == 24, found
        assert "layers.0.mlp" in found["compared"]["backward"], found["compared"]
        assert found["params"] == params, (layout, found["params"])
    tp = per_layer_runs[0]["tp", "correct"]
    assert "layers.1.mlp.0" in tp["skipped"] and "layers.1.mlp" in tp["compared"]["forward"], tp


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_scaled_module_output_is_named_by_module_step_and_rank(per_layer_runs, layout):
    found = per_layer_runs[0][layout, "bug"]
    assert found["steps"][0] == [None, None, None], found["table"]
    assert found["first"] == (BUGGY_STEP, "forward", BUGGY_MODULE, BUGGY_RANK, "output"), found[
        "table"
    ]
    # The per-step losses come with the report: equal until the bug, then apart.
    (loss_a0, loss_b0), (loss_a1, loss_b1) = found["losses"][:2]
    assert abs(loss_a0 - loss_b0) < 1e-5 and abs(loss_a1 - loss_b1) > 1e-4, found["losses"]


def test_per_layer_needs_the_reference_as_cfg_b():
    from support.runtime_cases import batches, configs

    from nbtrain.runtime import compare

    _, mine = configs("sgd")
    with pytest.raises(ValueError, match="backend='reference'"):
        compare(mine, mine, 1, batches(), per_layer=True)
