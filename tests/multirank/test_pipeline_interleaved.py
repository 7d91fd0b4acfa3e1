"""Interleaved 1F1B (virtual pipeline stages) against one plain process: pp 2 x virtual 2
with 4 and 2 micro-batches, a GPT whose tied embedding crosses ranks, pp 3 x virtual 2,
and pp 2 x dp 2 with ZeRO inside the chunks; 10 steps with AdamW and with SGD with
momentum, losses and every final parameter within 1e-5 (rank p's chunk v compared with
the plain model's part v * P + p). Also: the order cannot deadlock and holds Megatron-LM's
live activations; spans, bytes, and the refusals of a bad M and of a lone stage.

Every case of a world runs in one launch (a module fixture); the tests read its results."""

import pytest
from pipeline_cases import BATCH, STEPS
from support.ranks import run_ranks

from nbtrain.pipeline.interleaved import interleaved_order, sends_of

DIMS = [6, 16, 12, 16, 10, 12, 5]  # pipeline_cases._layers: the width after each layer
RUNS_PP2 = [(4, "adamw"), (4, "sgd"), (2, "adamw"), (2, "sgd")]
RUNS_PP3 = [(3, "adamw"), (3, "sgd")]
RUNS_ZERO = [(3, "sgd"), (2, "adamw")]  # (zero_level, optimizer)


@pytest.fixture(scope="module")
def pp2():
    from interleaved_cases import all_cases

    return run_ranks(all_cases, 2, 2, 2, RUNS_PP2, ("adamw", "sgd"), timeout_s=240)


@pytest.fixture(scope="module")
def pp3():
    from interleaved_cases import all_cases

    return run_ranks(all_cases, 3, 3, 2, RUNS_PP3, timeout_s=240)


@pytest.fixture(scope="module")
def pp2_dp2():
    from interleaved_cases import zero_cases

    return run_ranks(zero_cases, 4, 2, 2, 4, RUNS_ZERO, timeout_s=240)


def _predicted_peak(pipe, rank, virtual, micro):
    """Megatron-LM's warmup forwards plus the one forward of the steady state."""
    total = micro * virtual
    if micro == pipe:
        return total
    return min(2 * (pipe - rank - 1) + (virtual - 1) * pipe + 1, total)


def _check_parity(out, pipe, virtual, micro, optimizer):
    for rank, o in enumerate(out):
        r = o[(micro, optimizer)]
        assert r["n"][0] == r["n"][1] > 0, (rank, r)
        assert r["loss"] < 1e-5 and r["params"] < 1e-5, (rank, r)
        assert r["peak"] == _predicted_peak(pipe, rank, virtual, micro), (rank, r["peak"])


@pytest.mark.parametrize("micro,optimizer", RUNS_PP2)
def test_pp2_virtual2_matches_one_plain_process(pp2, micro, optimizer):
    _check_parity(pp2, 2, 2, micro, optimizer)


@pytest.mark.parametrize("micro,optimizer", RUNS_PP3)
def test_pp3_virtual2_matches_one_plain_process(pp3, micro, optimizer):
    """Three ranks: the previous and the next rank differ, and rank 2 feeds rank 0."""
    _check_parity(pp3, 3, 2, micro, optimizer)


@pytest.mark.parametrize("zero_level,optimizer", RUNS_ZERO)
def test_zero_inside_chunks_and_pipe_by_data_parallel(pp2_dp2, zero_level, optimizer):
    for rank, o in enumerate(pp2_dp2):
        r = o[(zero_level, optimizer)]
        assert r["n"][0] == r["n"][1] > 0, (rank, r)
        assert r["loss"] < 1e-5 and r["params"] < 1e-5, (rank, r)


