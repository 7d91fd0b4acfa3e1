"""Every tutorial's and research notebook's rank code runs at world sizes 1 and 3.

The world sizes are the ones that can differ: 1, where every shard is the whole
buffer and nothing is communicated, and 3, which divides no power of two, so buffers
are padded and batches split unevenly. World 2 is the notebooks' own: CI executes each
of them on a 2-rank cluster (`pytest --nbval-lax tutorials notebooks`), and the
gpu-marked variant below runs 1 and 2 ranks on NCCL where two GPUs are present.

The code is taken from the notebooks themselves: each `%%distributed` cell (its first
line, the magic and its flags, dropped), and the script tutorial 05 writes with
`%%writefile`. A `%nbtrain start` in a notebook-side cell opens a new session. Each
session runs on real gloo ranks (`nbtrain.launch.run_ranks`) in one namespace per
rank holding `torch` and `nbt`, as an engine's does. To keep it cheap, `range` in
that namespace yields at most STEPS items, so every loop runs a few steps; every
line still runs. Where a model's size (or a library loop's length) is the
tutorial's point and not this test's, SHRINK rewrites it smaller in the test's
copy of the code; the notebooks run as written under nbval.

What must hold at every world size is checked against the other world sizes: the
global batch is the same, so the losses a notebook prints must agree (a tutorial
that slices `rank() * 8` rows by hand trains on 8 rows at world 1 and on 16 at
world 2; `test_a_hard_coded_per_rank_slice_is_caught` shows it fails). A tutorial
whose global batch does not divide by 3 fails with the sampler's error. A static
check also rejects rank() inside a subscript and a rank taking the global batch.
`tutorials/06_kernels.ipynb` has no rank code (it runs in the notebook's own
process); the test fails if a tutorial appears that is neither run here nor
listed as rank-free. On a GPU machine the gpu-marked variant runs the same code
on NCCL, one GPU per rank.
"""

from __future__ import annotations

import builtins
import json
import math
import re
import shlex
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from support.ranks import run_ranks

import nbtrain

ROOT = Path(__file__).resolve().parents[2]
# Every range() in rank code yields at most STEPS items. Not fewer: tutorial 03 times
# the steps after `warmup=3`, 07 and 09 build and name their 4 layers with `range`,
# 12's `tokens_per_s` starts its clock at `step == 2`, and after 2 steps the losses
# are still near ln(256) whatever rows a rank trains on (tutorial 07 with a hard-coded
# slice then agrees across world sizes within RTOL, and
# test_a_hard_coded_per_rank_slice_is_caught fails).
STEPS = 4
WORLDS = (1, 3)
RTOL = 1e-4  # losses at different world sizes: reduction order only
RANK_FREE = {"tutorials/06_kernels.ipynb"}  # no %%distributed cell, no script
PER_RANK = {"tutorials/03_overlap.ipynb"}  # results are timings: ranks differ
# Smaller models, and fewer steps in library loops `range` does not reach, where the
# size is the tutorial's point, not this test's: the world sizes must agree whatever
# the width, depth or length. Each (as written, here) pair must match the notebook's
# code. The notebooks themselves run as written in the tutorials' own execution
# (tutorials/, nbval), their budget assertions included. Seconds are CPU seconds of
# the test, world sizes 1 and 3 together, on a 2-core machine.
SHRINK = {
    # 38 M parameters is the tutorial's point (a model that needs ZeRO-3 to fit); the
    # build, train, save, reload and background checkpoint are the same code at 0.12 M
    # (7-11 s at full width, 1.5 here)
    "tutorials/11_a_model_that_does_not_fit.ipynb": (
        ("hidden=512, heads=8, layers=12", "hidden=64, heads=4, layers=2"),
    ),
    # the check counts 4 layers (ZeRO-2's gathered blocks), so only the width and the
    # sequence shrink: 3.3 M parameters, 0.22 M here (3.1 s, 1.0)
    "tutorials/02_zero_levels_and_memory.ipynb": (
        ('GPTConfig.preset("small")', 'GPTConfig.preset("small", hidden=64, heads=4, seq_len=32)'),
    ),
    # timings are printed, not compared; 3 blocks still prefetch one another (4.6 s, 1.4)
    "tutorials/03_overlap.ipynb": (
        (
            "GPTConfig(hidden=192, heads=6, layers=6, seq_len=64)",
            "GPTConfig(hidden=48, heads=6, layers=3, seq_len=64)",
        ),
    ),
    # a research run's width; its loop, validation, sampling and checkpoint are the
    # same code at 47 k parameters (3.1 s, 1.7)
    "notebooks/pretraining.ipynb": (
        (
            "GPTConfig(hidden=96, heads=4, layers=3, seq_len=64)",
            "GPTConfig(hidden=32, heads=4, layers=3, seq_len=32)",
        ),
    ),
    # `compare` loops inside the library, where `range` is not capped: 2 steps, one on
    # each of its 2 batches; context parallelism splits rows of 96 tokens, not 384,
    # into 2 x cp chunks (6.3 s, 3.9)
    "tutorials/12_experts_and_long_sequences.ipynb": (
        ("parallel), steps=10,", "parallel), steps=2,"),
        ("seq_len=384,", "seq_len=96,"),
    ),
}


