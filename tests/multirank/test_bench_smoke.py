"""`nbtrain bench --quick` runs end to end and the four engines' losses agree.

Timings are not asserted: this machine is shared and they are noise here. The
benchmark's speed and memory claims are numbers it prints, not test outcomes.
"""

import json
import subprocess
import sys

from support.cli import run_cli

ENGINES = {"zero3", "zero2", "fsdp2", "ddp"}
# One launch per engine of 1 warm-up and 2 timed steps (--quick alone: 2 rounds of 2 + 4):
# three losses still differ step to step and compare every engine's training, and each
# launch's cost is its start, not its steps.
SHORT = ("--rounds", "1", "--steps", "2", "--warmup", "1")


def _quick_bench(tmp_path, *flags):
    """`nbtrain bench --quick --ranks 2 FLAGS`, in this process: its JSON and its stdout."""
    out = tmp_path / "bench.json"
    run = run_cli("bench", "--quick", "--ranks", "2", *flags, "--json", out)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text()), run.stdout


def test_quick_bench_runs_and_losses_agree(tmp_path):
    result, stdout = _quick_bench(tmp_path, "--profile", *SHORT)
    assert set(result["runs"]) == ENGINES
    for name, run in result["runs"].items():
        assert run["parity"], (name, run["loss_max_abs_diff_vs_ddp"])
        assert len(run["losses"]) == result["settings"]["warmup"] + result["settings"]["steps"]
        assert run["step_time_s"] > 0 and run["state_bytes"] > 0, name
        assert run["wire_bytes_per_step"] > 0, name
    # Parity must compare real training, not four copies of one number.
    losses = result["runs"]["ddp"]["losses"]
    assert len({round(x, 6) for x in losses}) > 1
    assert set(result["ratios"]) == {
        "zero3_step_vs_fsdp2",
        "zero3_step_vs_ddp",
        "zero3_state_mem_vs_theory",
        "zero3_bytes_vs_theory",
    }
    assert "zero3" in stdout and "hidden %" in stdout
    # --profile: one more launch per engine under torch.profiler, a table per kind
    assert set(result["profile"]) == ENGINES and "where the time goes" in stdout
    for name, prof in result["profile"].items():
        kinds = prof["kinds_ms"]
        assert kinds["matmul"] > 0 and prof["step_ms"] > 0, (name, kinds)
        assert 0 <= kinds["outside ops"] < prof["step_ms"], (name, kinds)
        assert prof["top"], name
    assert result["profile"]["ddp"]["kinds_ms"]["collectives"] > 0  # its bucket all-reduce