def test_live_activations_below_gpipe(pp2):
    """M = 4, P = V = 2: Megatron-LM's order holds 5 and 3 chunk activations, GPipe 8."""
    peaks = [o[(4, "sgd")]["peak"] for o in pp2]
    assert peaks == [5, 3] and max(peaks) < 4 * 2, peaks


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_gpt_with_tied_embeddings_across_ranks(pp2, optimizer):
    for rank, o in enumerate(pp2):
        r = o[("gpt", optimizer)]
        assert r["ties"] == 1 and r["checked"] > 0, (rank, r)
        assert r["loss"] < 1e-5 and r["params"] < 1e-5, (rank, r)


def test_compute_spans_name_stage_chunk_and_micro_batch(pp2):
    for rank, o in enumerate(pp2):
        want = sorted(
            (f"stage{rank}.v{v}.mb{i}", phase)
            for v in range(2)
            for i in range(4)
            for phase in ("backward", "forward")
        )
        assert o[(4, "sgd")]["spans"] == want, rank


def test_p2p_bytes_are_the_activations_gradients_and_headers_sent(pp2):
    """Per step: each part's output (but the last's) once per micro-batch, with a header
    of 10 int64 before the first; each part's input gradient (but the first's)."""
    for rank, o in enumerate(pp2):
        r = o[(4, "sgd")]
        rows = BATCH // 4
        parts = [r["split"][v * 2 + rank] for v in range(2)]
        per_step = 0
        for part in parts:
            if part[-1] != 5:  # not the last part: its outputs
                per_step += 4 * rows * DIMS[part[-1] + 1] * 4 + 10 * 8
            if part[0] != 0:  # not the first part: its input's gradients
                per_step += 4 * rows * DIMS[part[0]] * 4
        assert r["p2p_bytes"] == STEPS * per_step, (rank, r["p2p_bytes"], per_step)


def test_a_micro_batch_count_not_a_multiple_of_pipe_size_is_refused(pp2):
    for o in pp2:
        assert "M=3 micro-batches is not a multiple of P=2" in o["bad micro"], o["bad micro"]
        assert "e.g. 4" in o["bad micro"] and "schedule='1f1b'" in o["bad micro"]


def test_a_lone_stage_is_refused_by_the_interleaved_schedule(pp2):
    for o in pp2:
        assert "stages_of(layers, virtual=V)" in o["lone stage"], o["lone stage"]


def _simulate(pipe, virtual, micro):
    """Runs every rank's order with sends that never wait and receives that wait for
    their message: the steps each rank completed, and its most activations held."""
    orders = [interleaved_order(pipe, p, virtual, micro) for p in range(pipe)]
    sends = [{key for _, key in sends_of(pipe, p, virtual, micro)} for p in range(pipe)]
    last = pipe * virtual - 1
    done, held, peak, sent = [0] * pipe, [0] * pipe, [0] * pipe, set()
    moved = True
    while moved:
        moved = False
        for p in range(pipe):
            for kind, i, v in orders[p][done[p] :]:
                part = v * pipe + p
                need = (
                    ("act", part - 1, i)
                    if kind == "f" and part > 0
                    else ("grad", part + 1, i)
                    if kind == "b" and part < last
                    else None
                )
                if need is not None and need not in sent:
                    break
                key = ("act" if kind == "f" else "grad", part, i)
                if key in sends[p]:  # a message this step sends
                    sent.add(key)
                held[p] += 1 if kind == "f" else -1
                peak[p] = max(peak[p], held[p])
                done[p] += 1
                moved = True
    return done, peak


@pytest.mark.parametrize(
    "pipe,virtual,micro",
    [(1, 3, 2), (2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 6), (4, 2, 8), (4, 3, 12)],
)
def test_order_runs_every_step_once_without_deadlock(pipe, virtual, micro):
    done, peak = _simulate(pipe, virtual, micro)
    assert done == [2 * micro * virtual] * pipe, done  # nobody waits forever
    for p in range(pipe):
        steps = interleaved_order(pipe, p, virtual, micro)
        assert sorted(steps) == sorted(
            (k, i, v) for k in "bf" for i in range(micro) for v in range(virtual)
        )
        assert peak[p] == _predicted_peak(pipe, p, virtual, micro), (p, peak)
