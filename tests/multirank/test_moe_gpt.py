"""The MoE GPT (nbtrain.models.gpt_moe) sharded by wrap with expert parallelism trains
equal to the same model in one process, 10 steps, with AdamW and SGD with momentum:

    world 2, ep 2       every rank holds half the experts (edp of one rank)
    world 4, ep 2       experts ZeRO-sharded over the two ranks holding them (edp 2)

Each rank's loss is over its own tokens (cross-entropy plus its auxiliary balance
loss); the reference averages the same per-rank losses. Expert gradients arrive as a
sum over the ep ranks' tokens and must be divided by ep_size: SGD catches a wrong
scale, AdamW would not. State dicts hold all experts, gathered over ep.

The layout is the caller's: given no ep group, a MoE GPT under
init_distributed(ep_size=2) keeps every expert on every rank, sends nothing, trains
equal to the one process too (plain data parallelism), and warns once at its build.
"""

import pytest
import torch
from moe_gpt_cases import ROWS, SEQ, bias_with_checkpointing, meta_build, save_and_load, train
from safetensors.torch import load_file
from support.ranks import run_ranks

STEPS = 10


def assert_trains_equal_to_one_process(out):
    """Every step's loss and every rank's final state equal the one-process reference
    (which must change every step: it trains)."""
    first = out[0]
    assert len(set(round(x, 5) for x in first["reference"])) == STEPS
    assert first["losses"] == pytest.approx(first["reference"], abs=1e-5)
    for key, ref in first["ref_state"].items():
        for o in out:
            assert torch.allclose(o["state"][key], ref, atol=1e-5), key


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_moe_gpt_at_ep_equals_one_process(world, ep, kind):
    out = run_ranks(train, world, ep, kind, STEPS, timeout_s=300)
    first = out[0]
    assert_trains_equal_to_one_process(out)
    assert first["state"]["layers.0.mlp.w_in"].shape == (4, 16, 32)  # all experts
    assert first["local_experts"] == 4 // ep
    # Router statistics of the last forward: every assignment of the whole batch (all
    # data-parallel ranks, ep ones included) counted once per layer.
    load = first["stats"]["moe.0.load"]
    assert sum(load) == 2 * ROWS * SEQ * world and first["stats"]["moe.0.dropped"] == 0
    assert first["stats"]["moe.0.balance"] >= 1.0
    assert all(o["a2a"] > 0 for o in out)
    assert all(o["warnings"] == [] for o in out)  # the layout was given


@pytest.mark.parametrize("zero_level", [2, 3])
def test_moe_gpt_with_a_pipelined_exchange_equals_one_process(zero_level):
    """moe_chunks=2: each MoE layer's exchange in two pipelined chunks, the experts'
    graph built inside the exchange and differentiated in its backward, under ZeRO-2 and
    ZeRO-3 (weights gathered, then freed, then gathered again for backward) at ep 2;
    SGD with momentum, which a wrong gradient scale would not pass."""
    cfg = {"moe_chunks": 2}
    out = run_ranks(train, 2, 2, "sgd", STEPS, zero_level, True, cfg, timeout_s=300)
    assert_trains_equal_to_one_process(out)
    assert all(o["a2a"] > 0 and o["local_experts"] == 2 for o in out)


def test_moe_gpt_given_no_layout_keeps_every_expert_local_and_equals_one_process():
    out = run_ranks(train, 2, 2, "sgd", STEPS, 3, False, timeout_s=300)
    assert_trains_equal_to_one_process(out)
    for o in out:
        assert o["local_experts"] == 4 and o["a2a"] == 0
        # Every rank routed its own rows; wrap made the layers count the whole batch
        # (top-2: two assignments a token) over the data-parallel group.
        assert sum(o["stats"]["moe.0.load"]) == 2 * ROWS * SEQ * 2
        assert len(o["warnings"]) == 2  # one per MoE layer, on every rank
        assert all(
            "ep_size=2" in w and "ExpertParallel.from_topology()" in w for w in o["warnings"]
        )
    assert out[0]["stats"] == out[1]["stats"]


@pytest.mark.parametrize("layout", [True, False])
def test_the_routing_bias_follows_the_whole_batch_on_every_replica(layout):
    """balance="bias" steers routing by the expert load. Data-parallel replicas fed
    other rows must count the whole batch's load, or their biases, and then their
    routing, drift apart without an error. (No one-process reference here: its bias
    would step on another schedule than OptimManager's step end.)"""
    cfg = {"balance": "bias", "bias_update_rate": 0.05}
    out = run_ranks(train, 2, 1, "sgd", 4, 3, layout, cfg, timeout_s=300)
    for o in out:
        assert sum(o["stats"]["moe.0.load"]) == 2 * ROWS * SEQ * 2  # both ranks' rows
    assert out[0]["stats"] == out[1]["stats"]
    biases = [o["state"]["layers.0.mlp.expert_bias"] for o in out]
    assert biases[0].abs().sum() > 0  # it moved
    assert torch.equal(biases[0], biases[1])
    for key in out[0]["state"]:  # the replicas stay one model
        assert torch.equal(out[0]["state"][key], out[1]["state"][key]), key


def test_moe_gpt_save_holds_every_expert_and_loads_back(tmp_path):
    path = str(tmp_path / "moe.safetensors")
    out = run_ranks(save_and_load, 2, 2, path, timeout_s=300)
    before, after, refused = out[0]
    assert "nbtrain.save(model, path)" in refused and "ep_size 2" in refused
    stored = load_file(path)
    assert stored["layers.1.mlp.w_out"].shape == (4, 32, 16)
    for key, value in before.items():
        assert torch.equal(stored[key], value), key
        assert torch.equal(after[key], value), key
    assert all(torch.equal(out[1][0][k], v) for k, v in before.items())
    assert out[1][2] == refused  # every rank refuses, none waits for the others


def test_a_recomputed_forward_steps_the_bias_once():
    plain, plain_metrics, ckpt, ckpt_metrics = run_ranks(bias_with_checkpointing, 2, timeout_s=300)[
        0
    ]
    assert plain.abs().sum() > 0  # the bias moved
    assert torch.equal(plain, ckpt)
    assert plain_metrics == ckpt_metrics == 3


def test_built_on_the_meta_device_and_initialised_rank_by_rank():
    out = run_ranks(meta_build, 2, timeout_s=300)
    std, largest, bound, losses = out[0]
    assert largest <= bound and abs(std - bound / 3**0.5) < 0.2 * bound  # U(-b, b)
    assert out[1][:3] == out[0][:3]  # every rank gathers the same experts
    assert losses[0] == pytest.approx(4.16, abs=0.1)  # log(64): an untrained model
    assert losses[1] < losses[0]
