"""`nbtrain bench --dtype bf16`, `--compile` and `--mfu` run end to end at their tiniest
sizes on CPU ranks, print their tables, and read finite numbers.

No speed is asserted (timings on this shared machine are noise). What is asserted is
what each mode promises to compute: the bf16 recipes' model state and wire bytes
(deterministic), loss parity between the engines, the compile column, the MFU table's
rows and the FLOPs formula.
"""

import json
import math
import subprocess
import sys

from support.cli import run_cli
from test_bench_smoke import ENGINES, SHORT, _plain_losses

from nbtrain.bench import mfu


def _bench(tmp_path, *flags):
    """`nbtrain bench FLAGS --json FILE`, in this process: its JSON result and its stdout."""
    out = tmp_path / "bench.json"
    run = run_cli("bench", *flags, "--json", out)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text()), run.stdout


def _table_rows(stdout):
    return {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in stdout.splitlines()
        if line.startswith("| ")
    }


def test_bf16_bench_runs_each_engines_recipe(tmp_path):
    result, stdout = _bench(tmp_path, "--quick", "--ranks", "2", "--dtype", "bf16", *SHORT)
    assert result["settings"]["dtype"] == "bf16"
    assert set(result["runs"]) == ENGINES
    assert ", bf16, AdamW" in stdout, stdout
    for line in (
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
        "fp32 all-reduce hook",
        "AdamOptimizer fp32 master",
    ):
        assert line in stdout, stdout
    rows = _table_rows(stdout)
    assert ENGINES <= set(rows), stdout
    for name, run in result["runs"].items():
        assert run["parity"], (name, run["loss_max_abs_diff_vs_ddp"])
        assert all(math.isfinite(x) for x in run["losses"]), name
        assert math.isfinite(run["step_time_s"]) and run["state_bytes"] > 0, name
        assert "ok" in rows[name][-1], rows[name]
    runs = result["runs"]
    # Model state: FSDP2 (fp32 shards + fp32 grads + moments) and DDP (bf16 replica and
    # grads + fp32 masters + moments) hold the mixed-precision 16 B/param exactly;
    # nbtrain keeps the bf16 shard beside its fp32 main_grad and master: 18 B.
    assert abs(runs["fsdp2"]["state_bytes"] / runs["fsdp2"]["state_theory_bytes"] - 1) < 0.01
    assert abs(runs["ddp"]["state_bytes"] / runs["ddp"]["state_theory_bytes"] - 1) < 0.01
    z3 = runs["zero3"]["state_bytes"] / runs["zero3"]["state_theory_bytes"]
    assert abs(z3 - 18 / 16) < 0.01, z3
    # bf16 gathers and fp32 reductions, embeddings and head included: FSDP2's bytes
    fsdp2_wire = runs["fsdp2"]["wire_bytes_per_step"]
    assert abs(runs["zero3"]["wire_bytes_per_step"] / fsdp2_wire - 1) < 0.01, runs["zero3"]
    breakdown = runs["zero3"]["state_breakdown"]
    assert breakdown["optim"] >= 11 * breakdown["param"] / 2, breakdown  # fp32 master + m + v
    # The DDP hook all-reduces in fp32: exactly the fp32 ring count.
    assert abs(runs["ddp"]["wire_bytes_per_step"] / runs["ddp"]["wire_theory_bytes"] - 1) < 1e-6
    # bf16 really ran: near one fp32 process's losses, but not equal to the last digit
    settings = result["settings"]
    fp32 = _plain_losses(settings, rows=settings["batch_per_rank"] * 2)  # one fp32 process
    for name, run in runs.items():
        diffs = [abs(a - b) for a, b in zip(run["losses"], fp32)]
        assert 0 < max(diffs) < 1e-2, (name, run["losses"], fp32)