def _plain_losses(settings, tie=True, rows=None):
    """The same GPT, batches and AdamW on one process (tp 1, dp 1)."""
    import torch
    import torch.nn.functional as F

    from nbtrain.bench.engines import plain_gpt
    from nbtrain.bench.worker import batches
    from nbtrain.models import GPTConfig

    cfg = GPTConfig.preset(settings["model_size"], tie_embeddings=tie)
    model = plain_gpt(cfg, settings["seed"], "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    total = settings["warmup"] + settings["steps"]
    xs, ys = batches(cfg, total, rows or settings["batch_per_rank"], 1, settings["seed"])
    losses = []
    for step in range(total):
        opt.zero_grad()
        logits = model(xs[step])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys[step].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_quick_tp_bench_against_dtensor(tmp_path):
    result, stdout = _quick_bench(tmp_path, "--tp-size", "2", *SHORT)
    assert set(result["runs"]) == {"nbtrain_tp", "dtensor_tp"}
    ratios = result["ratios"]
    # Both engines move what the Megatron count says, and nbtrain holds 16 B/param / tp.
    assert abs(ratios["tp_bytes_vs_megatron"] - 1) < 0.05, ratios
    assert abs(ratios["dtensor_bytes_vs_megatron"] - 1) < 0.05, ratios
    assert abs(ratios["tp_state_mem_vs_theory"] - 1) < 0.05, ratios
    assert ratios["tp_loss_max_abs_diff_vs_dtensor"] < 1e-5, ratios
    # ... and both train what one plain process trains.
    plain = _plain_losses(result["settings"])
    for name, run in result["runs"].items():
        assert max(abs(a - b) for a, b in zip(run["losses"], plain)) < 1e-4, name
    assert len({round(x, 6) for x in plain}) > 1
    assert "tp_step_vs_dtensor" in stdout


def test_tp_bench_needs_one_replica():
    proc = subprocess.run(
        [sys.executable, "-m", "nbtrain.cli", "bench", "--ranks", "4", "--tp-size", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "--tp-size 2 with --ranks 4: the tensor-parallel comparison runs one replica, so "
        "use --ranks 2" in proc.stderr
    ), proc.stderr


def test_quick_pp_bench_against_torch_pipelining(tmp_path):
    result, stdout = _quick_bench(tmp_path, "--pipe-size", "2", *SHORT)
    assert set(result["runs"]) == {"nbtrain_pp", "torch_pp"}
    ratios = result["ratios"]
    # every activation and gradient crosses the link once, nothing else
    assert abs(ratios["pp_p2p_bytes_vs_activations"] - 1) < 0.01, ratios
    assert abs(ratios["torch_p2p_bytes_vs_activations"] - 1) < 0.01, ratios
    assert 0 < ratios["pp_bubble_measured"] < 1 and ratios["pp_bubble_theory"] == 0.2, ratios
    assert 0 < ratios["torch_bubble_measured"] < 1, ratios  # the same measure, torch's chunks
    # both train what one plain process trains on the whole batch
    settings = result["settings"]
    plain = _plain_losses(settings, tie=False, rows=settings["batch_per_rank"] * 2)
    for name, run in result["runs"].items():
        assert max(abs(a - b) for a, b in zip(run["losses"], plain)) < 1e-4, name
    assert "pp_step_vs_torch" in stdout


def test_memory_bench_runs_and_measures_the_paths(tmp_path):
    """`nbtrain bench --memory --quick --offload`: a 6 M-parameter GPT built from the meta device
    stays near its shard (the naive build holds the whole model first), training near
    16P/N, and the save and load phases are measured, and so are FSDP2's. Memory, unlike
    time, is deterministic enough to bound here."""
    result, stdout = _quick_bench(tmp_path, "--memory", "--offload")
    ratios = result["ratios"]
    assert "GPT of 6.4 M parameters" in stdout and "meta   build" in stdout, stdout
    assert ratios["meta_build_vs_theory"] < 1.2, ratios
    assert ratios["meta_load_vs_theory"] < 1.3, ratios
    assert ratios["naive_build_vs_meta_build"] > 1.6, ratios  # the whole model, then shards
    for phase in ("meta_train", "meta_save", "whole_build", "offload_build", "offload_train"):
        assert ratios[f"{phase}_vs_theory"] > 0, ratios
    # On a CPU the offloaded shards live where the resident ones do: the same peaks.
    assert 0.8 < ratios["offload_train_vs_meta_train"] < 1.25, ratios
    # The FSDP2 peer (meta device, fully_shard, to_empty, DCP) measured phase by phase,
    # with nbtrain's peak over its peak; no bounds on either side's memory here.
    for phase in ("build", "train", "save", "load"):
        assert f"fsdp2  {phase}" in stdout, stdout
        for key in (f"fsdp2_{phase}_vs_theory", f"meta_{phase}_vs_fsdp2"):
            assert isinstance(ratios[key], float) and f"{key}:" in stdout, (key, ratios)
    assert "not measured" not in stdout and "nbtrain/FSDP2" in stdout, stdout
    for rank in result["result"]["fsdp2"]:
        assert rank["load_matches_save"], rank  # the fresh model read what was saved
        assert rank["shard"] > 0 and rank["build"][0] > 0, rank


def test_quick_moe_bench_against_the_dense_gpt(tmp_path):
    """`nbtrain bench --moe --quick`: the MoE GPT and the dense GPT of equal active
    parameters both train; the tokens moved by the all-to-all and the routing are read."""
    result, stdout = _quick_bench(tmp_path, "--moe", *SHORT[2:])
    assert set(result["runs"]) == {"moe", "dense"}
    ratios = result["ratios"]
    assert set(ratios) == {
        "moe_tokens_per_s_vs_dense",
        "moe_total_params_vs_dense",
        "moe_active_params_vs_dense",
        "moe_wire_bytes_vs_dense",
        "moe_router_balance_mean",
    }
    # equal active parameters (the dense MLP's biases, the router: well under 1%)
    assert abs(ratios["moe_active_params_vs_dense"] - 1) < 0.01, ratios
    assert ratios["moe_total_params_vs_dense"] > 1.4, ratios  # 4 experts, top-2
    assert ratios["moe_router_balance_mean"] >= 1.0 and ratios["moe_tokens_per_s_vs_dense"] > 0
    moe, dense = result["runs"]["moe"], result["runs"]["dense"]
    assert moe["all_to_all_bytes_per_step"] > 0 and dense["all_to_all_bytes_per_step"] == 0
    assert len(moe["step_times_s"]) == result["settings"]["steps"]
    assert set(result["routing"]) == {"moe.0", "moe.1"}
    for line in ("moe_tokens_per_s_vs_dense", "router balance", "tokens/s"):
        assert line in stdout, stdout


def test_quick_ring_bench_measures_the_hidden_share(tmp_path):
    """`nbtrain bench --ring --quick`: ring attention is exact against full-sequence SDPA,
    and its time is split into compute and communication."""
    result, stdout = _quick_bench(tmp_path, "--ring")
    assert set(result["median_s"]) == {"ring", "compute", "comm", "sdpa"}
    assert all(t > 0 for t in result["median_s"].values()), result["median_s"]
    assert result["max_abs_diff_vs_sdpa"] < 1e-4
    # cp 2, causal zigzag: K/V passed once forward (the backward keeps it), dK/dV
    # (float32) once, to its owner; one of each two is half a block (only rank 0's
    # early chunk is read by rank 1): 3/4 of two blocks on each rank
    s = result["settings"]
    kv = 2 * s["batch"] * s["heads"] * (s["seq"] // 2) * s["head_dim"] * 4
    assert result["p2p_bytes_per_call"] == 3 * kv // 2, result["p2p_bytes_per_call"]
    assert "goal ring_vs_full_sdpa <= 0.55 at cp 2" in stdout, stdout
    ratios = result["ratios"]
    assert 0 <= ratios["ring_hidden_comm_share"] <= 1, ratios
    assert ratios["ideal_vs_full_sdpa"] == 0.5
    for key in ("ring_vs_full_sdpa", "ring_vs_compute_only", "comm_only_vs_compute_only"):
        assert ratios[key] > 0 and f"{key}:" in stdout, key
    assert "ring_hidden_comm_share:" in stdout and "compute only" in stdout, stdout