def _shrunk(rel: str):
    """The patch that applies `rel`'s SHRINK pairs to each cell (None: as written)."""
    if rel not in SHRINK:
        return None
    code = [c for cells in sessions(ROOT / rel) for _, c in cells]
    for old, _ in SHRINK[rel]:
        assert any(old in c for c in code), (rel, old)

    def patch(code: str) -> str:
        for old, new in SHRINK[rel]:
            code = code.replace(old, new)
        return code

    return patch


def _source(cell) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def _targets(magic_line: str) -> str | None:
    args = shlex.split(magic_line)[1:]
    for i, arg in enumerate(args):
        if arg in ("-t", "--targets"):
            return args[i + 1]
        if arg.startswith("--targets="):
            return arg.partition("=")[2]
    return None


def sessions(path: Path) -> list[list[tuple[str | None, str]]]:
    """The rank code of a notebook: a list of sessions, each a list of
    (targets or None for every rank, cell source).

    A `%%writefile` cell holding a script that calls `init_distributed` is a session
    of its own (run as the script would be under torchrun).
    """
    out, current = [], []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = _source(cell)
        first, _, body = src.partition("\n")
        if first.startswith("%%distributed"):
            current.append((_targets(first), body))
        elif first.startswith("%%writefile") and "init_distributed" in body:
            out.append([(None, body)])
        elif re.search(r"^%nbtrain (re)?start\b", src, re.M) and current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def _capped_range(*args):
    r = builtins.range(*args)
    return r[:STEPS]


