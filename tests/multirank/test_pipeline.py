"""Pipeline parallelism: GPipe and 1F1B at pp 2 and 3 with 4 micro-batches, ZeRO-3 inside
stages and pp 2 x dp 2, against one plain process (10 steps, AdamW and SGD with momentum:
losses and every final parameter within 1e-5); 1F1B holds at most P - s micro-batches'
activations on stage s, GPipe all M. The GPT whose embedding is its output projection,
tied across stages: at pp 2 and 3, by tensor parallelism, and by data parallelism with
each stage (or chunk) wrapped for ZeRO."""

import pytest
from pipeline_cases import MICRO, parity
from support.ranks import run_ranks


@pytest.mark.parametrize(
    "pipe,schedule,optimizer",
    [(2, "gpipe", "adamw"), (2, "1f1b", "sgd"), (3, "gpipe", "sgd"), (3, "1f1b", "adamw")],
)
def test_pipeline_matches_one_plain_process(pipe, schedule, optimizer):
    out = run_ranks(parity, pipe, pipe, schedule, optimizer, timeout_s=180)
    covered = sorted(i for o in out for i in o["layers"])
    assert covered == list(range(6)), covered  # every layer on exactly one stage
    for stage, o in enumerate(out):
        assert o["n"][0] == o["n"][1] > 0, (stage, o)
        assert o["loss"] < 1e-5 and o["params"] < 1e-5 and o["norm"] < 1e-5, (stage, o)
        # activations held at once: 1F1B at most P - s, GPipe all M
        assert o["peak"] == (MICRO if schedule == "gpipe" else min(pipe - stage, MICRO)), (stage, o)


@pytest.mark.parametrize(
    "world,pipe,zero_level,optimizer,schedule",
    [(2, 2, 3, "adamw", "1f1b"), (4, 2, 3, "sgd", "1f1b"), (4, 2, 2, "adamw", "gpipe")],
)
def test_zero_inside_stages_and_pipe_by_data_parallel(world, pipe, zero_level, optimizer, schedule):
    out = run_ranks(parity, world, pipe, schedule, optimizer, zero_level, timeout_s=180)
    for rank, o in enumerate(out):
        assert o["loss"] < 1e-5 and o["params"] < 1e-5 and o["norm"] < 1e-5, (rank, o)
        # Over the step's micro-batches each flat group gathers once and reduces once
        # (not once per micro-batch, twice for ZeRO-3's gathers); a stage of one rank
        # sends nothing.
        once = o["flat_groups"] if world > pipe else 0
        assert o["flat_groups"] > 0 and o["gathers"] == o["reductions"] == once, o


def test_a_stage_whose_gradients_nobody_reduces_is_refused():
    """pp 2 x dp 2 with a plain nn.Module stage: its replicas would drift apart."""
    with pytest.raises(AssertionError, match="stage parameter '0.0.weight' has no owner"):
        run_ranks(parity, 4, 2, "1f1b", "sgd", timeout_s=120)


@pytest.mark.parametrize(
    "world,pipe,zero_level,optimizer",
    [(2, 2, 3, "adamw"), (3, 3, 2, "sgd"), (4, 2, 3, "sgd"), (4, 2, 2, "adamw")],
)
def test_bmtrain_pipeline_block_list_script(world, pipe, zero_level, optimizer):
    """Every rank passes its own batch slice and gets its slice back; the embedding and
    head around the list are plain data-parallel code."""
    from pipeline_cases import blocklist_script

    out = run_ranks(blocklist_script, world, pipe, zero_level, optimizer, timeout_s=180)
    stages = sorted({tuple(o["local"]) for o in out})
    assert sorted(i for s in stages for i in s) == list(range(5)), stages
    for rank, o in enumerate(out):
        assert o["loss"] < 1e-5 and o["params"] < 1e-5, (rank, o)
        # Over the micro-batches each flat group gathers once for forward and once for
        # backward, and reduces once (not once per micro-batch); one rank a stage: none.
        once = o["flat_groups"] if world > pipe else 0
        assert o["flat_groups"] > 0 and o["reductions"] == once, o
        assert o["gathers"] == 2 * once, o
        # every layer under the plain model's names on every rank (BMTrain's state dict)
        assert {k.split(".")[1] for k in o["keys"] if k.startswith("layers.")} == {
            str(i) for i in range(5)
        }, (rank, o["keys"])


@pytest.mark.parametrize("pipe,schedule,optimizer", [(2, "1f1b", "sgd"), (3, "gpipe", "adamw")])
def test_gpt_with_tied_embeddings_across_stages(pipe, schedule, optimizer):
    """The embedding on the first stage and the output projection on the last are one
    parameter: their gradients are summed over both stages."""
    from pipeline_cases import gpt_pipeline

    out = run_ranks(gpt_pipeline, pipe, pipe, schedule, optimizer, timeout_s=180)
    assert [o["ties"] for o in out] == [1] + [0] * (pipe - 2) + [1], out
    for stage, o in enumerate(out):
        assert o["loss"] < 1e-5 and o["params"] < 1e-5 and o["norm"] < 1e-5, (stage, o)


@pytest.mark.parametrize(
    "optimizer,zero_level", [("adamw", None), ("sgd", None), ("sgd", 3), ("adamw", 2)]
)
def test_pipe_by_tensor_parallel_at_world_4(optimizer, zero_level):
    # With ZeRO the tied output projection's weight on the last stage is sharded and
    # gathered for its forward: it must compute with that weight, not the embedding's.
    from pipeline_cases import gpt_pipeline

    for rank, o in enumerate(
        run_ranks(gpt_pipeline, 4, 2, "1f1b", optimizer, 2, zero_level, timeout_s=180)
    ):
        assert o["checked"] > 0 and o["loss"] < 1e-5 and o["params"] < 1e-5 and o["norm"] < 1e-5, (
            rank,
            o,
        )


GPT_DP_CASES = [
    ("1f1b", "adamw", 3),
    ("1f1b", "sgd", 3),
    ("gpipe", "sgd", 2),
    ("interleaved", "sgd", 3),
]


@pytest.fixture(scope="module")
def gpt_pp2_dp2():
    """The tied GPT at pp 2 x dp 2, every case of GPT_DP_CASES in one launch."""
    from pipeline_cases import gpt_pipe_by_data_parallel

    return run_ranks(gpt_pipe_by_data_parallel, 4, 2, GPT_DP_CASES, timeout_s=300)


@pytest.mark.parametrize("case", GPT_DP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpt_with_tied_embeddings_across_stages_by_data_parallel(gpt_pp2_dp2, case):
    """Each stage wrapped for ZeRO over its data-parallel ranks: the tied parameter's
    gradient is each stage's averaged over its replicas, summed over the two stages
    (SGD with momentum would see a sum where a mean belongs, or a missing stage)."""
    schedule = case[0]
    for rank, o in enumerate(gpt_pp2_dp2):
        r = o[case]
        # the embedding's stage and the head's (interleaved: chunk 0 of rank 0, chunk 1
        # of rank 1) each hold the tie
        assert r["ties"] == 1 and r["checked"] > 0, (rank, r)
        assert r["loss"] < 1e-5 and r["params"] < 1e-5 and r["norm"] < 1e-5, (rank, schedule, r)


def test_an_unwrapped_tied_stage_by_data_parallel_is_refused(gpt_pp2_dp2):
    for o in gpt_pp2_dp2:
        assert "has no owner that reduces its gradient" in o["unwrapped"], o["unwrapped"]
        assert "nbtrain.wrap(stage)" in o["unwrapped"], o["unwrapped"]
