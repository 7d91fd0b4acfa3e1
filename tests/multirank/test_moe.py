"""nbtrain.moe.MoE with expert parallelism over 1, 2 and 3 gloo ranks (6 experts:
6, 3 and 2 per rank), each rank with its own tokens, against `moe_reference` on all
ranks' tokens in one process:

- outputs, input gradients, expert weight gradients (each rank's slice) and the
  router gradient (summed over ranks) for top_k 1 and 2, one expert receiving none;
- the bytes counted for the all_to_alls equal what the routing sends to other ranks;
- capacity: a crafted routing drops the assignments worked out by hand, and they
  contribute nothing;
- an ep group of one rank (`ALONE`) holds every expert and sends nothing; so does a
  layer given no group under init_distributed(ep_size=world), warning that it no
  longer follows the topology; 5 experts over 2 or 3 ranks are refused;
- balance="bias" moves the bias towards underloaded experts, the same on every rank,
  and steers selection only; balance="aux" gives the formula's loss, differentiable.
"""

import math

import pytest
import torch
from moe_cases import (
    CRAFTED,
    CRAFTED_KEEP,
    EXPERTS,
    HIDDEN,
    SILENT,
    all_cases,
    crafted_tokens,
    full_weights,
)
from support.ranks import run_ranks

from nbtrain.moe import moe_reference, route

WORLDS = (1, 2, 3)
TOL = 1e-5


@pytest.fixture(scope="module")
def runs():
    return {world: run_ranks(all_cases, world, timeout_s=120) for world in WORLDS}


def _reference(per_rank, top_k):
    """Reference output and gradients on all ranks' tokens at once."""
    router, w_in, w_out = (t.clone().requires_grad_(True) for t in full_weights())
    x = torch.cat([r["x"].reshape(-1, HIDDEN) for r in per_rank]).requires_grad_(True)
    g = torch.cat([r["g"].reshape(-1, HIDDEN) for r in per_rank])
    out = moe_reference(x, router, w_in, w_out, top_k)
    (out * g).sum().backward()
    return out.detach(), x.grad, router.grad, w_in.grad, w_out.grad, x.detach()


def _rows(per_rank):
    starts = [0]
    for r in per_rank:
        starts.append(starts[-1] + r["x"].reshape(-1, HIDDEN).shape[0])
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _err(a, b):
    return float((a - b).abs().max())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["top1", "top2", "top2-chunks3"])
