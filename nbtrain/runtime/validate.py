"""`nbtrain validate`: a parallel layout against the reference, step by step.

    nbtrain validate --ranks 2 --tp-size 2 --steps 5
    nbtrain validate --ranks 2 --pipe-size 2 --num-micro-batches 2 --optimizer sgd
    nbtrain validate --ranks 2 --tp-size 2 --model llama --hf-path path/to/qwen2-folder

Launches local ranks (gloo on CPU, nccl with GPUs, as `nbtrain demo` does), trains the
reference and the "nbtrain" backend at the given layout on the same synthetic packed
batches (random documents, seeded), prints the per-step loss and gradient norm of both
with the largest deviation, and exits with 1 when a deviation exceeds --tolerance.

The flags have the Python names (docs/naming.md); the old --tp, --pp and
--micro-batches still work, with a FutureWarning.
"""

from __future__ import annotations

import argparse

from ..comm.renamed import RenamedFlag


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbtrain validate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="local ranks (default: one per GPU, else 2 CPU ranks)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pipe-size", type=int, default=1, help="pipeline stages")
    p.add_argument("--zero-level", type=int, choices=(2, 3), default=3)
    p.add_argument("--num-micro-batches", type=int, default=1, help="micro-batches per step")
    for old, new in (
        ("--tp", "--tp-size"),
        ("--pp", "--pipe-size"),
        ("--micro-batches", "--num-micro-batches"),
    ):
        p.add_argument(old, dest=new[2:].replace("-", "_"), type=int, action=RenamedFlag, new=new)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--model",
        default="gpt",
        help="a registered model name (gpt, gpt2, llama, or one your package "
        "registers on import: --import mylab.mylm)",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        help="a module to import on every rank first (it calls register_model)",
    )
    p.add_argument(
        "--hf-path",
        default=None,
        help="a Hugging Face folder both runs start from (its config and weights)",
    )
    p.add_argument(
        "--model-size",
        choices=("tiny", "small", "medium"),
        default="tiny",
        help="the GPT's size (--model gpt only)",
    )
    p.add_argument("--seq-len", type=int, default=32, help="tokens per packed row")
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows of the global batch (default: 2 per rank x micro-batches)",
    )
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest |difference| of loss and of grad norm allowed (default 1e-5)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def synthetic_batches(count: int, rows: int, seq_len: int, vocab: int, seed: int) -> list:
    """`count` PackedBatches of random documents (2 to seq_len / 2 tokens), seeded."""
    import torch

    from .contracts import PackedBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        docs, room = [], rows * seq_len // 2  # half full: packing never runs out of rows
        while True:
            n = int(torch.randint(2, max(3, seq_len // 2 + 1), (1,), generator=g))
            if n > room:
                break
            docs.append(torch.randint(0, vocab, (n,), generator=g))
            room -= n
        out.append(PackedBatch.from_documents(docs, seq_len, rows))
    return out


def _configs(args):
    from .config import NBConfig, ParallelConfig, RuntimeConfig

    optimizer = {"name": args.optimizer, "lr": args.lr, "weight_decay": 0.0}
    if args.optimizer == "adamw":
        optimizer["eps"] = 1e-6  # see tests/support/runtime_cases.py: 1e-8 magnifies noise
    else:
        optimizer["momentum"] = 0.9
    import importlib

    for module in args.imports:
        importlib.import_module(module)
    model = (
        {"preset": args.model_size, "seq_len": args.seq_len}
        if args.model == "gpt" and args.hf_path is None
        else None
    )
    nb = dict(model_name=args.model, model_config=model, optimizer=optimizer, seed=args.seed)
    parallel = ParallelConfig(
        tp_size=args.tp_size,
        pipe_size=args.pipe_size,
        zero_level=args.zero_level,
        num_micro_batches=args.num_micro_batches,
    )
    return (
        RuntimeConfig("reference", hf_path=args.hf_path, backend_cfg=NBConfig(**nb)),
        RuntimeConfig(
            "nbtrain", hf_path=args.hf_path, backend_cfg=NBConfig(**nb, parallel=parallel)
        ),
    )


def _rank(args) -> list[dict]:
    """Runs on every rank (nbtrain.launch.run_ranks)."""
    from .compare import compare

    ref, mine = _configs(args)
    vocab = mine.backend_cfg.make_config(mine.hf_path).vocab_size
    data = synthetic_batches(2, args.rows, args.seq_len, vocab, args.seed)
    return compare(ref, mine, steps=args.steps, data=data, verbose=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..launch import default_world_size, run_ranks
    from .compare import format_table, max_deviation

    ranks = args.ranks or default_world_size()
    if ranks < 1 or args.steps < 1:
        raise SystemExit(f"--ranks={ranks} and --steps={args.steps} must be positive")
    _configs(args)[1].backend_cfg.parallel.check_world(ranks)  # before any rank starts
    dp = ranks // (args.tp_size * args.pipe_size)
    args.rows = args.rows or 2 * dp * args.num_micro_batches
    what = (
        f"{args.model_size} GPT"
        if args.model == "gpt" and not args.hf_path
        else f"{args.model}" + (f" from {args.hf_path}" if args.hf_path else "")
    )
    print(
        f"nbtrain validate: {what}, reference against tp={args.tp_size} "
        f"pp={args.pipe_size} dp={dp} ZeRO-{args.zero_level}, "
        f"{args.num_micro_batches} micro-batch(es), "
        f"{args.optimizer}, {args.steps} steps on {ranks} rank(s)",
        flush=True,
    )
    rows = run_ranks(_rank, ranks, args, seed=args.seed, timeout_s=3600)[0]
    # Printed here, not by rank 0: in this process's output, in order with the verdict.
    print(format_table(rows, ("reference", "nbtrain")), flush=True)
    dev = max_deviation(rows)
    worst = max(dev["loss"], dev["grad_norm"])
    verdict = "within" if worst <= args.tolerance else "EXCEEDS"
    print(f"{verdict} tolerance {args.tolerance:g} (largest deviation {worst:.3e})")
    return 0 if worst <= args.tolerance else 1