def test_compile_bench_compiles_every_engine(tmp_path):
    """aot_eager: dynamo's capture and AOTAutograd's joint graph, no code generation
    (inductor's C++ build takes minutes on two loaded cores); the same numbers as eager."""
    result, stdout = _bench(
        tmp_path, "--quick", "--ranks", "2", "--compile", "--compile-backend", "aot_eager", *SHORT
    )
    assert result["settings"]["compile"] == {"backend": "aot_eager"}
    assert "each layer compiled (backend aot_eager)" in stdout, stdout
    header = next(line for line in stdout.splitlines() if line.startswith("| engine"))
    assert "compile s" in header, header
    rows = _table_rows(stdout)
    for name, run in result["runs"].items():
        assert run["parity"], (name, run["loss_max_abs_diff_vs_ddp"])
        extra = run["first_step_extra_s"]
        assert len(extra) == 1 and math.isfinite(extra[0]), (name, extra)
        assert rows[name][2] == f"{extra[0]:.1f}-{extra[0]:.1f}", rows[name]


def test_mfu_bench_on_cpu_is_a_smoke_run(tmp_path):
    result, stdout = _bench(
        tmp_path, "--mfu", "--compile-backend", "aot_eager", "--steps", "2", "--warmup", "1"
    )
    engines = {"nbtrain", "torch", "torch_compile"} | (
        {"nbtrain_compile"} if mfu.nbtrain_compiles() else set()
    )
    assert set(result["runs"]) == engines
    assert result["settings"]["size"] == "tiny" and result["peak_tflops"] is None
    assert "no peak known for this device" in stdout, stdout
    assert "FLOPs/token = 6 N + 12 L d T" in stdout and "PaLM" in stdout, stdout
    rows = _table_rows(stdout)
    assert engines <= set(rows), stdout
    for name, run in result["runs"].items():
        assert rows[name][3] == "n/a", rows[name]  # no MFU without a peak
        for key in ("tokens_per_s", "tflops", "step_time_s"):
            assert math.isfinite(run[key]) and run[key] > 0, (name, key, run[key])
        assert all(math.isfinite(x) for x in run["loss"]), name
    # same weights, same batches: every engine starts from the same loss
    first = {round(r["loss"][0], 3) for r in result["runs"].values()}
    assert len(first) == 1, first
    assert set(result["ratios"]) >= {
        "nbtrain_tokens_per_s_vs_torch",
        "nbtrain_tokens_per_s_vs_torch_compile",
    }


def test_mfu_peaks_and_flops():
    assert mfu.peak_tflops("NVIDIA H200") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert mfu.peak_tflops("NVIDIA H100 NVL") is None  # other clocks: not guessed
    assert mfu.peak_tflops("NVIDIA A10G") is None and mfu.peak_tflops("cpu") is None
    cfg = mfu.config("1b")
    total, less_embedding = mfu.param_count(cfg)
    assert 1.0e9 < total < 1.1e9, total
    flops, text = mfu.flops_per_token(cfg, 2048)
    assert flops == 6 * less_embedding + 12 * 18 * 2048 * 2048
    assert "6.849 GFLOP" in text, text
    # 1B x 16 bytes of training state (+ bf16 copy) leaves room for activations on one GPU
    assert total * 18 < 20e9


def test_modes_refuse_what_they_do_not_run():
    def refused(*flags):
        run = run_cli("bench", *flags)
        assert run.returncode != 0, run.stdout
        return run.stderr

    # The first as the real command line (its exit status and stderr), the rest in-process.
    proc = subprocess.run(
        [sys.executable, "-m", "nbtrain.cli", "bench", "--ranks", "2", "--tp-size", "2"]
        + ["--dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0, proc.stdout
    assert "--dtype bf16: --mfu always runs bf16, and the --tp-size" in proc.stderr
    assert "--dtype bf16: --mfu always runs bf16, and the --tp-size" in refused(
        "--ranks", "2", "--tp-size", "2", "--dtype", "bf16"
    )
    assert "--dtype fp32: --mfu always runs bf16" in refused("--mfu", "--dtype", "fp32")
    assert "--compile is for the ZeRO/FSDP2/DDP comparison" in refused("--mfu", "--compile")
    import torch

    if not torch.cuda.is_available():  # the GPU check's refusal, read by tests/gpu/summary.py
        assert "needs a CUDA GPU and none is visible" in refused("--mfu", "--device", "cuda")
