"""`nbtrain plan`: a registered model's predicted peak memory per rank at one layout,
and with --device-memory which layouts over --ranks fit.

    nbtrain plan --model gpt --preset medium --tp-size 2 --batch 8 --seq 256
    nbtrain plan --model gpt_moe --preset small --ranks 8 --device-memory 80GiB
"""

from __future__ import annotations

import argparse
import json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nbtrain plan",
        description="predict each rank's peak memory (parameters, gradients, optimizer "
        "state, activations, communication buffers) for a layout; with --device-memory, "
        "which layouts over --ranks fit",
    )
    p.add_argument("--model", default="gpt", help="a registered model (gpt, gpt_moe, ...)")
    p.add_argument("--preset", default="small", help="the model's size (tiny, small, medium)")
    p.add_argument(
        "--model-config", default="{}", help='JSON of config fields, e.g. {"layers": 24}'
    )
    p.add_argument("--ranks", type=int, default=None, help="world size (default: the layout's)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pipe-size", type=int, default=1)
    p.add_argument("--cp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--zero-level", type=int, default=3, choices=(2, 3))
    p.add_argument("--num-micro-batches", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="rows of the global batch")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default seq_len)")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 master copies")
    p.add_argument("--offload", action="store_true", help="optimizer state on the host")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--device-memory", default=None, help="e.g. 80GiB: which layouts fit")
    return p


def main(argv=None) -> int:
    from ..models.registry import get_model
    from . import layouts_table, plan, plan_layouts

    args = build_parser().parse_args(argv)
    fields = {"preset": args.preset, **json.loads(args.model_config)}
    cfg = get_model(args.model).package.make_config(fields)
    common = dict(
        batch=args.batch,
        seq=args.seq,
        device_memory=args.device_memory,
        param_bytes=2 if args.bf16 else 4,
    )
    layout = dict(
        tp_size=args.tp_size,
        pipe_size=args.pipe_size,
        cp_size=args.cp_size,
        ep_size=args.ep_size,
        zero_level=args.zero_level,
        num_micro_batches=args.num_micro_batches,
        offload=args.offload,
        checkpointing=args.checkpointing,
    )
    print(plan(cfg, layout, world_size=args.ranks, **common).table())
    if args.device_memory is not None and args.ranks is not None:
        fixed = dict(offload=args.offload, checkpointing=args.checkpointing)
        plans = plan_layouts(cfg, args.ranks, **common, **fixed)
        print(f"\nlayouts over {args.ranks} ranks, smallest peak first:")
        print(layouts_table(plans))
    return 0
