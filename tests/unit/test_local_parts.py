"""`python -m nbtrain.bench.local_parts` (a part of the GPU check) runs on the CPU at its
smoke size and prints the three ratio lines the GPU check's summary reads."""

import re
import subprocess
import sys
from pathlib import Path

from nbtrain.bench.local_parts import main

SUMMARY = Path(__file__).resolve().parents[1] / "gpu" / "summary.py"


def test_local_parts_print_their_ratios(capsys):
    assert main(["--device", "cpu", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    for key in ("experts_grouped_vs_loop", "moe_layer_vs_dense_mlp", "ring_block_vs_sdpa"):
        (value,) = re.findall(rf"^{key}: ([\d.]+)$", out, re.M)
        assert float(value) > 0, out


def test_the_gpu_summary_reads_them(tmp_path):
    (tmp_path / "local.log").write_text(
        "experts_grouped_vs_loop: 0.500\nring_block_vs_sdpa: 1.100\n"
    )
    (tmp_path / "parts.tsv").write_text(
        "local\t0\t45\t0\t20\tpython3 -m nbtrain.bench.local_parts\n"
    )
    summary = subprocess.run(
        [sys.executable, str(SUMMARY), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "experts_grouped_vs_loop: 0.500" in summary and "ring_block_vs_sdpa: 1.100" in summary
