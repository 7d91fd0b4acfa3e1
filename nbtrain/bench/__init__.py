"""`nbtrain bench`: nbtrain ZeRO-3 and ZeRO-2 against torch FSDP2 and DDP.

    nbtrain bench --ranks 2 --model-size small --steps 20 --json bench.json

One GPT (nbtrain.models) is trained by each engine on the same local ranks,
seed, batches and fp32 dtype policy, with torch.optim.AdamW. Engines run
interleaved: each round launches every engine once, in a rotating order, so a
load change on a shared machine hits all four alike. Each launch is a fresh set
of processes, so peak memory is that engine's alone. Reported per engine: median
step time after warm-up (slowest rank per step), peak memory per rank (RSS on
CPU, CUDA peak allocation on GPU), model-state bytes per rank and wire bytes per
step against the ZeRO theory, the hidden-comm percentage, and loss parity with
DDP over every step (a fast engine that computes something else cannot win).

`--dtype bf16` runs each engine's mixed-precision recipe instead (bf16 weights and
activations, fp32 gradient reduction, AdamW on fp32 master weights; see engines.py),
against the mixed-precision theory. `--compile` compiles each transformer layer the
same way for every engine and shows the compile time apart from the step times.

With `--tp-size T` it compares nbtrain's tensor parallelism with torch DTensor's
`parallelize_module` instead (see tp.py): step time, wire bytes against the Megatron
count, model state against 16 bytes x params / tp, and the loss difference. With
`--pipe-size P` it compares nbtrain's 1F1B pipeline with torch.distributed.pipelining's
(see pp.py): step time, the measured bubble against (P - 1) / (M + P - 1), and the
point-to-point bytes against the activation count.

With `--mfu` it trains a ~1B Llama at seq 2048 in bf16 on one device and reports
tokens/s and model FLOPs utilisation, nbtrain beside plain torch and torch.compile
(see mfu.py).

With `--moe` it times the MoE GPT (nbtrain.models.gpt_moe, experts over the ranks)
against the dense GPT of equal active parameters: tokens/s of both, parameters, the
all-to-all bytes and the router's balance (see moe.py). With `--ring` it times ring
attention over the ranks against its compute alone, its communication alone and one
rank's full-sequence attention: the share of its communication hidden (see ring.py).
"""

from __future__ import annotations

import argparse
import sys
import time

from ..comm.renamed import RenamedFlag
from ..launch import run_ranks
from . import pp as pp_bench
from . import report
from . import tp as tp_bench
from .engines import ENGINES, RECIPES
from .runs import write_json
from .worker import run_rank