def test_outputs_and_gradients_equal_one_process(runs, world, case):
    """Also with the routed rows in 3 pipelined chunks (a chunk of 3-5 tokens sends no
    row to some experts): the same output and gradients."""
    per_rank = [r[case] for r in runs[world]]
    top_k = int(case[3])
    out, x_grad, router_grad, w_in_grad, w_out_grad, _ = _reference(per_rank, top_k)
    assert float(w_in_grad[SILENT].abs().max()) == 0.0  # SILENT got no tokens
    for r, rows in zip(per_rank, _rows(per_rank)):
        assert _err(r["out"].reshape(-1, HIDDEN), out[rows]) < TOL
        assert _err(r["x_grad"].reshape(-1, HIDDEN), x_grad[rows]) < TOL
        experts = slice(r["first"], r["first"] + r["local"])
        assert _err(r["w_in_grad"], w_in_grad[experts]) < TOL
        assert _err(r["w_out_grad"], w_out_grad[experts]) < TOL
    assert _err(sum(r["router_grad"] for r in per_rank), router_grad) < TOL
    assert [r["first"] for r in per_rank] == [i * EXPERTS // world for i in range(world)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_stats_and_bytes_follow_the_routing(runs, world, top_k):
    per_rank = [r[f"top{top_k}"] for r in runs[world]]
    x = _reference(per_rank, top_k)[-1]
    router = full_weights()[0]
    chosen, _ = route(torch.softmax(x @ router.t(), -1), top_k)
    load = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    owner = chosen // (EXPERTS // world)
    counts_bytes = EXPERTS * 8 * (world - 1) // world  # the int64 count exchange
    chunked = [r["top2-chunks3"] for r in runs[world]] if top_k == 2 else per_rank
    for rank, (r, rows) in enumerate(zip(per_rank, _rows(per_rank))):
        assert r["stats"]["tokens_per_expert"] == load.tolist()
        assert r["stats"]["dropped"] == 0
        assert r["stats"]["balance"] == pytest.approx(float(load.max() / load.float().mean()))
        sent = int((owner[rows] != rank).sum())
        mine = torch.zeros(len(x), dtype=torch.bool)
        mine[rows] = True
        received = int((owner[~mine] == rank).sum())
        rows_bytes = (sent + received) * HIDDEN * 4
        assert r["forward_bytes"] == rows_bytes + counts_bytes
        assert r["backward_bytes"] == rows_bytes
        # in 3 chunks: the same rows, and each chunk's counts in the one count exchange
        assert chunked[rank]["forward_bytes"] == rows_bytes + counts_bytes * (
            3 if chunked is not per_rank else 1
        )
        assert chunked[rank]["backward_bytes"] == rows_bytes
    if world > 1:
        assert per_rank[0]["forward_bytes"] > 0


@pytest.mark.parametrize("world", WORLDS)
def test_aux_loss_is_the_formula_and_differentiable(runs, world):
    for r in (r["top2"] for r in runs[world]):
        router = full_weights()[0].requires_grad_(True)
        scores = torch.softmax(r["x"].reshape(-1, HIDDEN) @ router.t(), -1)
        chosen, _ = route(scores, 2)
        share = torch.bincount(chosen.reshape(-1), minlength=EXPERTS) / chosen.numel()
        aux = 0.01 * EXPERTS * (share * scores.mean(0)).sum()
        (grad,) = torch.autograd.grad(aux, router)
        assert abs(float(r["aux"].detach()) - float(aux.detach())) < 1e-7
        assert _err(r["aux_grad"], grad) < 1e-7 and float(grad.abs().max()) > 0


@pytest.mark.parametrize("world", WORLDS)
def test_capacity_drops_what_the_hand_count_says(runs, world):
    x = crafted_tokens()
    _, w_in, w_out = full_weights()
    keep = torch.tensor(CRAFTED_KEEP)
    want = moe_reference(x, torch.eye(EXPERTS, HIDDEN), w_in, w_out, 2, keep=keep)
    dropless = moe_reference(x, torch.eye(EXPERTS, HIDDEN), w_in, w_out, 2)
    for r in (r["capacity"] for r in runs[world]):
        assert r["capacity"] == math.ceil(1.0 * len(CRAFTED) * 2 / EXPERTS) == 3
        assert r["stats"]["dropped"] == 5 * world  # 5 per rank, over the ep group
        assert r["stats"]["tokens_per_expert"] == [
            7 * world,
            4 * world,
            2 * world,
            2 * world,
            1 * world,
            0,
        ]
        assert _err(r["out"], want) < TOL
        assert float(r["out"][0, 5].abs().max()) == 0.0  # both its choices dropped
        assert _err(r["out"], dropless) > 1e-2  # the drops changed something
        assert float(r["x_grad"][0, 5].abs().max()) == 0.0


@pytest.mark.parametrize("world", WORLDS)
def test_the_bias_moves_towards_underloaded_experts_on_every_rank(runs, world):
    results = [r["bias"] for r in runs[world]]
    load = torch.tensor(results[0]["stats"]["tokens_per_expert"]).float()
    want = 0.1 * torch.sign(load.mean() - load)
    assert want[SILENT] == 0.1 and (want < 0).any()
    router, w_in, w_out = full_weights()
    for r in results:
        assert r["unmoved"]
        assert torch.equal(r["trained_bias"], results[0]["trained_bias"])
        assert _err(r["trained_bias"], want) < 1e-7
        assert torch.equal(r["bias_after_eval"], r["steer"])  # eval: no update
        assert float(r["aux"]) == 0.0
        steered = moe_reference(r["x"], router, w_in, w_out, 2, bias=r["steer"])
        assert _err(r["steered_out"], steered) < TOL
        # SILENT wins the selection but its combine weight is its tiny unbiased score
        unsteered = moe_reference(r["x"], router, w_in, w_out, 2)
        assert _err(r["steered_out"], unsteered) > 1e-3


@pytest.mark.parametrize("world", WORLDS)
def test_an_ep_group_of_one_rank_keeps_every_expert_and_sends_nothing(runs, world):
    router, w_in, w_out = full_weights()
    for r in (r["alone"] for r in runs[world]):
        assert r["local"] == EXPERTS and r["bytes"] == 0
        assert _err(r["out"], moe_reference(r["x"], router, w_in, w_out, 2)) < TOL


@pytest.mark.parametrize("world", WORLDS)
def test_a_layer_given_no_group_keeps_every_expert_whatever_the_topology(runs, world):
    for r in (r["no_layout"] for r in runs[world]):
        assert r["local"] == EXPERTS and r["bytes"] == 0
        if world == 1:  # the ep group was this rank alone: nothing changed, no warning
            assert r["warnings"] == []
        else:
            (message,) = r["warnings"]
            assert message.startswith("UserWarning") and f"ep_size={world}" in message
            assert "ExpertParallel.from_topology()" in message


@pytest.mark.parametrize("world", [2, 3])
def test_experts_that_do_not_split_evenly_are_refused(runs, world):
    message = runs[world][0]["uneven_split_error"]
    assert message is not None and "num_experts=5" in message and f"size {world}" in message