def _plain(value):
    """A value that travels by torch.save without dragging tensors on a device."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _run_session(cells: list[tuple], results: list[str], tmp: str, argv: list[str]):
    """On every rank: the cells in order in one namespace, then `results` evaluated
    (every rank evaluates them: they may be collective)."""
    from nbtrain.notebook.targets import select_ranks

    tempfile.tempdir = tmp  # the notebooks' checkpoints and scripts stay in this test's folder
    sys.argv = argv
    ns = {"__name__": "__main__", "torch": torch, "nbt": nbtrain, "range": _capped_range}
    for i, (targets, code) in enumerate(cells):
        if targets is not None:
            try:
                ranks = select_ranks(targets, nbtrain.world_size())
            except ValueError:  # `-t 1` at world 1: a rank the notebook's 2 have, not here
                continue
            if nbtrain.rank() not in ranks:
                continue
        exec(compile(code, f"<cell {i}>", "exec"), ns)
    return {expr: _plain(eval(expr, ns)) for expr in results}


def run_notebook(
    rel: str,
    worlds: tuple[int, ...],
    tmp: Path,
    results: list[list[str]],
    patch=None,
    ranks_agree: bool = True,
    backend: str = "gloo",
) -> list[dict]:
    """Each session of `rel` on `worlds[i]` ranks; rank 0's results per session.

    `results[i]` names the expressions evaluated after session i; with
    `ranks_agree` every rank must get the same values (not so for timings).
    `patch` rewrites each cell's source (used to show the test catches a
    hard-coded slice). gloo ranks compute on the CPU even where CUDA is present.
    """
    code = sessions(ROOT / rel)
    tmp.mkdir(parents=True, exist_ok=True)
    assert len(code) == len(results) == len(worlds), (rel, len(code))
    out = []
    for i, (cells, exprs, world) in enumerate(zip(code, results, worlds)):
        if patch is not None:
            cells = [(t, patch(c)) for t, c in cells]
        script = len(cells) == 1 and "sys.argv" in cells[0][1]
        argv = ["train.py", str(tmp / "run")] if script else ["-"]
        by_rank = run_ranks(
            _run_session, world, cells, exprs, str(tmp), argv, timeout_s=240, backend=backend
        )
        for r, got in enumerate(by_rank[1:] if ranks_agree else [], 1):
            assert _close(got, by_rank[0]), (rel, i, r, got, by_rank[0])
        out.append(by_rank[0])
    return out


def _close(a, b, rtol=RTOL) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rtol) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.isfinite(a) and math.isclose(a, b, rel_tol=rtol, abs_tol=1e-6)
    return a == b


def _agree(name: str, runs: dict[int, object], rtol=RTOL):
    base = runs[WORLDS[0]]
    for world, got in runs.items():
        assert _close(got, base, rtol), (
            f"{name}: world {world} gives {got}, world {WORLDS[0]} {base}"
        )


# notebook -> (results per session, check(results by world))
def _check_losses(*names):
    def check(by_world):
        for name in names:
            _agree(name, {w: r[-1][name] for w, r in by_world.items()})

    return check


def _check_tp(by_world):
    for name in ("losses", "fresh.loss(x, y).item()"):
        _agree(name, {w: r[0][name] for w, r in by_world.items()})
    _agree("zero_losses", {w: r[1]["zero_losses"] for w, r in by_world.items()})


def _check_memory(by_world):
    for world, (r,) in by_world.items():
        res = r["results"]
        ddp = res["ddp"]["model_state_bytes"]
        full = res["ddp"]["parameter_bytes"]["full"]
        assert res["ddp"]["parameter_bytes"]["resident"] == full, (world, res["ddp"])
        for engine in ("zero2", "zero3"):  # 16 P / N, plus padding to a multiple of N
            ratio = res[engine]["model_state_bytes"] * world / ddp
            assert 0.99 < ratio < 1.01, (world, engine, ratio)
            params = res[engine]["parameter_bytes"]
            assert params["full"] == full and params["gathered"] == 0, (world, engine, params)
            assert 1.0 <= params["resident"] * world / full < 1.01, (world, engine, params)
        layers = 4  # the small preset: ZeRO-2 keeps all of them until backward
        # One rank's shard is the whole buffer: nothing is ever gathered.
        many = world > 1
        assert res["zero3"]["gathered_blocks_peak"] == (min(2, layers) if many else 0), (
            world,
            res["zero3"],
        )
        assert res["zero2"]["gathered_blocks_peak"] == (layers if many else 0), (
            world,
            res["zero2"],
        )
        assert res["ddp"]["gathered_blocks_peak"] == 0, (world, res["ddp"])


def _check_overlap(by_world):
    for world, (r,) in by_world.items():
        for name, res in r["results"].items():
            assert math.isfinite(res["step_ms"]) and 0.0 <= res["hidden"] <= 1.0, (world, name, res)
            assert res["timeline"]["compute"], (world, name)
            # one rank: its blocks communicate nothing (their shards are whole)
            assert bool(res["timeline"]["comm"]) == (world > 1), (world, name)


def _check_reload(by_world):
    """The same losses at every world size, and the reloaded model computes exactly what
    the trained one did (the model is initialised world-size-independently)."""
    _check_losses("losses", "trained_loss")(by_world)
    for world, (r,) in by_world.items():
        assert r["reloaded_loss"] == r["trained_loss"], (world, r)


def _check_resume(by_world):
    _agree("reference", {w: r[0]["reference"] for w, r in by_world.items()})
    for world, (first, second) in by_world.items():  # resharded W -> W % 3 + 1 ranks
        assert _close(second["resumed"][: len(first["reference"])], first["reference"]), (
            world,
            first,
            second,
        )


NOTEBOOKS = {
    "tutorials/01_quickstart.ipynb": (
        [["before", "after", "step"]],
        _check_losses("before", "after"),
    ),
    "tutorials/02_zero_levels_and_memory.ipynb": ([["results"]], _check_memory),
    "tutorials/03_overlap.ipynb": ([["results"]], _check_overlap),
    "tutorials/04_checkpoints_and_resume.ipynb": ([["reference"], ["resumed"]], _check_resume),
    "tutorials/05_notebook_to_script.ipynb": (
        [["nbt.sum_loss(loss).item()"]],
        _check_losses("nbt.sum_loss(loss).item()"),
    ),
    "tutorials/07_migrating_from_bmtrain.ipynb": (
        [["bmt.sum_loss(loss).item()"]],
        _check_losses("bmt.sum_loss(loss).item()"),
    ),
    "notebooks/pretraining.ipynb": ([["val_loss()", "step"]], _check_losses("val_loss()", "step")),
    # tp = the world size, so 1 and 3 (and the notebook's 2) are tensor-parallel layouts
    # of one model; pipe_size = the world size: 1 and 3 stages of one model
    "tutorials/09_pipeline_parallelism.ipynb": (
        [["losses", "plain_losses", "block_losses"]],
        _check_losses("losses", "plain_losses", "block_losses"),
    ),
    # (the second session: tp x dp with ZeRO-3 in the notebook, ZeRO-3 data parallel here)
    "tutorials/08_tensor_parallelism.ipynb": (
        [["losses", "fresh.loss(x, y).item()"], ["zero_losses"]],
        _check_tp,
    ),
    # built on the meta device, trained, saved, reloaded, checkpointed in the background
    "tutorials/11_a_model_that_does_not_fit.ipynb": (
        [["losses", "trained_loss", "reloaded_loss"]],
        _check_reload,
    ),
    # ep_size and cp_size = the world size: 1 and 3 ranks hold the 6 experts, and split
    # each row (96 tokens here, see SHRINK) into 2 x cp chunks; the cells assert the
    # all-to-all and ring bytes against the routing and the theory, and each layout
    # against one process
    "tutorials/12_experts_and_long_sequences.ipynb": (
        [["balance", "moe_losses", "one_losses", "cp_losses", "whole_row_losses"]],
        _check_losses("balance", "moe_losses", "one_losses", "cp_losses", "whole_row_losses"),
    ),
}
# Rank code that cannot run at 1 and 3 ranks, and what covers it instead. Tutorial 10's
# rank code imports the package its %%writefile cells write into a folder the notebook
# pushes, and its layouts are tp 2, dp 2 and pp 2 (an even world); the runtime takes
# each rank's rows itself (tests/multirank/test_runtime.py at 2 and 4 ranks), and CI
# executes the notebook at 2 ranks (pytest --nbval-lax tutorials).
# Tutorial 13's cells fail on rank 1 on purpose (a NaN, then an error for the post-mortem)
# and its loops take 2 of 4 rows per rank (2 ranks); the instruments are tested in
# test_locate_divergence.py and test_nonfinite_origin.py, and CI executes the notebook
# at 2 ranks.
# Tutorial 14's rank code is `from_pretrained` with LoRA, training and `save_pretrained`,
# compared with PEFT on one process at world 2 and 3 in test_hf_auto.py; its batch rows
# follow the world size, and CI executes the notebook at 2 ranks.
ELSEWHERE = {
    "tutorials/10_runtime_and_your_own_model.ipynb",
    "tutorials/13_when_a_run_goes_wrong.ipynb",
    "tutorials/14_fine_tune_a_hugging_face_model.ipynb",
}
# Tensor and pipeline parallelism split layers, not data: every rank takes the global batch.
# Tutorial 12's context parallelism splits every row of one batch over all ranks (each
# reads it whole and keeps its part), and its one-process references take it whole too.
WHOLE_BATCH = {
    "tutorials/08_tensor_parallelism.ipynb",
    "tutorials/09_pipeline_parallelism.ipynb",
    "tutorials/12_experts_and_long_sequences.ipynb",
}


def test_every_tutorial_is_run_here_or_has_no_rank_code():
    found = {
        str(p.relative_to(ROOT))
        for d in ("tutorials", "notebooks")
        for p in (ROOT / d).glob("*.ipynb")
    }
    for rel in sorted(found - set(NOTEBOOKS)):
        if rel in RANK_FREE:
            assert sessions(ROOT / rel) == [], f"{rel} has rank code now: add it to NOTEBOOKS"
        elif rel in ELSEWHERE:
            assert sessions(ROOT / rel), f"{rel}: no rank code found"
        elif rel != "notebooks/benchmark.ipynb":  # runs `nbtrain bench`, tested in test_bench_smoke
            pytest.fail(f"{rel} is not run at world sizes 1 and 3: add it to NOTEBOOKS")
    for rel in NOTEBOOKS:
        assert sessions(ROOT / rel), f"{rel}: no rank code found"


@pytest.mark.parametrize("rel", list(NOTEBOOKS))
def test_rank_code_runs_at_world_sizes_1_and_3(rel, tmp_path):
    results, check = NOTEBOOKS[rel]
    by_world = {}
    for world in WORLDS:
        # a second session resumes the first one's checkpoint resharded: 1 -> 2, 3 -> 1
        worlds = (world,) if len(results) == 1 else (world, world % 3 + 1)
        by_world[world] = run_notebook(
            rel,
            worlds,
            tmp_path / f"w{world}",
            results,
            patch=_shrunk(rel),
            ranks_agree=rel not in PER_RANK,
        )
    check(by_world)


HARD_CODED = "(t[nbt.rank() * 8:(nbt.rank() + 1) * 8] for t in sampler.batch(step))"


def test_a_hard_coded_per_rank_slice_is_caught(tmp_path):
    """What the world-size test catches: tutorial 07 with `rank() * 8` rows of the
    24-row batch instead of `local_batch` trains on 8 rows at world 1 and 16 at
    world 2, so its losses disagree."""
    rel = "tutorials/07_migrating_from_bmtrain.ipynb"
    original = "x, y = sampler.local_batch(step)"
    assert any(original in code for _, code in sessions(ROOT / rel)[0])
    patch = lambda code: code.replace(original, "x, y = " + HARD_CODED)  # noqa: E731
    results, check = NOTEBOOKS[rel]
    by_world = {
        w: run_notebook(rel, (w,), tmp_path / f"w{w}", results, patch=patch) for w in (1, 2)
    }
    with pytest.raises(AssertionError, match="world 2 gives"):
        check(by_world)
    assert static_problems(patch(original))  # and the static check names it


def static_problems(code: str) -> list[str]:
    """Per-rank slices taken by hand: rank() inside a subscript, or the global batch
    (`.batch(`) of a sampler where `local_batch` gives this rank's rows on its device."""
    out = []
    for line in code.splitlines():
        if re.search(r"[\w)\]]\[[^\]]*rank\(\)", line):  # x[... rank() ...], not [rank()]
            out.append(f"slices by rank(): {line.strip()}")
        if re.search(r"\bsampler\.batch\(|\b(train|val)\.batch\(", line):
            out.append(f"global batch on a rank: {line.strip()}")
    return out


@pytest.mark.parametrize("rel", list(NOTEBOOKS))
def test_rank_code_takes_its_rows_from_local_batch(rel):
    code = [c for session in sessions(ROOT / rel) for _, c in session]
    problems = [
        p
        for c in code
        for p in static_problems(c)
        if not (rel in WHOLE_BATCH and p.startswith("global batch on a rank"))
    ]
    assert not problems, f"{rel}: " + "; ".join(problems)
    if any("BatchSampler(" in c for c in code) and rel not in WHOLE_BATCH:
        assert any(".local_batch(" in c for c in code), rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rel", list(NOTEBOOKS))
def test_rank_code_runs_on_gpus(rel, tmp_path):
    """The same rank code on NCCL, one GPU per rank, at every world size the GPUs
    allow, up to 3 (the CPU test above covers 1 and 3 ranks over gloo)."""
    results, check = NOTEBOOKS[rel]
    by_world = {}
    for world in range(1, min(torch.cuda.device_count(), 3) + 1):
        by_world[world] = run_notebook(
            rel,
            (world,) * len(results),
            tmp_path / f"w{world}",
            results,
            ranks_agree=rel not in PER_RANK,
            backend="nccl",
        )
    check(by_world)