__all__ = ["main", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbtrain bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--model-size", choices=("tiny", "small", "medium"), default="small")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per round")
    p.add_argument("--rounds", type=int, default=None, help="launches per engine")
    p.add_argument("--batch-per-rank", type=int, default=4, help="sequences per rank per step")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, few steps: a smoke run (under 3 minutes on 2 CPU ranks)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel size: compare nbtrain's tensor parallelism with "
        "DTensor parallelize_module (use --ranks equal to --tp-size)",
    )
    p.add_argument(
        "--pipe-size",
        type=int,
        default=1,
        help="pipeline stages: compare nbtrain's 1F1B pipeline with "
        "torch.distributed.pipelining (use --ranks equal to --pipe-size)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="peak memory per rank of building, training, saving and loading a "
        "~200 M-parameter GPT with ZeRO-3 against the theory and against FSDP2 "
        "(meta device + DCP) in the same run (--quick: 6 M)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="with --memory: also the path with wrap(offload=True) and "
        "AdamOffloadOptimizer (on a GPU, its device peaks)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="tokens/s of the MoE GPT (experts over the ranks, ZeRO-3) against the "
        "dense GPT of equal active parameters, all-to-all bytes, router balance",
    )
    p.add_argument(
        "--moe-chunks",
        type=int,
        default=1,
        help="with --moe: the MoE layers' pipelined chunks (MoE(chunks=); default 1)",
    )
    p.add_argument(
        "--ring",
        action="store_true",
        help="ring attention over the ranks (cp = world): its hidden-communication "
        "share, and its time against one rank's full-sequence SDPA",
    )
    p.add_argument(
        "--num-micro-batches",
        type=int,
        default=4,
        help="micro-batches per step with --pipe-size (default 4)",
    )
    for old, new in (
        ("--tp", "--tp-size"),
        ("--pp", "--pipe-size"),
        ("--micro-batches", "--num-micro-batches"),
    ):  # docs/naming.md
        p.add_argument(old, dest=new[2:].replace("-", "_"), type=int, action=RenamedFlag, new=new)
    p.add_argument(
        "--mfu",
        action="store_true",
        help="tokens/s and MFU of a ~1B Llama (seq 2048, bf16) at world 1 on one "
        "GPU: nbtrain beside plain torch and torch.compile (see mfu.py); on a "
        "CPU, or with --quick, a tiny Llama",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer layer, the same way for every engine "
        "(nbtrain: wrap(..., compile=); FSDP2 and DDP: each layer compiled "
        "before wrapping); the compile time is shown apart from step times",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled engines (default inductor; "
        "aot_eager checks the capture without generating code)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="with --mfu: the device's dense bf16 peak, where the built-in table does not know it",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rounds, one more launch per engine with rank 0's "
        "steps under torch.profiler: a table of where each engine's step "
        "time goes (matmuls, collectives, copies, optimizer, Python outside "
        "operators) and its top operators",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="fp32 (default), or bf16: bf16 weights and activations, fp32 "
        "gradient reduction and fp32 master weights in AdamW, each engine "
        "by its own recipe (printed in the header); --mfu is always bf16",
    )
    return p


def _settings(args) -> dict:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise SystemExit(
            f"--ranks {args.ranks} needs {args.ranks} GPUs; {torch.cuda.device_count()} visible"
        )
    quick = args.quick
    return {
        "device": device,
        "seed": args.seed,
        "batch_per_rank": args.batch_per_rank,
        "model_size": "tiny" if quick and args.model_size == "small" else args.model_size,
        "steps": args.steps or (4 if quick else 20),
        "warmup": args.warmup if args.warmup is not None else (2 if quick else 3),
        "rounds": args.rounds or (2 if quick else 3),
        "timeout_s": 300.0,
        "tp": args.tp_size,
        "pp": args.pipe_size,
        "micro_batches": args.num_micro_batches,
        "dtype": args.dtype or "fp32",
        "compile": {"backend": args.compile_backend} if args.compile else None,
        "profile": args.profile,
    }


def run(ranks: int, settings: dict, log=print) -> dict:
    """Runs every engine `settings["rounds"]` times, interleaved; returns the results."""
    tp, pp = settings.get("tp", 1), settings.get("pp", 1)
    names = tp_bench.TP_ENGINES if tp > 1 else pp_bench.PP_ENGINES if pp > 1 else ENGINES
    worker = pp_bench.run_rank if pp > 1 else run_rank
    rounds: dict[str, list] = {e: [] for e in names}
    for k in range(settings["rounds"]):
        order = names[k % len(names) :] + names[: k % len(names)]
        for engine in order:
            start = time.perf_counter()
            spec = {**settings, "engine": engine, "profile": False}
            backend = "nccl" if spec["device"] == "cuda" else "gloo"
            rounds[engine].append(
                run_ranks(
                    worker,
                    ranks,
                    spec,
                    seed=spec["seed"],
                    backend=backend,
                    timeout_s=spec["timeout_s"],
                )
            )
            log(
                f"round {k + 1}/{settings['rounds']} {engine}: {time.perf_counter() - start:.1f} s",
                file=sys.stderr,
            )
    profiles = {}
    if settings.get("profile") and tp == 1 and pp == 1:
        for engine in names:  # apart from the rounds: the profiler slows what it watches
            spec = {**settings, "engine": engine, "profile": True}
            backend = "nccl" if spec["device"] == "cuda" else "gloo"
            profiles[engine] = run_ranks(
                worker, ranks, spec, seed=spec["seed"], backend=backend, timeout_s=spec["timeout_s"]
            )[0]["profile"]
            log(f"profiled {engine}", file=sys.stderr)
    if pp > 1:
        return _pp_result(ranks, settings, rounds, names)
    if tp > 1:
        from ..models import GPTConfig

        cfg = GPTConfig.preset(settings["model_size"])
        runs = {
            e: report.summarize(
                e,
                rounds[e],
                ranks,
                tp_bench.theory(
                    cfg, settings["batch_per_rank"], tp, ranks // tp, rounds[e][0][0]["param_numel"]
                ),
            )
            for e in names
        }
        report.add_parity(runs, reference="dtensor_tp")
        return {
            "settings": {**settings, "ranks": ranks},
            "runs": runs,
            "ratios": report.tp_ratios(runs),
        }
    dtype = settings.get("dtype", "fp32")
    runs = {e: report.summarize(e, rounds[e], ranks, dtype=dtype) for e in names}
    report.add_parity(runs, dtype=dtype)
    return {
        "settings": {**settings, "ranks": ranks},
        "runs": runs,
        "ratios": report.ratios(runs),
        "profile": profiles,
    }


def _pp_result(ranks: int, settings: dict, rounds: dict, names) -> dict:
    import statistics

    cfg = pp_bench._config(settings)
    batch = settings["batch_per_rank"] * ranks
    runs = {}
    for e in names:
        th = pp_bench.theory(cfg, batch, settings["pp"], rounds[e][0][0]["param_numel"])
        runs[e] = report.summarize(e, rounds[e], ranks, th)
        bubbles = [b for r in rounds[e] for rank in r for b in rank["bubble"]]
        runs[e]["bubble"] = statistics.mean(bubbles) if bubbles else None
    report.add_parity(runs, reference="torch_pp")
    theory_bubble = pp_bench.bubble_theory(settings["pp"], settings["micro_batches"])
    ours, peer = runs["nbtrain_pp"], runs["torch_pp"]
    ratios = {
        "pp_step_vs_torch": ours["step_time_s"] / peer["step_time_s"],
        "pp_bubble_measured": ours["bubble"] if ours["bubble"] is not None else float("nan"),
        "pp_bubble_theory": theory_bubble,
        "torch_bubble_measured": peer["bubble"] if peer["bubble"] is not None else float("nan"),
        "pp_p2p_bytes_vs_activations": ours["wire_bytes_per_step"] / ours["wire_theory_bytes"],
        "torch_p2p_bytes_vs_activations": peer["wire_bytes_per_step"] / peer["wire_theory_bytes"],
        "pp_loss_max_abs_diff_vs_torch": ours["loss_max_abs_diff_vs_ddp"],
    }
    return {"settings": {**settings, "ranks": ranks}, "runs": runs, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ranks < 1:
        raise SystemExit(
            f"--ranks {args.ranks}: need at least 1 rank (1 measures the "
            "engines' own overhead on one device, no communication)"
        )
    tp, pp = args.tp_size, args.pipe_size
    if pp < 1 or (pp > 1 and args.ranks != pp) or (pp > 1 and tp > 1):
        raise SystemExit(
            f"--pipe-size {pp} with --ranks {args.ranks}: the pipeline "
            f"comparison runs one replica without tp, so use --ranks {max(pp, 1)}"
        )
    if tp < 1 or (tp > 1 and args.ranks != tp):
        raise SystemExit(
            f"--tp-size {tp} with --ranks {args.ranks}: the tensor-parallel "
            f"comparison runs one replica, so use --ranks {max(tp, 1)}"
        )
    if sum((args.memory, args.moe, args.ring, args.mfu)) > 1:
        raise SystemExit("--memory, --moe, --ring and --mfu are separate benchmarks: give one")
    others = args.memory or args.moe or args.ring or tp > 1 or pp > 1
    if (args.dtype == "bf16" and others) or (args.dtype == "fp32" and args.mfu):
        raise SystemExit(
            f"--dtype {args.dtype}: --mfu always runs bf16, and the --tp-size, "
            "--pipe-size, --memory, --moe and --ring modes run fp32; the "
            "ZeRO/FSDP2/DDP comparison runs either"
        )
    if args.compile and (others or args.mfu):
        raise SystemExit(
            "--compile is for the ZeRO/FSDP2/DDP comparison (--mfu always runs "
            "compiled engines beside eager ones)"
        )
    if args.profile and (others or args.mfu):
        raise SystemExit(
            "--profile is for the ZeRO/FSDP2/DDP comparison; drop it, or drop "
            "--memory/--moe/--ring/--mfu/--tp/--pp"
        )
    if args.mfu:
        from . import mfu

        return mfu.main(args)
    if args.memory:
        from . import memory

        return memory.main(args)
    if args.moe:
        from . import moe

        return moe.main(args)
    if args.ring:
        from . import ring

        return ring.main(args)
    settings = _settings(args)
    result = run(args.ranks, settings)
    s = result["settings"]
    split = f" (tp {tp})" if tp > 1 else ""
    split += f" (pp {pp}, {args.num_micro_batches} micro-batches)" if pp > 1 else ""
    print(
        f"nbtrain bench: {s['ranks']} ranks{split}, "
        f"{s['device']}, GPT {s['model_size']}, "
        f"{s['batch_per_rank']} seq/rank, {s['rounds']} rounds x {s['steps']} steps "
        f"(+{s['warmup']} warm-up), {s['dtype']}, AdamW"
        + (f", each layer compiled (backend {s['compile']['backend']})" if s["compile"] else "")
    )
    if s["dtype"] == "bf16":
        print(
            "bf16 recipes (bf16 weights and activations, fp32 gradient reduction, AdamW "
            "on fp32 masters; loss in fp32):"
        )
        for engine in result["runs"]:
            print(f"  {engine:<6} {RECIPES[engine]}")
    if s["compile"]:
        print(
            "compiled: nbtrain wrap(..., compile=) compiles each Block's module; FSDP2 and "
            "DDP get each layer as torch.compile(layer) before wrapping; compile s = the "
            "first warm-up step less the median step, lowest-highest over the launches "
            "(inductor's cache serves later launches)"
        )
    print(report.table(result["runs"], result["ratios"], compile_column=bool(s["compile"])))
    if result.get("profile"):
        from .profile import table as profile_table

        print()
        print(profile_table(result["profile"]))
    write_json(args.json, result)
    return 0 if all(r["parity"] for r in result["runs"].values()) else 1
