"""Tensor-parallel layers at tp 2 and 3 (odd sizes, batch > 1, every flag) against the
plain layers: outputs, input gradients and weight gradients within 1e-5."""

import pytest
import torch
from support.ranks import run_ranks
from tp_cases import layer_errors


@pytest.mark.parametrize("tp", [2, 3])
def test_every_layer_and_flag_matches_the_plain_layer(tp):
    for rank, errs in enumerate(run_ranks(layer_errors, tp, timeout_s=120)):
        assert len(errs) == 13  # 4 column, 4 row, embedding, 4 projection + loss
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize(
    "tp,sequence_parallel,optimizer",
    [(2, True, "sgd"), (2, False, "adamw"), (3, True, "adamw"), (3, False, "sgd")],
)
def test_training_matches_one_plain_process(tp, sequence_parallel, optimizer):
    from tp_cases import training_errors

    for rank, errs in enumerate(
        run_ranks(training_errors, tp, sequence_parallel, optimizer, timeout_s=120)
    ):
        assert errs["loss"] < 1e-5 and errs["params"] < 1e-5, f"rank {rank}: {errs}"
        assert errs["keys"] and errs["state"] < 1e-5, f"rank {rank}: {errs}"  # state_dict
        assert errs["norm"] < 1e-5, f"rank {rank}: {errs}"  # the global grad norm


@pytest.mark.parametrize(
    "sequence_parallel,optimizer,zero_level",
    [
        (True, "sgd", None),
        (False, "adamw", None),
        (True, "adamw", 3),
        (False, "sgd", 2),
        (True, "sgd", 2),
        (False, "adamw", 3),
    ],
)
def test_tp2_by_dp2_data_parallel_replicas_match_one_plain_process(
    sequence_parallel, optimizer, zero_level
):
    """Plain data-parallel replicas, and the tp layers in a ZeRO-2/3 Block sharded over
    the data-parallel group."""
    from tp_cases import training_errors

    for rank, errs in enumerate(
        run_ranks(training_errors, 4, sequence_parallel, optimizer, 2, zero_level, timeout_s=180)
    ):
        assert errs["loss"] < 1e-5 and errs["params"] < 1e-5, f"rank {rank}: {errs}"
        assert errs["keys"] and errs["state"] < 1e-5, f"rank {rank}: {errs}"  # state_dict
        assert errs["norm"] < 1e-5, f"rank {rank}: {errs}"  # the global grad norm


def test_a_bmtrain_tp_script_runs_with_only_its_import_changed():
    import bmtrain_tp_script as script

    ref_losses, ref = script.plain()
    for rank, (losses, params) in enumerate(run_ranks(script.main, 2, timeout_s=120)):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, rank
        split = {"embed.weight": 0, "w_in.weight": 0, "w_in.bias": 0, "w_out.weight": 1}
        for name, value in params.items():
            full = ref[name].detach()
            if name == "embed.weight":  # 13 rows padded to 14
                full = torch.cat([full, full.new_zeros(1, full.shape[1])])
            expected = full.chunk(2, split[name])[rank] if name in split else full
            assert (value - expected).abs().max() < 1e-5, (rank, name)


def test_telemetry_shows_tensor_parallel_collectives_as_their_own_kinds():
    from tp_cases import telemetry_kinds

    kinds = run_ranks(telemetry_kinds, 2, timeout_s=120)[0]
    # gather the tokens, reduce-scatter them back, all-reduce the row bias's gradient
    assert kinds == ["tp_all_gather", "tp_all_reduce", "tp_reduce_scatter"], kinds


def test_checkpoints_of_a_tp_model(tmp_path):
    from tp_cases import checkpoints

    out = run_ranks(checkpoints, 2, str(tmp_path), timeout_s=120)
    assert all(o["same"] and o["plain"] for o in out), out  # full tensors, plain names


def test_weights_saved_at_tp2_load_at_tp1_dp3_and_tp2_dp2(tmp_path):
    from tp_cases import load_at, save_at

    saved = run_ranks(save_at, 2, str(tmp_path), 2, timeout_s=120)[0]
    for world, tp in ((3, 1), (4, 2)):
        for rank, state in enumerate(run_ranks(load_at, world, str(tmp_path), tp, timeout_s=120)):
            assert sorted(state) == sorted(saved)
            worst = max((state[k] - saved[k]).abs().max().item() for k in saved)
            assert worst == 0.0, (world, tp, rank, worst)
