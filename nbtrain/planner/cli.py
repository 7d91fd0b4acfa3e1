"""`nbtrain plan`: a registered model's predicted peak memory per rank at one layout,
and with --device-memory which layouts over --ranks fit.

    nbtrain plan --model gpt --model-size medium --tp-size 2 --batch 8 --seq-len 256
    nbtrain plan --model gpt_moe --model-size small --ranks 8 --device-memory 80GiB
    nbtrain plan --model llama --hf-path path/to/qwen2 --zero-level 3 --ranks 2
    nbtrain plan --model hf --hf-path path/to/any-causal-lm --seq-len 1024

`--model-size` and `--seq-len` are `nbtrain bench`'s names; the old `--preset` and
`--seq` still work, with a FutureWarning (docs/naming.md).

`--model hf` reads any transformers causal LM's config.json (its model is built on the
meta device); every model but nbtrain's GPTs gets its activation term from a traced
micro-batch.
"""

from __future__ import annotations

import argparse
import json

from ..comm.renamed import RenamedFlag


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nbtrain plan",
        description="predict each rank's peak memory (parameters, gradients, optimizer "
        "state, activations, communication buffers) for a layout; with --device-memory, "
        "which layouts over --ranks fit",
    )
    p.add_argument(
        "--model",
        default="gpt",
        help="a registered model (gpt, gpt_moe, llama, gpt2, yours), or hf: any "
        "transformers causal LM's folder given by --hf-path",
    )
    p.add_argument("--hf-path", default=None, help="a Hugging Face model folder")
    p.add_argument(
        "--model-size",
        default=None,
        help="the size of nbtrain's GPTs (tiny, small, medium; default small)",
    )
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
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per row (default: the model's seq_len)"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 master copies")
    p.add_argument("--offload", action="store_true", help="optimizer state on the host")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--device-memory", default=None, help="e.g. 80GiB: which layouts fit")
    # The old names (docs/naming.md), hidden, with a FutureWarning.
    p.add_argument("--preset", dest="model_size", action=RenamedFlag, new="--model-size")
    p.add_argument("--seq", dest="seq_len", type=int, action=RenamedFlag, new="--seq-len")
    return p


def _source(args):
    """What to plan: a transformers config (--model hf) or a RuntimeConfig."""
    from ..runtime import NBConfig, RuntimeConfig

    fields = json.loads(args.model_config)
    if args.model == "hf":
        if args.hf_path is None:
            raise SystemExit("nbtrain plan: --model hf needs --hf-path FOLDER (a config.json)")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(args.hf_path, local_files_only=True, **fields)
    if args.model in ("gpt", "gpt_moe"):
        fields = {"preset": args.model_size or "small", **fields}
    elif args.model_size is not None:
        raise SystemExit(
            f"nbtrain plan: --model-size is for nbtrain's GPTs; give {args.model}'s size with "
            "--hf-path FOLDER or --model-config JSON"
        )
    source = RuntimeConfig(
        "nbtrain",
        hf_path=args.hf_path,
        backend_cfg=NBConfig(model_name=args.model, model_config=fields),
    )
    try:
        source.backend_cfg.make_config(args.hf_path)
    except (KeyError, TypeError, ValueError) as err:
        raise SystemExit(
            f"nbtrain plan: model {args.model!r} could not make its config from "
            f"--model-config {args.model_config} ({type(err).__name__}: {err}): give "
            "--hf-path FOLDER, or every config field in --model-config, e.g. "
            '\'{"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8, ...}\''
        ) from None
    return source


def main(argv=None) -> int:
    from . import layouts_table, plan, plan_layouts

    args = build_parser().parse_args(argv)
    cfg = _source(args)
    common = dict(
        batch=args.batch,
        seq=args.seq_len,
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
